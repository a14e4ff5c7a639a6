"""`sgl.Runtime`: the in-kernel engine as the user sees it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

from sgl_nb.backends.chat_roles import ChatRoles, derive_chat_roles
from sgl_nb.runtime.engine import Engine
from sgl_nb.runtime.engine_config import EngineConfig
from sgl_nb.runtime.priority import parse_priority
from sgl_nb.runtime.request import GenerateOutput
from sgl_nb.runtime.request_handle import RequestHandle
from sgl_nb.runtime.sampling_params import SamplingParams

# SGLang's Runtime takes ServerArgs' names; those with a setting of ours are mapped to it.
SGLANG_SETTINGS = {"max_total_tokens": "kv_pool_tokens", "max_running_requests": "max_running",
                   "chunked_prefill_size": "max_prefill_tokens"}
# ServerArgs' names about the HTTP server SGLang's Runtime starts in a child process: this
# Runtime starts none (`sgl-nb serve` is the server), so they have nothing to set.
SERVER_ONLY_SETTINGS = ("log_level", "launch_timeout", "host", "port")
# ServerArgs' names a program may pass that this engine cannot honour, and why.
REFUSED_SETTINGS = {
    "tokenizer_path": "the tokenizer is read from the model folder (model_path)",
    "context_length": "the model's own context length (max_position_embeddings) is used",
    "mem_fraction_static": "the KV pool is sized in tokens: kv_pool_tokens=",
    "disable_radix_cache": "the radix prefix cache is always on (sgl.flush_cache() empties it)",
    "random_seed": "sampling is seeded per request: seed= on gen() or run()",
    "tp_size": "one device, one process: no tensor parallelism",
    "dp_size": "one device, one process: no data parallelism",
}


class Runtime:
    """A model loaded in this process with a paged KV pool, a radix prefix cache and a
    background engine thread. `generate` may be called from any thread, several at once."""

    def __init__(self, model_path: str | Path | None = None, **settings):
        """`settings` are EngineConfig's fields (runtime/engine_config.py), checked before
        anything loads: kv_pool_tokens (the KV pool's capacity in tokens),
        max_prefill_tokens, max_running, dtype ("float32", "bfloat16", "float16"; None:
        bfloat16 on CUDA or with quantization, float32 otherwise), device, quantization
        (None, "int8" or "int4", weight-only, quantized once into the cache folder),
        time_slice (decode steps a request runs before it yields to waiting
        higher-priority work), preemption (False: priorities only order the queue),
        starvation_steps (after waiting this long any request runs one slice at the top
        level), schedule_policy ("lpm": a long queue admits the longest cached prefix
        first; or "fifo"). An unknown setting is a TypeError naming it.

        SGLang's names are taken too: max_total_tokens (kv_pool_tokens),
        max_running_requests (max_running), chunked_prefill_size (max_prefill_tokens),
        dtype="auto"; log_level, launch_timeout, host and port are accepted and set nothing
        (no server is started); the ServerArgs this engine cannot honour are a ValueError
        saying why."""
        settings = _our_settings(settings)
        names = [f.name for f in dataclasses.fields(EngineConfig)]
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise TypeError(f"Runtime() got unknown settings {unknown}; it takes {names}")
        self.engine = Engine(EngineConfig(model_path, **settings))

    instruction_stepping = True  # the step controller gates each decode step
    api_speculation = False  # the radix cache serves a gen's prefix: nothing to save

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def events(self):
        """The engine's event stream: .subscribe() gives a queue of runtime Events."""
        return self.engine.events

    @property
    def token_usage(self):
        """Prompt and completion tokens of every request so far (`.reset()` zeroes them)."""
        return self.engine.token_usage

    @property
    def cache(self):
        """The radix tree (the views draw it)."""
        return self.engine.cache

    @property
    def model_name(self) -> str:
        return self.model_path.name

    def get_tokenizer(self):
        """SGLang's Runtime spells it so."""
        return self.tokenizer

    @property
    def endpoint(self) -> Runtime:
        """SGLang's Runtime holds a RuntimeEndpoint to its server here; this Runtime runs the
        programs itself, so it is its own endpoint (`rt.endpoint.get_model_name()`)."""
        return self

    def get_model_name(self) -> str:
        """The model folder, as SGLang's RuntimeEndpoint reports its server's model_path."""
        return str(self.model_path)

    @property
    def model_path(self) -> Path:
        return self.engine.model_path

    @functools.cached_property
    def chat_roles(self) -> ChatRoles:
        """Role prefixes/suffixes from the model's own chat template (for sgl.user() etc.)."""
        return derive_chat_roles(self.tokenizer)

    def generate(
        self,
        prompt: str | list[int] | list[str] | list[list[int]],
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        logprobs: bool = False,
        top_logprobs: int = 0,
        regex: str | None = None,
        json_schema: str | dict | None = None,
        min_tokens: int = 0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        stream: bool = False,
        priority: str = "normal",
        jump_forward: bool | None = None,
        prompt_lookup: bool | None = None,
    ) -> GenerateOutput | list[GenerateOutput] | Iterator[str]:
        """Generate from a string or a list of token ids; a list of those is a batch.
        priority: "interactive" > "normal" > "batch" (see the scheduler). jump_forward:
        with a regex or json_schema, text the grammar forces is computed in one step
        (default: the Runtime's setting, on). prompt_lookup: tokens that repeat an
        earlier n-gram are drafted and checked in one step (same output)."""
        level = parse_priority(priority)
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, seed=seed, stop=stop or [], stop_token_ids=stop_token_ids or [],
            ignore_eos=ignore_eos, logprobs=logprobs, top_logprobs=top_logprobs,
            regex=regex, json_schema=json_schema, min_tokens=min_tokens,
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
            repetition_penalty=repetition_penalty, jump_forward=jump_forward,
            prompt_lookup=prompt_lookup,
        )
        batch = _is_batch(prompt)
        if batch and stream:
            raise ValueError("stream=True takes one prompt, not a batch")
        prompts = prompt if batch else [prompt]
        # Check every request before submitting any, so a bad one leaves nothing running.
        reqs = [self.engine.make_request(self._token_ids(p), params) for p in prompts]
        for r in reqs:
            r.priority = level
        handles = [self.engine.submit(r, stream=stream) for r in reqs]
        if stream:
            return handles[0].chunks()
        outs = wait_all(handles)
        return outs if batch else outs[0]

    def submit(self, prompt: str | list[int], stream: bool = False, gate=None,
               priority: str | int | None = None, program: int | None = None,
               node: int | None = None, instruction=None, on_chunk=None, on_done=None,
               **params) -> RequestHandle:
        """Start one request and return at once; the handle's .result() waits for it.
        `gate`, if given, is asked before each decode step whether the request may go on;
        program/node say which program Node it runs for (carried on its events), and
        `instruction` the Instruction (the executor reports it; the engine does not).
        on_chunk(text) / on_done(handle) are called on the engine thread and must return
        at once."""
        req = self.engine.make_request(self._token_ids(prompt), SamplingParams(**params))
        req.gate, req.priority = gate, parse_priority(priority)
        req.program, req.node, req.instruction = program, node, instruction
        return self.engine.submit(req, stream=stream, on_chunk=on_chunk, on_done=on_done)

    def prefill(self, prompt: str | list[int], priority: str | int | None = None,
                program: int | None = None, node: int | None = None, instruction=None,
                on_done=None) -> RequestHandle:
        """The prompt's KV into the radix cache, as one prefill; no token is sampled (a
        score request of its last token: the scheduler's usual path, no token events)."""
        ids = self._token_ids(prompt)
        if len(ids) < 2:
            raise ValueError(f"prefill needs at least 2 tokens, got {len(ids)}")
        req = self.engine.make_score_request(ids, len(ids) - 1)
        req.priority, req.program, req.node = parse_priority(priority), program, node
        req.instruction = instruction
        return self.engine.submit(req, on_done=on_done)

    def abort(self, rid: int) -> bool:
        """Abort request `rid` (a handle's `.req.rid`, or `out.meta["id"]`): it leaves the
        batch before the next step and finishes with finish_reason "abort", its text so far
        kept. False if it is not running or queued."""
        return self.engine.abort(rid)

    def cancel_program(self, program: int) -> None:
        """Abort every request of one program (what `state.cancel()` asks of its backend)."""
        self.engine.abort_program(program)

    def wake(self) -> None:
        """Re-check programs held by a step controller now (a step was granted)."""
        self.engine.wake()

    def metrics(self) -> dict:
        """Queue lengths, cache hit rate, preemptions, retractions, forks, joins, tok/s."""
        return self.engine.metrics()

    def score(self, prefix: str | list[int], continuations: list[str | list[int]],
              priority: str | int | None = None, program: int | None = None,
              node: int | None = None) -> list[list[float]]:
        """Logprob of each token of each continuation after `prefix` (prefix and continuation
        tokenized separately). The continuations run as one batch; the prefix is computed once."""
        reqs = [self._score_request(prefix, c, priority, program, node, i)
                for i, c in enumerate(continuations)]
        handles = [self.engine.submit(r) for r in reqs]
        return [out.input_logprobs for out in wait_all(handles)]

    def submit_scores(self, prefix: str | list[int], continuations: list[str | list[int]],
                      priority: str | int | None = None, program: int | None = None,
                      node: int | None = None, instructions: list | None = None,
                      on_done: list | None = None) -> list[RequestHandle]:
        """Each continuation's score, at once, one request each (what a Select's Score
        Instructions run, batched by the engine; the prefix is computed once): a handle's
        result has input_logprobs. on_done[i] as in `submit`."""
        reqs = [self._score_request(prefix, c, priority, program, node, i)
                for i, c in enumerate(continuations)]  # all checked before any is sent
        handles = []
        for i, req in enumerate(reqs):
            if instructions is not None:
                req.instruction, req.index = instructions[i], instructions[i].index
            handles.append(self.engine.submit(req, on_done=on_done[i] if on_done else None))
        return handles

    def _score_request(self, prefix, continuation, priority, program, node, index: int):
        pre = self._token_ids(prefix)
        if not pre:
            raise ValueError("score needs a non-empty prefix")
        ids = self._token_ids(continuation)
        if not ids:
            raise ValueError(f"empty continuation to score: {continuation!r}")
        req = self.engine.make_score_request(pre + ids, len(pre))
        req.priority, req.program, req.node = parse_priority(priority), program, node
        req.index = index
        return req

    def check_grammar(self, regex: str | None, json_schema: str | dict | None) -> None:
        """Raise GrammarError (a ValueError naming the pattern) if it does not compile."""
        self.engine.grammars().matcher(regex, json_schema)

    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            # Only the special tokens the tokenizer adds by itself (SmolLM2: none).
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple):
            return list(prompt)
        raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt)}")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt=True,
                            tools: list[dict] | None = None) -> str:
        """tools: OpenAI-style function tools, passed to the template (which may ignore them)."""
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def cache_stats(self) -> dict:
        return self.engine.cache_stats()

    def cache_prefix(self, prefix: str) -> None:
        """Compute `prefix` into the radix cache now (SGLang's Runtime.cache_prefix), so
        requests that start with it reuse its KV."""
        self.prefill(prefix).result()

    def flush_cache(self) -> int:
        """Drop the radix cache's prefixes (those running requests hold stay); the number
        of tokens freed. `sgl.flush_cache()` calls it on the default backend."""
        return self.engine.flush_cache()

    def get_server_info(self) -> dict:
        """What runs here, under the keys of SGLang's /server_info that clients read
        (model_path, tokenizer_path, context_length, max_total_num_tokens,
        max_running_requests, version, internal_states[0] with last_gen_throughput and
        memory_usage, ...), then ours: context_len, kv_pool_tokens and the scheduler's
        figures (rt.metrics()). `sgl.get_server_info()` and `sgl-nb serve`'s
        /get_server_info return this. No avg_spec_accept_length: there is no speculative
        decoding here (SGLang leaves it out then too)."""
        eng, cfg, pool = self.engine, self.engine.settings, self.engine.pool
        metrics = eng.metrics()
        path, dtype = str(eng.model_path), str(eng.model.dtype).removeprefix("torch.")
        kv_bytes = sum(t.nbytes for t in (*pool.k_buffers, *pool.v_buffers))
        state = {"last_gen_throughput": metrics["tokens_per_second"], "world_size": 1,
                 "effective_max_running_requests_per_dp": cfg.max_running,
                 "memory_usage": {"kvcache": round(kv_bytes / 2**30, 3),
                                  "token_capacity": pool.capacity}}
        return {
            "model_path": path, "tokenizer_path": path, "served_model_name": self.model_name,
            "context_length": eng.context_len, "max_total_num_tokens": pool.capacity,
            "max_total_tokens": pool.capacity,
            "max_req_input_len": min(eng.context_len, pool.capacity) - 1,
            "max_running_requests": cfg.max_running, "max_prefill_tokens": cfg.max_prefill_tokens,
            "chunked_prefill_size": cfg.max_prefill_tokens, "page_size": 1,
            "schedule_policy": cfg.schedule_policy, "dtype": dtype, "kv_cache_dtype": dtype,
            "quantization": eng.model.quantization, "device": str(eng.device),
            "tp_size": 1, "dp_size": 1, "disable_radix_cache": False, "version": version("sgl-nb"),
            "internal_states": [state],
            "context_len": eng.context_len, "kv_pool_tokens": pool.capacity, **metrics,
        }

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _our_settings(settings: dict) -> dict:
    """SGLang's ServerArgs names as EngineConfig's; refused ones are a ValueError."""
    out = {}
    for name, value in settings.items():
        if name in REFUSED_SETTINGS:
            raise ValueError(f"Runtime({name}=...) is not supported: {REFUSED_SETTINGS[name]}")
        if name in SERVER_ONLY_SETTINGS:
            continue
        ours = SGLANG_SETTINGS.get(name, name)
        if ours in out:
            raise TypeError(f"Runtime() got {ours} twice (once as SGLang's {name})")
        out[ours] = None if name == "dtype" and value == "auto" else value
    return out


def wait_all(handles: list[RequestHandle]) -> list[GenerateOutput]:
    """Each handle's output, in order. An interrupt while waiting (Ctrl-C, a Jupyter
    interrupt) aborts them all before it propagates: nothing is left decoding for a caller
    that has gone."""
    try:
        return [h.result() for h in handles]
    except BaseException:
        for h in handles:
            h.cancel()
        raise


def _is_batch(prompt) -> bool:
    if isinstance(prompt, str) or not isinstance(prompt, list | tuple) or not prompt:
        return False
    return isinstance(prompt[0], str | list | tuple)
