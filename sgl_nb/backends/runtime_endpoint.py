"""`sgl.RuntimeEndpoint`: the same programs on a serving engine (vLLM's OpenAI-compatible
API, or SGLang's native API). A Node becomes a request; the server's scheduler and prefix
cache do the rest. Fork branches are concurrent requests. Instructions belong to the
server, so the debugger steps Nodes only (`instruction_stepping` is False)."""

from __future__ import annotations

import functools
import itertools
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sgl_nb.backends.chat_roles import ChatRoles, derive_chat_roles
from sgl_nb.backends.remote.handle import RemoteHandle, ScoreShare, usage_of
from sgl_nb.backends.remote.http import HttpClient, RemoteError, RemoteFeatureError, Timeouts
from sgl_nb.backends.remote.openai_api import OpenAIApi
from sgl_nb.backends.remote.sglang_api import SGLangApi
from sgl_nb.runtime.events import (
    Event,
    EventBus,
    InstructionFinished,
    InstructionStarted,
    Op,
    Status,
    Token,
)
from sgl_nb.runtime.grammar import GrammarError
from sgl_nb.runtime.request import GenerateOutput
from sgl_nb.runtime.sampling_params import SamplingParams
from sgl_nb.runtime.token_usage import TokenUsage

APIS = {"openai": OpenAIApi, "sglang": SGLangApi}
_rids = itertools.count(1)

__all__ = ["RemoteError", "RemoteFeatureError", "RuntimeEndpoint"]


