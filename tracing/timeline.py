"""The Timeline: a pure fold of runtime Events into programs, Nodes, Instructions, tokens
and cache changes. The same fold serves a live run (events from `rt.events.subscribe`) and
a replay (events rebuilt from a trace file by `sgl_nb.tracing.load`), so the TUI and the
notebook widgets step through both the same way. No threads, no I/O."""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from sgl_nb.runtime.compiler.instructions import Op
from sgl_nb.runtime.compiler.ir import NodeKind
from sgl_nb.runtime.events import Event
from sgl_nb.runtime.status import Status
from sgl_nb.runtime.token_choice import TokenChoice

# The Node kinds whose output is part of the program's text.
_TEXT_KINDS = (NodeKind.TEXT, NodeKind.ROLE_BEGIN, NodeKind.ROLE_END, NodeKind.GEN,
               NodeKind.SELECT)
# What program_started says of the call, for a re-run (sgl_nb/language/rerun.py).
CALL_KEYS = ("module", "qualname", "args", "options")


@dataclass
class TokenView:
    token: int | None
    text: str
    logprob: float | None
    forced: bool
    seq: int
    # Why this token (runtime/token_choice.py): the step's top alternatives as (id, text,
    # logprob, masked), most likely first, and the tokens the grammar left (-1: none).
    # Empty / -1 in traces recorded below the "token" level or before they existed.
    top: list[tuple[int, str, float, bool]] = field(default_factory=list)
    allowed: int = -1

    def choice(self) -> TokenChoice:
        """As the engine's TokenChoice. Its logprob is the one among `top` (before the
        mask, as theirs) when the token is there, else the event's (after the mask)."""
        logprob = next((a[2] for a in self.top if a[0] == self.token), self.logprob)
        return TokenChoice.from_json({"token": -1 if self.token is None else self.token,
                                      "text": self.text, "logprob": logprob,
                                      "forced": self.forced, "allowed": self.allowed,
                                      "top": self.top})


@dataclass
class InstructionView:
    kind: Op
    node: int
    index: int
    request: int | None = None
    status: Status = Status.RUNNING  # -> DONE | ERROR
    start_ns: int | None = None
    end_ns: int | None = None
    attrs: dict = field(default_factory=dict)  # what instruction_finished reported
    marks: list[tuple[str, int, dict]] = field(default_factory=list)  # (kind, ts, data)


@dataclass
class NodeView:
    id: int
    program: int | None
    kind: NodeKind | None = None
    name: str | None = None
    label: str | None = None
    line: int | None = None
    file: str | None = None
    preds: list[int] = field(default_factory=list)
    status: Status = Status.RUNNING  # -> DONE | ERROR | CANCELLED
    start_ns: int | None = None
    end_ns: int | None = None
    instructions: list[InstructionView] = field(default_factory=list)
    tokens: list[TokenView] = field(default_factory=list)
    error: str | None = None
    text: str | None = None  # what the node added to the program's text (node_finished)
    value: str | None = None  # repr of the variable it bound, if any (node_finished)
    stack: list[str] = field(default_factory=list)  # the call stack it was added under
    params: dict = field(default_factory=dict)  # a Gen's sampling params, a Select's choices


@dataclass
class ProgramView:
    id: int
    function: str | None = None
    parent: int | None = None
    priority: int | None = None
    status: Status = Status.RUNNING  # RUNNING | SUSPENDED -> DONE | ERROR | CANCELLED
    reason: str | None = None  # why it is suspended (preempted, retracted, held by a stepper)
    error: str | None = None
    nodes: list[int] = field(default_factory=list)
    children: list[int] = field(default_factory=list)
    model: str | None = None
    start_ns: int | None = None
    end_ns: int | None = None
    call: dict = field(default_factory=dict)  # module, qualname, args, options (JSON text)


def _empty_cache() -> dict:
    return {"hits": 0, "cached_tokens": 0, "prompt_tokens": 0, "inserted": 0, "evicted": 0}


