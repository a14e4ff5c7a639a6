"""The Timeline: a pure fold of runtime Events into programs, Nodes, Instructions, tokens,
cache changes and the radix tree (tracing/cache_tree.py). The same fold serves a live run
(events from `rt.events.subscribe`) and a replay (events rebuilt from a trace file by
`sgl_nb.tracing.load`), so the TUI and the notebook widgets step through both the same
way. No threads, no I/O."""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from sgl_nb.runtime.events import (
    TREE_EVENTS,
    CacheEvict,
    CacheHit,
    CacheInsert,
    Event,
    Failed,
    Forked,
    Hold,
    InstructionFinished,
    InstructionStarted,
    Joined,
    NodeFinished,
    NodeKind,
    NodeQueued,
    NodeStarted,
    Op,
    Paused,
    Preempted,
    ProgramFinished,
    ProgramStarted,
    Resumed,
    Retracted,
    Status,
    Token,
    VariableSet,
)
from sgl_nb.runtime.token_choice import TokenChoice
from sgl_nb.tracing.cache_tree import CacheTree

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
    drafted: bool = False  # a prompt-lookup draft the model agreed with

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
    # The holds of its request: Preempted, Retracted and Resumed events.
    marks: list[Event] = field(default_factory=list)


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
    # PENDING (queued, not started: start_ns None) -> RUNNING -> DONE | ERROR | CANCELLED;
    # SKIPPED: its program ended before it started
    status: Status = Status.RUNNING
    start_ns: int | None = None
    end_ns: int | None = None
    instructions: list[InstructionView] = field(default_factory=list)
    tokens: list[TokenView] = field(default_factory=list)
    error: str | None = None
    text: str | None = None  # what the node added to the program's text (node_finished)
    value: str | None = None  # repr of the variable it bound, if any (node_finished)
    stack: list[str] = field(default_factory=list)  # the call stack it was added under
    stack_args: list[str] = field(default_factory=list)  # each frame's arguments ("": unknown)
    params: dict = field(default_factory=dict)  # a Gen's sampling params, a Select's choices
    ops: list[Op] = field(default_factory=list)  # its Instructions' kinds (node_queued)
    meta: dict = field(default_factory=dict)  # the meta of the variable it bound


@dataclass
class Bound:
    """A variable's value (its repr) and the Node that bound it (None: the program's code,
    or a Join gathering its branches' values)."""

    value: str
    node: int | None = None


