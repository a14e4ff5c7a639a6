"""Runtime Events -> OpenTelemetry spans: one per program, per Node, per Instruction.

`SpanRecorder` is an EventBus callback: it runs on the publishing thread (the engine's or a
program's), so it only does bookkeeping and starts/ends SDK spans with the events' own
timestamps; encoding and export happen in the span processor's thread. Everything a replay
needs to rebuild the Events is on the spans (see codec.py and load.py)."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict

from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, StatusCode
from opentelemetry.trace import Status as SpanStatus

from sgl_nb.runtime.events import (
    Event,
    Failed,
    Forked,
    InstructionFinished,
    InstructionStarted,
    Joined,
    NodeFinished,
    NodeKind,
    NodeQueued,
    NodeStarted,
    Op,
    ProgramFinished,
    ProgramStarted,
    Status,
    Token,
    VariableSet,
)
from sgl_nb.tracing import codec
from sgl_nb.tracing.genai import LLM_KINDS, instruction_usage, node_llm_attrs, node_span_name

# A token's own columns at the default level; its other fields (step, and the top
# alternatives and allowed count of runtime/token_choice.py) go in "sgl.tokens.extra".
_TOKEN_KEYS = ("token", "text", "logprob", "forced", "drafted")
_ENGINE_OPS = (Op.DECODE, Op.SCORE)
_MAX_ENDED = 100_000  # ended span contexts kept for parents and links (bounded)


class _Bounded(OrderedDict):
    """A dict that forgets its oldest entries past _MAX_ENDED: what is kept per program or
    node after it ended (for parents and links) must not grow without end in a long-lived
    kernel."""

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if len(self) > _MAX_ENDED:
            self.popitem(last=False)


class _Open:
    """A live span and what it gathers until it ends."""

    __slots__ = ("span", "kind", "usage", "tokens", "start_ts", "program")

    def __init__(self, span, kind: NodeKind | Op | None = None, start_ts: int = 0,
                 program=None):
        self.span, self.kind, self.start_ts, self.program = span, kind, start_ts, program
        self.usage: list[dict] = []  # what the node's Decode/Score instructions reported
        # (id, text, logprob, forced, seq, ts, extra, drafted)
        self.tokens: list[tuple] = []


class SpanRecorder:
    def __init__(self, tracer: trace.Tracer, level: str = "node", model: str | None = None):
        if level not in ("node", "token"):
            raise ValueError(f"tracing level must be 'node' or 'token', got {level!r}")
        self.tracer, self.level, self.model = tracer, level, model
        self.measure = False  # set by `sgl-nb bench tracing`: add up the CPU time spent here
        self.cpu_ns = 0
        # Event ts is time.monotonic_ns(); spans want epoch ns: one offset, taken now.
        self.offset = time.time_ns() - time.monotonic_ns()
        self._lock = threading.Lock()
        self._pending: dict[int, ProgramStarted] = {}  # span not opened yet
        self._early: dict[int, list[Event]] = {}  # ... and what waits for it
        self._programs: dict[int, _Open] = {}
        self._nodes: dict[int, _Open] = {}
        self._instructions: dict[tuple, _Open] = {}  # (node, index, request)
        self._by_request: dict[int, tuple] = {}
        self._ended: dict[tuple[str, int], SpanContext] = _Bounded()
        self._fork_ctx: dict[int, tuple[int, SpanContext]] = _Bounded()  # child -> parent
        self._children: dict[int, list[int]] = {}  # emptied as programs end
        self._last_node: dict[int, SpanContext] = _Bounded()  # program -> latest node span
        self._models: dict[int, str] = _Bounded()

    # ---- the callback ------------------------------------------------------------------

    def __call__(self, e: Event) -> None:
        t0 = time.thread_time_ns() if self.measure else 0
        with self._lock:
            self._record(e)
            if self.measure:
                self.cpu_ns += time.thread_time_ns() - t0

    def _record(self, e: Event) -> None:
        match e:
            case ProgramStarted():
                if e.program is not None:
                    self._pending[e.program] = e
            case ProgramFinished():
                self._program_finished(e)
            case Forked():
                self._fork(e)
            case Joined():
                self._join(e)
            case NodeQueued() | VariableSet():
                self._program_event(e)
            case NodeStarted():
                self._node_started(e)
            case NodeFinished():
                self._node_finished(e)
            case InstructionStarted():
                self._instruction_started(e)
            case InstructionFinished():
                self._instruction_finished(e)
            case Token():
                self._token(e)
            case _:
                self._span_event(e)

    def traceparent(self, node_id: int) -> str | None:
        with self._lock:
            o = self._nodes.get(node_id)
        if o is None:
            return None
        c = o.span.get_span_context()
        # W3C Trace Context level 1: of the flags, only "sampled".
        return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags) & 1:02x}"

    def close(self) -> None:
        """End every span still open (tracing is being turned off)."""
        now = time.monotonic_ns()
        with self._lock:
            for pid in list(self._pending):
                self._program(pid)
            for table in (self._instructions, self._nodes, self._programs):
                for key in list(table):
                    self._end(table, key, now)

    # ---- opening and closing spans -----------------------------------------------------

    def _epoch(self, ts: int) -> int:
        return ts + self.offset

    def _start(self, name: str, ts: int, parent: SpanContext | None, attrs: dict,
               links: list[Link] | None = None):
        ctx = trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent else None
        if parent is None:
            ctx = trace.set_span_in_context(trace.INVALID_SPAN)  # a new trace, not the caller's
        return self.tracer.start_span(name, context=ctx, attributes=attrs, links=links or (),
                                      start_time=self._epoch(ts))

    def _end(self, table: dict, key, ts: int, seq: int | None = None) -> _Open | None:
        o = table.pop(key, None)
        if o is None:
            return None
        if seq is not None:
            o.span.set_attribute(codec.END_SEQ, seq)
        kind = "program" if table is self._programs else "node" if table is self._nodes else ""
        if kind:
            self._ended[(kind, key)] = o.span.get_span_context()
        o.span.end(end_time=self._epoch(ts))
        return o

    def _ctx(self, kind: str, key: int | None) -> SpanContext | None:
        if key is None:
            return None
        table = self._programs if kind == "program" else self._nodes
        o = table.get(key)
        return o.span.get_span_context() if o is not None else self._ended.get((kind, key))

    def _program(self, pid: int | None) -> _Open | None:
        """The program's span, opened on first need: a fork branch's parent is only known
        once its parent's fork event has come, which may follow the branch's start."""
        if pid is None:
            return None
        o = self._programs.get(pid)
        if o is not None or ("program", pid) in self._ended:
            return o
        started = self._pending.pop(pid, None)
        d = codec.event_data(started) if started is not None else {}
        fork = self._fork_ctx.get(pid)
        parent = d.get("parent", fork[0] if fork else None)
        parent_ctx = fork[1] if fork else self._ctx("program", parent)
        model = d.get("model") or self._models.get(parent) or self.model
        self._models[pid] = model
        attrs = {codec.SPAN_TYPE: "program", codec.PROGRAM: pid,
                 "openinference.span.kind": "CHAIN",
                 **codec.to_attrs({**d, "parent": parent}, "sgl.program.")}
        if started is not None:
            attrs[codec.SEQ] = started.seq
            if started.node is not None:  # a fork branch starts at its parent's Fork node
                attrs["sgl.program.fork_node"] = started.node
        else:
            attrs["sgl.program.implicit"] = True  # no program_started event was seen
        ts = started.ts if started is not None else time.monotonic_ns()
        span = self._start(f"program {d.get('function') or pid}", ts, parent_ctx, attrs)
        o = self._programs[pid] = _Open(span, "program", ts, pid)
        if parent is not None:
            self._children.setdefault(parent, []).append(pid)
        for queued in self._early.pop(pid, []):
            self._span_event(queued)
        return o

    # ---- programs ----------------------------------------------------------------------

    def _program_finished(self, e: ProgramFinished) -> None:
        o = self._program(e.program)
        if o is None:
            return
        err, status = e.error, e.status
        if status:
            o.span.set_attribute("sgl.program.status", status.value)
        if e.line is not None:
            o.span.set_attribute("sgl.program.error_line", e.line)
        if err:
            o.span.set_attribute("sgl.program.error", str(err))
            if status is not Status.CANCELLED:  # a cancel was asked for: not a fault
                o.span.set_status(SpanStatus(StatusCode.ERROR, str(err)))
        self._end_children(e.program, e.ts)
        self._end(self._programs, e.program, e.ts, e.seq)

    def _end_children(self, pid: int, ts: int) -> None:
        """Fork branches that never reported their end close with their parent's join."""
        for child in self._children.pop(pid, []):
            self._end_children(child, ts)
            self._end(self._programs, child, ts)

    def _fork(self, e: Forked) -> None:
        ctx = self._ctx("node", e.node) or self._ctx("program", e.program)
        if ctx is None:
            self._program(e.program)
            ctx = self._ctx("program", e.program)
        for child in e.children:
            self._fork_ctx[child] = (e.program, ctx)
        self._span_event(e)

    def _join(self, e: Joined) -> None:
        self._span_event(e)
        for child in e.children:
            self._end_children(child, e.ts)
            self._end(self._programs, child, e.ts)

    # ---- nodes -------------------------------------------------------------------------

    def _program_event(self, e: NodeQueued | VariableSet) -> None:
        """What a program's body says (a Node queued, a variable set), on its program's
        span: a body runs before the executor says the program started, so what it says
        then waits for the span to open."""
        if e.program in self._programs or ("program", e.program) in self._ended:
            self._span_event(e)
        elif e.program is not None:
            self._early.setdefault(e.program, []).append(e)

    def _node_started(self, e: NodeStarted) -> None:
        if e.node is None:
            return
        prog = self._program(e.program)
        attrs = {codec.SPAN_TYPE: "node", codec.SEQ: e.seq,
                 **codec.id_attrs(e.program, e.node, None),
                 **codec.to_attrs(codec.event_data(e), "sgl.node.")}
        if e.line is not None:
            attrs["code.lineno"] = e.line
        if e.file:
            attrs["code.filepath"] = e.file
        model = self._models.get(e.program) or self.model
        attrs.update(node_llm_attrs(e.node_kind, model))
        links = self._join_links(e)
        parent = prog.span.get_span_context() if prog is not None else None
        span = self._start(node_span_name(e.node_kind, e.name), e.ts, parent, attrs, links)
        self._nodes[e.node] = _Open(span, e.node_kind, e.ts, e.program)
        if e.program is not None:
            self._last_node[e.program] = span.get_span_context()

    def _join_links(self, e: NodeStarted) -> list[Link]:
        """A Join links to each branch's last span (its predecessors)."""
        if e.node_kind is not NodeKind.JOIN:
            return []
        ctxs = [self._ctx("node", p) for p in e.preds]
        if not any(ctxs):
            ctxs = [self._last_node.get(c) for c in self._children.get(e.program, [])]
        return [Link(c, {"sgl.link": "join"}) for c in ctxs if c is not None]

    def _node_finished(self, e: NodeFinished) -> None:
        o = self._nodes.get(e.node)
        if o is None:
            return
        span = o.span
        for k, v in codec.to_attrs(codec.event_data(e), "sgl.node.finished.").items():
            span.set_attribute(k, v)
        if e.status is Status.ERROR:
            span.set_status(SpanStatus(StatusCode.ERROR))
        if o.usage or o.kind in LLM_KINDS:
            for k, v in instruction_usage(o.usage, len(o.tokens)).items():
                span.set_attribute(k, v)
        if o.tokens:
            self._set_tokens(o)
        if e.text is not None:  # the node's own output, when reported
            span.set_attribute("output.value", e.text)
            span.set_attribute("sgl.output", e.text)
        self._end(self._nodes, e.node, e.ts, e.seq)

    def _set_tokens(self, o: _Open) -> None:
        """Tokens, compactly, as parallel arrays on the node span (the default level);
        a replay turns them back into token Events."""
        ids, texts, logprobs, forced, seqs, ts, extra, drafted = zip(*o.tokens)
        span = o.span
        span.set_attribute("sgl.tokens.id", [-1 if t is None else t for t in ids])
        span.set_attribute("sgl.tokens.text", list(texts))
        span.set_attribute("sgl.tokens.logprob",
                           [float("nan") if x is None else float(x) for x in logprobs])
        span.set_attribute("sgl.tokens.forced", list(forced))
        if any(drafted):  # prompt lookup's accepted drafts (traces before it: none)
            span.set_attribute("sgl.tokens.drafted", list(drafted))
        span.set_attribute("sgl.tokens.seq", list(seqs))
        span.set_attribute("sgl.tokens.ts", [t - o.start_ts for t in ts])
        if any(extra):  # fields beyond the usual four, one JSON object per token
            span.set_attribute("sgl.tokens.extra",
                               [json.dumps(x or {}, default=str) for x in extra])
        text = "".join(texts)  # a stop token's text included, as the engine sampled it
        span.set_attribute("output.value", text)
        span.set_attribute("output.mime_type", "text/plain")
        span.set_attribute("sgl.output", text)

    # ---- instructions ------------------------------------------------------------------

    def _instruction_started(self, e: InstructionStarted) -> None:
        # A program's own Instructions (Init, Return) have no Node: they go under its span.
        host = self._nodes.get(e.node) if e.node is not None else self._program(e.program)
        if host is None:
            return
        attrs = {codec.SPAN_TYPE: "instruction", codec.SEQ: e.seq,
                 **codec.id_attrs(e.program, e.node, e.request),
                 **codec.to_attrs(codec.event_data(e), "sgl.instruction.")}
        span = self._start(e.op.value, e.ts, host.span.get_span_context(), attrs)
        # Keyed by request too: a Select scores each choice as its own request.
        key = (e.node, e.index, e.request)
        self._instructions[key] = _Open(span, e.op, e.ts, e.program)
        if e.request is not None:
            self._by_request[e.request] = key

    def _instruction_key(self, e: InstructionFinished) -> tuple | None:
        key = (e.node, e.index, e.request)
        if key in self._instructions:
            return key
        if e.request is not None and e.request in self._by_request:
            return self._by_request[e.request]
        return next((k for k in reversed(self._instructions) if k[0] == e.node), None)

    def _instruction_finished(self, e: InstructionFinished) -> None:
        key = self._instruction_key(e)
        o = self._instructions.get(key) if key is not None else None
        if o is None:
            return
        span = o.span
        if e.request is not None:
            span.set_attribute(codec.REQUEST, e.request)
            self._by_request.pop(e.request, None)
        for k, v in codec.to_attrs(codec.event_data(e), "sgl.instruction.").items():
            span.set_attribute(k, v)
        if e.status is Status.ERROR:
            span.set_status(SpanStatus(StatusCode.ERROR))
        node = self._nodes.get(key[0])
        if node is not None and o.kind in _ENGINE_OPS:
            node.usage.append(dict(e.usage))
        self._end(self._instructions, key, e.ts, e.seq)

    # ---- everything else: span events --------------------------------------------------

    def _token(self, e: Token) -> None:
        key = self._by_request.get(e.request) if e.request is not None else None
        nid = e.node if e.node is not None else (key[0] if key else None)
        node = self._nodes.get(nid) if nid is not None else None
        if node is None:
            return  # a bare rt.generate request: no program, nothing to trace
        if self.level == "token":
            self._span_event(e, node.program, nid)
            return
        extra = {k: v for k, v in codec.event_data(e).items()
                 if k not in _TOKEN_KEYS and v is not None and v != () and v != []} or None
        node.tokens.append((e.token, e.text or "", e.logprob, e.forced, e.seq, e.ts, extra,
                            e.drafted))

    def _host(self, e: Event, program: int | None, node: int | None) -> _Open | None:
        """The span an event belongs on: its request's instruction, its node, or its
        program. None for what belongs to no program (an eviction, a bare rt.generate
        request, the shared-prefix prefill of run_batch)."""
        key = self._by_request.get(e.request) if e.request is not None else None
        if key is not None and key in self._instructions:
            return self._instructions[key]
        if node is not None and node in self._nodes:
            return self._nodes[node]
        return self._program(program)

    def _span_event(self, e: Event, program: int | None = None, node: int | None = None):
        program = e.program if program is None else program
        node = e.node if node is None else node
        attrs = {codec.SEQ: e.seq, **codec.id_attrs(program, node, e.request),
                 **codec.to_attrs(codec.event_data(e), codec.DATA)}
        host = self._host(e, program, node)
        if host is None:
            self._event_span(e, program, attrs)
            return
        host.span.add_event(codec.event_name(e), attrs, timestamp=self._epoch(e.ts))
        if isinstance(e, Failed):
            host.span.set_status(SpanStatus(StatusCode.ERROR, str(e.error)))

    def _event_span(self, e: Event, program: int | None, attrs: dict) -> None:
        """An event with no live span to sit on (its program already ended, or it has
        none): a zero-length span of its own, so that a replay loses nothing."""
        parent = self._ctx("program", program)
        name = codec.event_name(e)
        span = self._start(name, e.ts, parent, {codec.SPAN_TYPE: "event",
                                                codec.EVENT_KIND: name, **attrs})
        span.end(end_time=self._epoch(e.ts))