class Timeline:
    """Everything known so far about a run. `apply` one Event at a time, in seq order."""

    # sgl_nb.language.rerun sets it: re-running needs the language layer, above this one.
    rerunner = None

    def rerun(self, at, **kwargs):
        """Run a traced program again from Node `at`, with an edit (`value=`, sampling
        arguments; `program=` when the trace holds several): see ProgramState.rerun. Its
        function must be importable from where the trace recorded it."""
        if Timeline.rerunner is None:
            raise RuntimeError("import sgl_nb to re-run a traced program")
        return Timeline.rerunner(self, at, **kwargs)

    def __init__(self, events: Iterable[Event] = ()):
        self.events: list[Event] = []
        self.programs: dict[int, ProgramView] = {}
        self.nodes: dict[int, NodeView] = {}
        self.cache: dict = _empty_cache()
        self.cache_events: list[Event] = []
        self._by_request: dict[int, InstructionView] = {}  # the request's live instruction
        self._fork_parent: dict[int, int] = {}  # child program id -> parent program id
        self._forks: dict[int, list[int]] = {}  # fork Node id -> its branches, in order
        for e in events:
            self.apply(e)

    # ---- the fold ----------------------------------------------------------------------

    def apply(self, event: Event) -> None:
        # Publishers on different threads may hand events over a little out of order;
        # keep `events` sorted by seq so upto() and the step lists stay right.
        if self.events and event.seq < self.events[-1].seq:
            bisect.insort(self.events, event, key=lambda e: e.seq)
        else:
            self.events.append(event)
        handler = getattr(self, f"_on_{event.kind}", None)
        if handler is not None:
            handler(event)

    def _program(self, pid: int | None) -> ProgramView | None:
        if pid is None:
            return None
        p = self.programs.get(pid)
        if p is None:  # joined mid-run, or a fork branch announced only by its parent
            p = self.programs[pid] = ProgramView(pid, parent=self._fork_parent.get(pid))
            self._link_child(p)
        return p

    def _link_child(self, p: ProgramView) -> None:
        parent = self.programs.get(p.parent) if p.parent is not None else None
        if parent is not None and p.id not in parent.children:
            parent.children.append(p.id)

    def _node(self, e: Event) -> NodeView | None:
        if e.node is None:
            return None
        n = self.nodes.get(e.node)
        if n is None:
            n = self.nodes[e.node] = NodeView(e.node, e.program, start_ns=e.ts)
            p = self._program(e.program)
            if p is not None:
                p.nodes.append(n.id)
        return n

    def _on_program_started(self, e: Event) -> None:
        d = e.data
        p = self._program(e.program)
        if p is None:
            return
        p.function = d.get("function", p.function)
        p.priority = d.get("priority", p.priority)
        p.model = d.get("model", p.model)
        p.start_ns = e.ts
        p.call.update({k: d[k] for k in CALL_KEYS if d.get(k) is not None})
        parent = d.get("parent")
        if parent is not None:
            p.parent = parent
            self._link_child(p)

    def _on_program_finished(self, e: Event) -> None:
        p = self._program(e.program)
        if p is None:
            return
        p.error = e.data.get("error")
        status = e.data.get("status")
        p.status = Status(status) if status else Status.ERROR if p.error else Status.DONE
        p.end_ns = e.ts

    def _on_node_started(self, e: Event) -> None:
        n = self._node(e)
        if n is None:
            return
        d = e.data
        kind = d.get("kind")
        n.kind, n.name, n.label = NodeKind(kind) if kind else None, d.get("name"), d.get("label")
        n.line, n.file, n.preds = d.get("line"), d.get("file"), list(d.get("preds") or [])
        n.text = d.get("text", n.text)
        n.stack = list(d.get("stack") or [])
        n.params = _params(d.get("params"))
        n.status, n.start_ns = Status.RUNNING, e.ts

    def _on_node_finished(self, e: Event) -> None:
        n = self._node(e)
        if n is None:
            return
        n.status = Status(e.data.get("status", Status.DONE))
        n.text = e.data.get("text", n.text)
        n.value = e.data.get("value", n.value)
        n.end_ns = e.ts

    def _instruction(self, e: Event) -> InstructionView | None:
        """The instruction an instruction_finished / mark event is about."""
        if e.request is not None and e.request in self._by_request:
            return self._by_request[e.request]
        n = self.nodes.get(e.node) if e.node is not None else None
        if n is None or not n.instructions:
            return None
        index = e.data.get("index") if e.kind.startswith("instruction_") else None
        for ins in reversed(n.instructions):
            if index is None or ins.index == index:
                return ins
        return n.instructions[-1]

    def _on_instruction_started(self, e: Event) -> None:
        n = self._node(e)
        if n is None:
            return
        d = e.data
        index = d.get("index", len(n.instructions))
        ins = InstructionView(Op(d.get("kind")), n.id, index, e.request, start_ns=e.ts)
        n.instructions.append(ins)
        if e.request is not None:
            self._by_request[e.request] = ins

    def _on_instruction_finished(self, e: Event) -> None:
        ins = self._instruction(e)
        if ins is None:
            return
        ins.attrs.update({k: v for k, v in e.data.items() if k not in ("kind", "index")})
        ins.status = Status.ERROR if e.data.get("status") == Status.ERROR else Status.DONE
        ins.end_ns = e.ts
        if e.request is not None:
            ins.request = e.request
            self._by_request.pop(e.request, None)

    def _on_token(self, e: Event) -> None:
        n = self._node(e)
        if n is None and e.request in self._by_request:
            n = self.nodes.get(self._by_request[e.request].node)
        if n is None:
            return  # a bare rt.generate request: no program, no Node
        d = e.data
        top = [tuple(a) for a in d.get("top") or ()]
        n.tokens.append(TokenView(d.get("token"), d.get("text") or "", d.get("logprob"),
                                  bool(d.get("forced", False)), e.seq, top,
                                  d.get("allowed", -1)))

    def _mark(self, e: Event) -> None:
        ins = self._instruction(e)
        if ins is not None:
            ins.marks.append((e.kind, e.ts, dict(e.data)))

    def _on_preempted(self, e: Event) -> None:
        self._mark(e)
        self._set_program_status(e.program, Status.SUSPENDED,
                                 f"preempted: {e.data.get('reason') or 'higher-priority work'}")

    def _on_retracted(self, e: Event) -> None:
        self._mark(e)
        self._set_program_status(e.program, Status.SUSPENDED,
                                 f"retracted: {e.data.get('reason') or 'KV pool full'}")

    def _on_paused(self, e: Event) -> None:
        self._set_program_status(e.program, Status.SUSPENDED,
                                 f"held by the step controller at a {e.data.get('at')}")

    def _on_resumed(self, e: Event) -> None:
        if e.data.get("reason") == "scheduler" or e.request is not None:
            self._mark(e)
        self._set_program_status(e.program, Status.RUNNING)

    def _set_program_status(self, pid: int | None, status: Status, reason: str | None = None):
        p = self.programs.get(pid) if pid is not None else None
        if p is not None and not p.status.ended:
            p.status, p.reason = status, reason

    def _on_fork(self, e: Event) -> None:
        if e.node is not None and e.data.get("children"):
            self._forks[e.node] = list(e.data["children"])
        p = self._program(e.program)
        for child in e.data.get("children") or []:
            self._fork_parent[child] = e.program
            c = self.programs.get(child)
            if c is not None and c.parent is None:
                c.parent = e.program
            if p is not None and child not in p.children:
                p.children.append(child)

    def _on_error(self, e: Event) -> None:
        n = self.nodes.get(e.node) if e.node is not None else None
        if n is not None:
            n.error = e.data.get("error")
        p = self.programs.get(e.program) if e.program is not None else None
        if p is not None and p.error is None:
            p.error = e.data.get("error")

    def _on_cache_hit(self, e: Event) -> None:
        cached = e.data.get("cached_tokens") or 0
        self.cache["hits"] += 1 if cached > 0 else 0
        self.cache["cached_tokens"] += cached
        self.cache["prompt_tokens"] += e.data.get("prompt_tokens") or 0
        self.cache_events.append(e)

    def _on_cache_insert(self, e: Event) -> None:
        self.cache["inserted"] += e.data.get("tokens") or 0
        self.cache_events.append(e)

    def _on_cache_evict(self, e: Event) -> None:
        self.cache["evicted"] += e.data.get("tokens") or 0
        self.cache_events.append(e)

    # ---- reading -----------------------------------------------------------------------

    def upto(self, seq: int) -> Timeline:
        """The state right after the events with seq <= `seq` (stepping backwards)."""
        return Timeline(e for e in self.events if e.seq <= seq)

    def node_steps(self) -> list[int]:
        """The seq of every node_started event: the stops of stepping by Node."""
        return [e.seq for e in self.events if e.kind == "node_started"]

    def instruction_steps(self) -> list[int]:
        """The seq of every instruction_started event: the stops of stepping by Instruction."""
        return [e.seq for e in self.events if e.kind == "instruction_started"]

    def fork_children(self) -> dict[int, list[int]]:
        """Fork Node id -> the program ids of its branches, in branch order (branch 0
        first), as the fork events named them. A program may fork more than once, so its
        `children` alone do not say which Fork made which branch. The same as
        `fork_children(self.events)`, kept as the events are folded (the TUI asks on every
        redraw)."""
        return {fork: list(children) for fork, children in self._forks.items()}

    def program_text(self, program_id: int) -> str:
        """The program's own output as far as the events tell: each text Node's text (when
        the runtime reported it), a Gen's tokens, a Select's choice."""
        p = self.programs.get(program_id)
        if p is None:
            raise KeyError(f"no program {program_id} in this timeline; "
                           f"it has {sorted(self.programs)}")
        parts = []
        for nid in p.nodes:
            n = self.nodes[nid]
            if n.kind not in _TEXT_KINDS and n.kind is not None:
                continue
            if n.text is not None:
                parts.append(n.text)
            elif n.tokens:
                parts.append("".join(t.text for t in n.tokens))
        return "".join(parts)


def _params(raw) -> dict:
    """node_started's params: JSON text (a trace keeps it so); {} when absent or mangled."""
    if isinstance(raw, dict):
        return raw
    try:
        out = json.loads(raw) if isinstance(raw, str) else {}
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def fork_children(events: Iterable[Event]) -> dict[int, list[int]]:
    """Fork Node id -> the program ids of its branches in branch order, from the fork
    events (the same for a live run and a replay; a Timeline's `events` will do)."""
    return {e.node: list(e.data["children"]) for e in events
            if e.kind == "fork" and e.node is not None and e.data.get("children")}