@dataclass
class ProgramView:
    id: int
    function: str | None = None
    parent: int | None = None
    priority: int | None = None
    status: Status = Status.RUNNING  # RUNNING | SUSPENDED -> DONE | ERROR | CANCELLED
    reason: str | None = None  # why it is suspended (preempted, retracted, held by a stepper)
    held: Hold | None = None  # where a step controller holds it now (None: not held)
    held_node: int | None = None  # ... before (or in) this Node
    error: str | None = None
    error_line: int | None = None  # the program line of its error
    nodes: list[int] = field(default_factory=list)
    children: list[int] = field(default_factory=list)
    model: str | None = None
    start_ns: int | None = None
    end_ns: int | None = None
    call: dict = field(default_factory=dict)  # module, qualname, args, options (JSON text)
    variables: dict[str, Bound] = field(default_factory=dict)  # in the order first bound


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
        self.cache_tree = CacheTree()  # the radix tree, from its own events
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
        self._fold(event)

    def _fold(self, e: Event) -> None:
        match e:
            case ProgramStarted():
                self._program_started(e)
            case ProgramFinished():
                self._program_finished(e)
            case NodeQueued():
                self._node_queued(e)
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
            case Preempted() | Retracted() | Paused() | Resumed():
                self._hold(e)
            case Forked():
                self._fork(e)
            case Joined():
                self._join(e)
            case VariableSet():
                p = self._program(e.program)
                if p is not None and e.value is not None:
                    p.variables[e.name] = Bound(e.value)
            case Failed():
                self._error(e)
            case CacheHit() | CacheInsert() | CacheEvict():
                self._cache(e)
            case _ if isinstance(e, TREE_EVENTS):
                self.cache_tree.apply(e)

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

    def _program_started(self, e: ProgramStarted) -> None:
        p = self._program(e.program)
        if p is None:
            return
        p.function = e.function or p.function
        p.priority = e.priority or p.priority
        p.model = e.model or p.model
        p.start_ns = e.ts
        call = {"module": e.module, "qualname": e.qualname, "args": e.args,
                "options": e.options}
        p.call.update({k: v for k, v in call.items() if v is not None})
        if e.parent is not None:
            p.parent = e.parent
            self._link_child(p)

    def _program_finished(self, e: ProgramFinished) -> None:
        p = self._program(e.program)
        if p is None:
            return
        p.error = e.error
        p.error_line = e.line if e.line is not None else p.error_line
        p.status = e.status or (Status.ERROR if p.error else Status.DONE)
        p.held = p.held_node = None
        p.end_ns = e.ts
        for nid in p.nodes:  # what never started will not now
            if self.nodes[nid].status is Status.PENDING:
                self.nodes[nid].status = Status.SKIPPED

    def _node_queued(self, e: NodeQueued) -> None:
        n = self._node(e)
        if n is None or n.kind is not None:
            return  # it started already (events handed over out of order)
        n.kind, n.name, n.label = e.node_kind, e.name, e.label
        n.line, n.file, n.preds = e.line, e.file, list(e.preds)
        n.stack, n.stack_args, n.ops = list(e.stack), list(e.stack_args), list(e.ops)
        n.status, n.start_ns = Status.PENDING, None

    def _node_started(self, e: NodeStarted) -> None:
        n = self._node(e)
        if n is None:
            return
        n.kind, n.name, n.label = e.node_kind, e.name, e.label
        n.line, n.file, n.preds = e.line, e.file, list(e.preds)
        n.stack = list(e.stack)
        if not any(n.stack_args):  # those seen as it was queued, while its frames were live
            n.stack_args = list(e.stack_args)
        n.params = _params(e.params)
        n.status, n.start_ns = Status.RUNNING, e.ts

    def _node_finished(self, e: NodeFinished) -> None:
        n = self._node(e)
        if n is None:
            return
        n.status = e.status
        n.text = e.text if e.text is not None else n.text
        n.value = e.value if e.value is not None else n.value
        n.meta = _params(e.meta) or n.meta
        n.end_ns = e.ts
        p = self.programs.get(n.program) if n.program is not None else None
        if p is not None and n.name is not None and e.value is not None:
            p.variables[n.name] = Bound(e.value, n.id)

    def _instruction(self, e: Event, index: int | None = None) -> InstructionView | None:
        """The instruction an instruction_finished (with its index) or a mark is about."""
        if e.request is not None and e.request in self._by_request:
            return self._by_request[e.request]
        n = self.nodes.get(e.node) if e.node is not None else None
        if n is None or not n.instructions:
            return None
        for ins in reversed(n.instructions):
            if index is None or ins.index == index:
                return ins
        return n.instructions[-1]

    def _instruction_started(self, e: InstructionStarted) -> None:
        n = self._node(e)
        if n is None:
            return
        ins = InstructionView(e.op, n.id, e.index, e.request, start_ns=e.ts)
        n.instructions.append(ins)
        if e.request is not None:
            self._by_request[e.request] = ins

    def _instruction_finished(self, e: InstructionFinished) -> None:
        ins = self._instruction(e, e.index)
        if ins is None:
            return
        ins.attrs.update(e.usage)
        if e.error is not None:
            ins.attrs.update(status=e.status, error=e.error)
        ins.status = Status.ERROR if e.status is Status.ERROR else Status.DONE
        ins.end_ns = e.ts
        if e.request is not None:
            ins.request = e.request
            self._by_request.pop(e.request, None)

    def _token(self, e: Token) -> None:
        n = self._node(e)
        if n is None and e.request in self._by_request:
            n = self.nodes.get(self._by_request[e.request].node)
        if n is None:
            return  # a bare rt.generate request: no program, no Node
        top = [tuple(a) for a in e.top]
        n.tokens.append(TokenView(e.token, e.text or "", e.logprob, e.forced, e.seq, top,
                                  e.allowed, e.drafted))

    def _hold(self, e: Preempted | Retracted | Paused | Resumed) -> None:
        """A request or a program suspended or going on: the program's status, and a mark
        on the instruction a request's hold is about."""
        by_request = isinstance(e, Resumed) and (e.request is not None
                                                 or e.reason == "scheduler")
        if isinstance(e, Preempted | Retracted) or by_request:
            ins = self._instruction(e)
            if ins is not None:
                ins.marks.append(e)
        if isinstance(e, Paused | Resumed) and not by_request:
            self._set_held(e)
        if isinstance(e, Resumed):
            self._set_program_status(e.program, Status.RUNNING)
            return
        if isinstance(e, Preempted):
            why = f"preempted: {e.reason or 'higher-priority work'}"
        elif isinstance(e, Retracted):
            why = f"retracted: {e.reason or 'KV pool full'}"
        else:
            why = f"held by the step controller at a {e.at}"
        self._set_program_status(e.program, Status.SUSPENDED, why)

    def _set_held(self, e: Paused | Resumed) -> None:
        p = self.programs.get(e.program) if e.program is not None else None
        if p is not None:
            held = isinstance(e, Paused) and not p.status.ended
            p.held, p.held_node = (e.at, e.node) if held else (None, None)

    def _set_program_status(self, pid: int | None, status: Status, reason: str | None = None):
        p = self.programs.get(pid) if pid is not None else None
        if p is not None and not p.status.ended:
            p.status, p.reason = status, reason

    def _fork(self, e: Forked) -> None:
        if e.node is not None and e.children:
            self._forks[e.node] = list(e.children)
        p = self._program(e.program)
        for child in e.children:
            self._fork_parent[child] = e.program
            c = self.programs.get(child)
            if c is not None and c.parent is None:
                c.parent = e.program
            if p is not None and child not in p.children:
                p.children.append(child)

    def _join(self, e: Joined) -> None:
        """SGLang's gather_variable (effects.py's _gather): a name the parent does not have
        becomes the list of the values of the branches that bound it, in branch order (a
        list's repr is its items' reprs); not when a branch failed or for
        concate_and_append."""
        p = self._program(e.program)
        branches = [self.programs[c] for c in e.children if c in self.programs]
        if p is None or e.mode == "concate_and_append" or any(
                b.status is Status.ERROR for b in branches):
            return
        gathered: dict[str, list[str]] = {}
        for b in branches:
            for name, bound in b.variables.items():
                if name not in p.variables:
                    gathered.setdefault(name, []).append(bound.value)
        for name, values in gathered.items():
            p.variables[name] = Bound("[" + ", ".join(values) + "]")

    def _error(self, e: Failed) -> None:
        n = self.nodes.get(e.node) if e.node is not None else None
        if n is not None:
            n.error = e.error
        p = self.programs.get(e.program) if e.program is not None else None
        if p is not None and p.error is None:
            p.error = e.error
            p.error_line = e.line

    def _cache(self, e: CacheHit | CacheInsert | CacheEvict) -> None:
        if isinstance(e, CacheHit):
            self.cache["hits"] += 1 if e.cached_tokens > 0 else 0
            self.cache["cached_tokens"] += e.cached_tokens
            self.cache["prompt_tokens"] += e.prompt_tokens
        elif isinstance(e, CacheInsert):
            self.cache["inserted"] += e.tokens
        else:
            self.cache["evicted"] += e.tokens
        self.cache_events.append(e)

    # ---- reading -----------------------------------------------------------------------

    def upto(self, seq: int) -> Timeline:
        """The state right after the events with seq <= `seq` (stepping backwards)."""
        return Timeline(e for e in self.events if e.seq <= seq)

    def node_steps(self) -> list[int]:
        """The seq of every node_started event: the stops of stepping by Node."""
        return [e.seq for e in self.events if isinstance(e, NodeStarted)]

    def instruction_steps(self) -> list[int]:
        """The seq of every instruction_started event: the stops of stepping by Instruction."""
        return [e.seq for e in self.events if isinstance(e, InstructionStarted)]

    def fork_children(self) -> dict[int, list[int]]:
        """Fork Node id -> the program ids of its branches, in branch order (branch 0
        first), as the fork events named them. A program may fork more than once, so its
        `children` alone do not say which Fork made which branch. The same as
        `fork_children(self.events)`, kept as the events are folded (the TUI asks on every
        redraw)."""
        return {fork: list(children) for fork, children in self._forks.items()}

    def family(self, program: int) -> list[int]:
        """The program and its fork branches (and theirs), as far as the events tell."""
        out, todo = [], [program]
        while todo:
            pid = todo.pop()
            if pid in self.programs and pid not in out:
                out.append(pid)
                todo.extend(self.programs[pid].children)
        return out

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
    """node_started's params, node_finished's meta: JSON text (a trace keeps it so); {}
    when absent or mangled."""
    if isinstance(raw, dict):
        return raw
    try:
        out = json.loads(raw) if isinstance(raw, str) else {}
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


class Family:
    """Which events are about one program and its fork branches (a view follows those).
    A branch's body queues its Nodes before its parent's Fork runs and names it: those
    events wait here and come out with the fork event that makes the branch one of ours."""

    def __init__(self, program: int):
        self.programs = {program}
        self._strays: dict[int, list[Event]] = {}  # program id -> its events so far

    def take(self, e: Event) -> list[Event]:
        """The events to fold now: `e` if it is ours (with the branches' waiting events
        after a fork), none if not."""
        if isinstance(e, TREE_EVENTS):  # the radix tree is every program's
            return [e]
        if e.program not in self.programs:
            if isinstance(e, NodeQueued) and e.program is not None:
                self._strays.setdefault(e.program, []).append(e)
            return []
        if not isinstance(e, Forked):
            return [e]
        out = [e]
        for child in e.children:
            self.programs.add(child)
            out.extend(self._strays.pop(child, []))
        return out


def fork_children(events: Iterable[Event]) -> dict[int, list[int]]:
    """Fork Node id -> the program ids of its branches in branch order, from the fork
    events (the same for a live run and a replay; a Timeline's `events` will do)."""
    return {e.node: list(e.children) for e in events
            if isinstance(e, Forked) and e.node is not None and e.children}
