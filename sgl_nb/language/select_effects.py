"""What a Select's Scores do to its program: SelectEffects sends the choices' scoring
requests together, collects their logprobs, and when the Select's Node ends picks a choice
(select_scoring.py), appends it and binds it.

It is one part of the program's ProgramEffects (effects.py), on the executor's thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl_nb.language.errors import ProgramCancelled
from sgl_nb.language.select_scoring import choose
from sgl_nb.runtime.compiler.executor import Done
from sgl_nb.runtime.compiler.ir import Node, SelectNode

if TYPE_CHECKING:
    from sgl_nb.language.effects import ProgramEffects


class SelectEffects:
    def __init__(self, host: ProgramEffects):
        self.host, self.run = host, host.run

    def start_scores(self, group: list, dones: list[Done]) -> list[int | None]:
        """Start a Select's Score Instructions together; their requests, in order."""
        host, run = self.host, self.run
        node = run.nodes_by_id[group[0].node]
        run.speculated = ""  # its choice is not read off a speculated answer
        out = run.strategy.output(node)
        if out is not None:  # a re-run's: its choice is bound when the Node ends
            for done in dones:
                done(None, {out.flag: True})
            return [None] * len(dones)
        tok = host.backend.tokenizer
        prefix = (tok.bos_token or "\n") if group[0].unconditional else run.text
        post = host.executor.post

        def on_done_for(ins, done: Done):
            return lambda handle: post(lambda: self._scored(node, ins, handle, done))

        handles = host.backend.submit_scores(
            prefix, [ins.choice for ins in group], priority=host.priority, program=host.id,
            node=node.id, instructions=group,
            on_done=[on_done_for(ins, done) for ins, done in zip(group, dones)])
        for h in handles:
            host.hold(h)
        return [h.rid for h in handles]

    def _scored(self, node: Node, ins, handle, done: Done) -> None:
        out = self.host.outcome(handle, done)
        if out is None:
            return
        if self.run.cancelled or out.meta.get("finish_reason") == "abort":
            done(ProgramCancelled(f"select {ins.name!r} was aborted"), handle.usage())
            return
        self.run.scores.setdefault(node.id, {})[(ins.unconditional, ins.choice_index)] = \
            out.input_logprobs
        if not ins.unconditional:
            self.run.kv_len = len(self.run.text)  # the prefix scored
        done(None, handle.usage())

    def choose(self, node: SelectNode) -> BaseException | None:
        """All of a Select's Scores are in: pick, append, bind."""
        sel, got = self.run.payloads[node.id], self.run.scores.pop(node.id, {})
        out = self.run.strategy.output(node)
        if out is not None:
            self._bind_choice(sel, out.text, {"choices": list(sel.choices), out.flag: True})
            return None
        scored = node.scored()  # in choice order
        scores = [got[(False, i)] for i in scored]
        uncond = [got[(True, i)] for i in scored] if any(u for u, _ in got) else None
        try:
            j, meta = choose(sel.method, scores, uncond)
        except Exception as e:  # noqa: BLE001 - the node fails with it
            return e
        # The scores are those of the choices scored.
        self._bind_choice(sel, sel.choices[scored[j]],
                          {"choices": [sel.choices[i] for i in scored], **meta})
        return None

    def _bind_choice(self, sel, choice: str, meta: dict) -> None:
        self.run.append(choice, sel.name)
        if sel.name is not None:
            self.run.meta[sel.name] = meta
            self.run.bind(sel.name, choice)
