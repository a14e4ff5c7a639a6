"""What a Decode does to its program: GenEffects runs a Gen's request (streamed, read off a
speculated answer, or, in a re-run, taken from the record or the edit) and binds its value.

It is one part of the program's ProgramEffects (effects.py), on the executor's thread; the
engine's callbacks only post back to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl_nb.language import speculation
from sgl_nb.language.errors import ProgramCancelled
from sgl_nb.language.logprob_meta import ChunkMeta, logprob_meta
from sgl_nb.language.reasoning import split_reasoning
from sgl_nb.language.rerun_strategy import Output
from sgl_nb.runtime.compiler.executor import Done
from sgl_nb.runtime.compiler.ir import Node

if TYPE_CHECKING:
    from sgl_nb.language.effects import ProgramEffects


class GenEffects:
    def __init__(self, host: ProgramEffects):
        self.host, self.run = host, host.run

    def decode(self, node: Node, ins, done: Done) -> int | None:
        """Start a Gen's Decode; the engine request that runs it, if any."""
        host, run = self.host, self.run
        g, prompt = run.payloads[node.id], run.text
        out = run.strategy.output(node)
        if out is not None:  # a re-run: its recorded or edited value, no decoding
            self._gen_output(node, g, out, done)
            return None
        ins.params = run.strategy.params(node, ins.params)
        if host.state.spec_tokens and speculation.speculable(ins.params):
            return self._speculate(node, ins, g, done)
        run.speculated = ""
        gate = None
        stepper = run.stepper
        if stepper is not None:
            gate = stepper.may_decode
            stepper.add_waker(host.backend.wake)
        post = host.executor.post
        counted = ChunkMeta(g.logprob_options(host.defaults).get("return_text_in_logprobs"),
                            host.backend)

        def on_chunk(delta: str) -> None:
            post(lambda: run.append(delta, g.name, counted.next()))

        def on_done(handle) -> None:
            post(lambda: self._decoded(handle, g, prompt, done))

        handle = host.backend.submit(prompt, stream=True, gate=gate, priority=host.priority,
                                     program=host.id, node=node.id, instruction=ins,
                                     on_chunk=on_chunk, on_done=on_done, **ins.params)
        counted.handle = handle
        host.hold(handle)
        return handle.rid

    def _speculate(self, node: Node, ins, g, done: Done) -> int | None:
        """A gen read off the speculated answer; if there is none, one request for it and
        the rest (no stop string, spec_tokens long)."""
        host, run = self.host, self.run
        stop = list(ins.params["stop"]) if not isinstance(ins.params["stop"], str) \
            else [ins.params["stop"]]
        if run.speculated:
            value, run.speculated = speculation.take(run.speculated, stop)
            run.append(value, g.name)
            done(self._bind_gen(g, value, {"speculated": True}),
                 {"speculated": True, "output_tokens": 0})
            return None
        params = {**ins.params, "stop": [],
                  "max_tokens": max(ins.params.get("max_tokens", 0), host.state.spec_tokens)}

        def on_done(handle) -> None:
            host.executor.post(lambda: self._speculated_answer(handle, g, stop, done))

        handle = host.backend.submit(run.text, priority=host.priority, program=host.id,
                                     node=node.id, instruction=ins, on_done=on_done, **params)
        host.hold(handle)
        return handle.rid

    def _speculated_answer(self, handle, g, stop: list[str], done: Done) -> None:
        result = self.host.outcome(handle, done)
        if result is None:
            return
        value, self.run.speculated = speculation.take(result.text, stop)
        self.run.append(value, g.name)
        error = self._bind_gen(g, value, dict(result.meta))
        if result.meta.get("finish_reason") == "abort":
            error = ProgramCancelled(f"gen {g.name!r} was aborted")
        done(error, handle.usage())

    def _decoded(self, handle, g, prompt: str, done: Done) -> None:
        host = self.host
        result = host.outcome(handle, done)
        if result is None:
            return
        self._keep_tokens(handle, result)  # an aborted gen's tokens so far too
        aborted = result.meta.get("finish_reason") == "abort"
        self.run.kv_len = len(self.run.text)  # the prompt and what was generated are cached
        if g.name is not None:
            options = {} if aborted else g.logprob_options(host.defaults)
            try:
                extra = logprob_meta(result, options, host.backend, prompt)
            except BaseException as e:  # noqa: BLE001 - e.g. the prompt logprobs' request
                done(e, handle.usage())
                return
            # A cut-off value stays text.
            error = self._bind_gen(g, result.text, {**result.meta, **extra}, convert=not aborted)
            if error is not None:
                done(error, handle.usage())
                return
        error = ProgramCancelled(f"gen {g.name!r} was aborted") if aborted else None
        done(error, handle.usage())

    def _gen_output(self, node: Node, g, out: Output, done: Done) -> None:
        """A re-run's Gen: its recorded (with its tokens) or edited value."""
        self.run.append(out.text, g.name)
        if out.tokens is not None:
            self.run.tokens[node.id] = list(out.tokens)
        error = self._bind_gen(g, out.text, dict(out.meta))
        done(error, {out.flag: True} if error else {out.flag: True, "output_tokens": 0})

    def _bind_gen(self, g, text: str, meta: dict, convert: bool = True) -> BaseException | None:
        """A gen's value bound to its name (with its meta, its reasoning split off, converted
        as gen_int and friends ask); the error a conversion raised, if any."""
        if g.name is None:
            return None
        self.run.meta[g.name] = meta
        if g.reasoning is not None:
            reasoning, text = split_reasoning(text, g.reasoning)
            self.run.bind(g.name + "_reasoning_content", reasoning)
        try:
            self.run.bind(g.name, g.convert(text) if convert else text)
        except (TypeError, ValueError) as e:
            return e
        return None

    def _keep_tokens(self, handle, result) -> None:
        """A finished Gen's TokenChoices, by its Node's id (token_info reads them). The
        engine's requests carry them; a server's (RuntimeEndpoint) do not."""
        tokens = getattr(result, "tokens", None)
        node = getattr(getattr(handle, "req", None), "node", None)
        if tokens is not None and node is not None:
            self.run.tokens[node] = list(tokens)