class RuntimeEndpoint:
    """A backend that sends each gen/select of a program to a server.

    base_url: e.g. "http://127.0.0.1:8000", or "http://127.0.0.1:8000/v1" as OpenAI's client
    takes it. api: "openai" (vLLM, SGLang's or `sgl-nb serve`'s /v1/completions) or "sglang"
    (SGLang's native /generate). model: the served model name (default: the first the
    server lists). tokenizer_path: a local folder with the model's tokenizer (chat roles and
    select need it; default: the model folder the server reports, when it exists on this
    machine). timeout: seconds any one read may wait; connect_timeout: seconds to
    connect."""

    instruction_stepping = False  # one token at a time happens on the server, out of reach
    cache = None  # the radix tree is the server's
    api_speculation = True  # num_api_spec_tokens saves a request per gen it covers

    def __init__(self, base_url: str, api: str = "openai", model: str | None = None,
                 api_key: str | None = None, tokenizer_path: str | Path | None = None,
                 timeout: float = 300.0, connect_timeout: float = 10.0):
        if api not in APIS:
            raise ValueError(f"api must be one of {sorted(APIS)}, got {api!r}")
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError("timeouts must be positive numbers of seconds")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = HttpClient(base_url, headers, Timeouts(connect_timeout, timeout))
        self.base_url = self.client.base_url
        self.api_name = api
        self.api = APIS[api](self.client, model)
        self._tokenizer_path = tokenizer_path
        self.events = EventBus()
        self.token_usage = TokenUsage()  # what the server's answers reported
        self._lock = threading.Lock()
        self._by_program: dict[int, set[RemoteHandle]] = {}  # requests in flight

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r}, api={self.api_name!r})"

    # ---- what the language layer reads ----------------------------------------------

    @property
    def model(self) -> str | None:
        """The served model's name (given, or asked once); None while the server cannot be
        asked: a label for traces, so it never raises (requests report the failure)."""
        try:
            with self._lock:
                return self.api.model()
        except RemoteError:
            return None

    @property
    def model_path(self) -> Path | None:
        """The served model's name as a path (its last part names the model in traces)."""
        name = self.model
        return Path(name) if name else None

    @property
    def model_name(self) -> str | None:
        path = self.model_path
        return path.name if path is not None else None

    def get_model_name(self) -> str | None:
        """The served model's name or path (SGLang's RuntimeEndpoint.get_model_name)."""
        return self.model

    @functools.cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self._find_tokenizer()))

    def _find_tokenizer(self) -> Path:
        if self._tokenizer_path is not None:
            path = Path(self._tokenizer_path).expanduser()
            if not path.is_dir():
                raise FileNotFoundError(f"tokenizer_path {str(path)!r} is not a folder")
            return path
        try:
            candidates = self.api.model_paths()
        except RemoteError as e:
            raise RemoteError(e.server, e.request, f"{e.problem} (needed to find the model's "
                              "tokenizer; or pass tokenizer_path=)") from e
        for p in candidates:
            if Path(p).expanduser().is_dir():
                return Path(p).expanduser()
        raise FileNotFoundError(
            f"{self.base_url} serves {candidates or 'an unnamed model'}, which is not a folder "
            "on this machine: pass RuntimeEndpoint(..., tokenizer_path=<a local folder with "
            "the model's tokenizer files>) for chat roles and select")

    @functools.cached_property
    def chat_roles(self) -> ChatRoles:
        return derive_chat_roles(self.tokenizer)

    def wake(self) -> None:
        """Nothing is held here: the server runs each request to its end."""

    def shutdown(self) -> None:
        """Nothing to stop: the server belongs to whoever started it."""

    def flush_cache(self) -> None:
        """SGLang's POST /flush_cache (SGLang servers and `sgl-nb serve`); the
        OpenAI-compatible API has no such route."""
        if self.api_name != "sglang":
            raise RemoteFeatureError(
                self.base_url, "flush_cache", "the OpenAI-compatible API cannot flush a "
                "server's cache; connect with api='sglang' to an SGLang server or sgl-nb serve")
        self.client.request_bytes("POST", "/flush_cache", {})

    def get_server_info(self) -> dict:
        """SGLang's /get_server_info; over the OpenAI-compatible API, /v1/models."""
        return self.client.get_json("/get_server_info" if self.api_name == "sglang"
                                    else "/v1/models")

    def check_grammar(self, regex: str | None, json_schema: str | dict | None) -> None:
        """Catch a malformed pattern at its program line; the server compiles the grammar."""
        try:
            if regex is not None:
                re.compile(regex)
            if isinstance(json_schema, str):
                json.loads(json_schema)
        except (re.error, ValueError) as e:
            what = f"regex {regex!r}" if regex is not None else f"JSON schema {json_schema!r}"
            raise GrammarError(f"invalid {what}: {e}") from e

    # ---- gen ----------------------------------------------------------------------------

    def submit(self, prompt: str | list[int], stream: bool = False, gate=None,
               priority: int | str | None = None, program: int | None = None,
               node: int | None = None, instruction=None, on_chunk=None, on_done=None,
               **params) -> RemoteHandle:
        """Send one generation request and return at once; the handle's `.cancel()` (or
        leaving `.chunks()` early) closes the connection, and the server aborts the request.
        `gate` (per-token stepping) and `priority` do not reach a server and are ignored.
        With `instruction` the executor reports the request's start and end, not this."""
        sp = SamplingParams(**params)
        return self._start(lambda h: self._generate(h, prompt, sp, stream, program, node,
                                                    instruction is None),
                           program, on_chunk, on_done)

    def prefill(self, prompt: str | list[int], priority: int | str | None = None,
                program: int | None = None, node: int | None = None, instruction=None,
                on_done=None) -> RemoteHandle:
        """One token generated after the prompt: the server's prefix cache (SGLang's radix
        tree, vLLM's automatic prefix caching) then holds the prompt."""
        return self.submit(prompt, program=program, node=node, instruction=instruction,
                           on_done=on_done, max_tokens=1, temperature=0.0)

    def _start(self, send, program: int | None, on_chunk=None, on_done=None) -> RemoteHandle:
        """A request in flight on its own thread, findable by cancel_program."""
        def run(h: RemoteHandle) -> GenerateOutput:
            try:
                return send(h)
            finally:
                with self._lock:
                    self._by_program.get(program, set()).discard(h)

        handle = RemoteHandle(next(_rids), run, on_chunk, on_done)
        with self._lock:
            live = self._by_program.setdefault(program, set())
            # A run that ended before this line could not let go of its handle: drop any
            # that are done (so nothing piles up) before adding this one.
            live.difference_update([h for h in live if h.done()])
            live.add(handle)
        return handle

    def cancel_program(self, program: int) -> None:
        """Cancel the requests of one program in flight (what `state.cancel()` asks of its
        backend): their connections close and the server aborts them."""
        with self._lock:
            handles = list(self._by_program.pop(program, ()))
        for h in handles:
            h.cancel()

    def generate(self, prompt: str | list[int], stream: bool = False,
                 priority: int | str | None = None, **params) -> GenerateOutput | Iterator[str]:
        """Like Runtime.generate for one prompt: the output, or its text chunks."""
        handle = self.submit(prompt, stream=stream, **params)
        return handle.chunks() if stream else handle.result()

    def _generate(self, h: RemoteHandle, prompt, sp: SamplingParams, stream: bool,
                  program: int | None, node: int | None, report: bool = True) -> GenerateOutput:
        path = "/v1/completions" if self.api_name == "openai" else "/generate"
        request = f"POST {path} (request {h.rid}{_where(program, node)})"
        # Logprobs come whole with the answer (streamed chunks differ between servers).
        stream = stream and not (sp.logprobs or sp.top_logprobs)
        got = _Received()
        emit = self._emit if report else _silent
        emit(InstructionStarted, h.rid, program, node, op=Op.DECODE)
        try:
            with _naming(request):  # the model name may be asked for first
                body = self.api.generate_body(prompt, sp, stream)
            send = self._send_stream if stream else self._send_once
            out = self._output(h, *send(h, path, body, request, got, program, node))
            out.logprobs, out.top_logprobs = got.logprobs
        except BaseException as e:
            if not h.cancelled:
                emit(InstructionFinished, h.rid, program, node, op=Op.DECODE,
                     status=Status.ERROR, error=repr(e), usage=self._server)
                raise
            # Cancelled: the connection was shut on purpose; keep what had arrived.
            out = self._output(h, "".join(got.pieces), got.acc.get("token_ids", []),
                               {**got.acc.get("meta", {}), "finish_reason": "abort"})
        emit(InstructionFinished, h.rid, program, node, op=Op.DECODE,
             usage={**usage_of(out.meta), **self._server})
        return out

    def _send_stream(self, h: RemoteHandle, path: str, body: dict, request: str,
                     got: _Received, program: int | None, node: int | None):
        for event in self.client.post_sse(path, body, _trace_headers(node), request,
                                          h.cancel_token):
            delta = self.api.stream_step(event, got.acc)
            if delta:
                got.pieces.append(delta)
                h.push(delta)
                self._emit(Token, h.rid, program, node, text=delta)
        meta = got.acc.get("meta", {})
        if meta.get("finish_reason") is None:
            raise RemoteError(self.base_url, request, "the stream ended without a finish reason")
        return "".join(got.pieces), got.acc.get("token_ids", []), meta

    def _send_once(self, h: RemoteHandle, path: str, body: dict, request: str,
                   got: _Received, program: int | None, node: int | None):
        obj = self.client.request_json("POST", path, body, _trace_headers(node), request,
                                       h.cancel_token)
        text, ids, meta = self.api.parse_answer(obj, request)
        got.logprobs = self.api.parse_logprobs(obj)
        h.push(text)
        return text, ids, meta

    def _output(self, h: RemoteHandle, text: str, ids: list[int], meta: dict) -> GenerateOutput:
        meta = {**meta, "server": self.base_url, "api": self.api_name, "request": h.rid,
                "retractions": 0, "e2e_latency": time.monotonic() - h.created,
                "ttft": None if h.first_chunk_at is None else h.first_chunk_at - h.created}
        meta.setdefault("completion_tokens", len(ids) or None)
        self.token_usage.add(meta.get("prompt_tokens"), meta.get("completion_tokens"))
        return GenerateOutput(text=text, token_ids=ids, meta=meta)

    # ---- select -------------------------------------------------------------------------

    def score(self, prefix: str | list[int], choices: list[str | list[int]],
              priority: int | str | None = None, program: int | None = None,
              node: int | None = None) -> list[list[float]]:
        """Logprob of each token of each choice after `prefix`, read from the server's
        prompt logprobs (prefix and choice tokenized separately, as locally)."""
        return self._score(next(_rids), prefix, choices, program, node, True)[0]

    def submit_scores(self, prefix: str | list[int], continuations: list[str | list[int]],
                      priority: int | str | None = None, program: int | None = None,
                      node: int | None = None, instructions: list | None = None,
                      on_done: list | None = None) -> list[ScoreShare]:
        """Every continuation's score in one request (what a Select's Score Instructions
        run; the executor reports them): one share of it per continuation, each a handle
        whose result has that continuation's input_logprobs."""
        def send(h: RemoteHandle) -> GenerateOutput:
            scores, usage = self._score(h.rid, prefix, continuations, program, node, False)
            meta = {**usage, "completion_tokens": 0, "finish_reason": "score",
                    "server": self.base_url}
            return GenerateOutput("", [], meta, input_logprobs=scores)

        shares = [ScoreShare(i) for i in range(len(continuations))]

        def finished(h: RemoteHandle) -> None:
            for share, done in zip(shares, on_done or [None] * len(shares)):
                if done is not None:
                    done(share)

        handle = self._start(send, program, on_done=finished)
        for share in shares:
            share.handle = handle
        return shares

    def _score(self, rid: int, prefix, choices, program, node, report: bool):
        pre = self._ids(prefix)
        if not pre:
            raise ValueError("score needs a non-empty prefix")
        ids = [self._ids(c) for c in choices]
        for c, i in zip(choices, ids):
            if not i:
                raise ValueError(f"empty continuation to score: {c!r}")
        path = "/v1/completions" if self.api_name == "openai" else "/generate"
        request = f"POST {path} (select, request {rid}{_where(program, node)})"
        emit = self._emit if report else _silent
        emit(InstructionStarted, rid, program, node, op=Op.SCORE)
        try:
            with _naming(request):
                body = self.api.score_body(pre, ids)
            obj = self.client.request_json("POST", path, body, _trace_headers(node), request)
            scores, usage = self.api.parse_score(obj, pre, ids, request)
            self.token_usage.add(usage.get("prompt_tokens"), 0)
        except BaseException as e:
            emit(InstructionFinished, rid, program, node, op=Op.SCORE, status=Status.ERROR,
                 error=repr(e), usage=self._server)
            raise
        figures = usage_of({**usage, "completion_tokens": 0, "finish_reason": "score"})
        emit(InstructionFinished, rid, program, node, op=Op.SCORE,
             usage={**figures, **self._server})
        return scores, usage

    def _ids(self, text: str | list[int]) -> list[int]:
        if isinstance(text, str):
            return self.tokenizer.encode(text)
        if isinstance(text, list | tuple):
            return list(text)
        raise TypeError(f"expected a string or token ids, got {type(text).__name__}")

    # ---- events -------------------------------------------------------------------------

    def _emit(self, cls: type[Event], rid: int, program: int | None, node: int | None,
              **fields) -> None:
        self.events.emit(cls, program=program, node=node, request=rid, **fields)

    @property
    def _server(self) -> dict:
        """What an instruction_finished event says of where its request ran."""
        return {"server": self.base_url}


class _Received:
    """What a request got before it ended: streamed pieces, ids and meta, logprobs."""

    def __init__(self):
        self.pieces: list[str] = []
        self.acc: dict = {}
        self.logprobs: tuple = (None, None)


@contextmanager
def _naming(request: str):
    """A failure on the way to a request (asking the model name) names that request too."""
    try:
        yield
    except RemoteError as e:
        raise type(e)(e.server, f"{request}, at {e.request}", e.problem, e.status) from e


def _silent(*_args, **_fields) -> None:
    """A request the executor reports: no events of its own."""


def _where(program: int | None, node: int | None) -> str:
    return "".join(f", {k} {v}" for k, v in (("program", program), ("node", node))
                   if v is not None)


def _trace_headers(node: int | None) -> dict[str, str]:
    """W3C trace context: a server with its own tracing joins the program's trace."""
    if node is None:
        return {}
    try:
        from sgl_nb.tracing import traceparent_for
    except ImportError:  # tracing without context propagation yet
        return {}
    tp = traceparent_for(node)
    return {"traceparent": tp} if tp else {}
