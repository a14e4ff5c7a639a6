"""`f.trace(**args)`: the static part of a program as a graph, without running the model.

The program runs against a state whose recorder (StaticRecorder) only keeps the Nodes; the
first thing that needs a generated value (reading `s["x"]`, `s.text()`) ends the static part.
"""

from __future__ import annotations

import inspect

from sgl_nb.language.program_run import ProgramRun
from sgl_nb.language.state import ProgramState
from sgl_nb.runtime.compiler.ir import ForkNode, JoinNode, Node, RoleEndNode, RoleNode, dot
from sgl_nb.runtime.compiler.listing import listing
from sgl_nb.runtime.compiler.passes import leading_text
from sgl_nb.runtime.status import Status


class _EndOfStatic(Exception):
    pass


class StaticRecorder:
    """Records what a program says; runs nothing (the state's recorder for its static
    graph). Anything that needs a generated value ends the static part."""

    def __init__(self, state: ProgramState, run: ProgramRun, roles=None):
        self.state, self.run = state, run
        self.roles = roles  # ChatRoles, to show the text role markers will add

    def check_open(self) -> None:
        pass

    def preds(self) -> list[int]:
        return [self.run.nodes[-1].id] if self.run.nodes else []

    def record(self, node: Node, payload=None) -> None:
        if self.roles is not None and isinstance(node, RoleNode):
            node.text = self._role_text(node)
        node.status = Status.TRACED
        self.run.nodes.append(node)

    def _role_text(self, node: RoleNode) -> str:
        if isinstance(node, RoleEndNode):
            return self.roles.suffix[node.role]
        first = not self.run.nodes
        default = self.roles.default_system if first and node.role != "system" else ""
        return default + self.roles.prefix[node.role]

    def flush(self) -> None:
        pass

    sync = flush

    def before_read(self, what: str) -> None:
        raise _EndOfStatic(f"reads {what}")

    def read(self, name: str):
        raise _EndOfStatic(f"reads s[{name!r}]")

    def fork(self, n: int, caller=None) -> tuple[ForkNode, list[ProgramState]]:
        node = ForkNode(program=self.run.id, preds=self.preds(), n=n, status=Status.TRACED)
        self.run.nodes.append(node)
        return node, [_static_state(self.state.defaults, self.roles, self.state)
                      for _ in range(n)]

    def join(self, branches: list[ProgramState], fork: ForkNode, mode: str, caller=None):
        for b in branches:
            self.run.nodes.extend(b.nodes)
        preds = [b.nodes[-1].id for b in branches if b.nodes] or [fork.id]
        self.run.nodes.append(JoinNode(program=self.run.id, preds=preds, mode=mode,
                                       status=Status.TRACED))


def _static_state(defaults: dict, roles=None, parent: ProgramState | None = None):
    """A program state that records its program's static graph (no backend, no executor);
    a branch's role markers show no text, as before a fork's text is known."""
    return ProgramState(None, defaults, parent=parent, recorder=lambda state, run:
                        StaticRecorder(state, run, roles if parent is None else None))


class ProgramGraph:
    def __init__(self, name: str, nodes: list[Node], ends: str | None):
        self.name, self.nodes = name, nodes
        self.ends = ends  # why the static part ended, None if the whole program is static

    @property
    def complete(self) -> bool:
        return self.ends is None

    def listing(self) -> str:
        tail = "" if self.ends is None else f"\n... dynamic from here: the program {self.ends}"
        return listing(self.nodes) + tail

    def dot(self) -> str:
        return dot(self.name, self.nodes)

    def __str__(self) -> str:
        return self.listing()


def trace_program(func, args: dict, defaults: dict, roles=None) -> ProgramGraph:
    state = _static_state(defaults, roles)
    ends = None
    try:
        func(state, **args)
    except _EndOfStatic as e:
        ends = str(e)
    except Exception as e:  # a program that fails while tracing: say where
        line = e.__traceback__.tb_next.tb_lineno if e.__traceback__.tb_next else None
        ends = f"raised {e!r} at line {line}"
    return ProgramGraph(func.__name__, state.nodes, ends)


class _Argument:
    """A program argument whose value is not known (`f.cache()` traces with these): any use
    of it ends the static part, as SGLang's tracer stops at an argument."""

    def __init__(self, name: str):
        self._name = name

    def _used(self, *_args, **_kwargs):
        raise _EndOfStatic(f"uses argument {self._name!r}")

    __str__ = __repr__ = __format__ = __add__ = __radd__ = __mod__ = __rmod__ = _used
    __iter__ = __len__ = __getitem__ = __contains__ = __bool__ = _used
    __int__ = __float__ = __index__ = __eq__ = __lt__ = __gt__ = __call__ = _used
    __hash__ = None

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        self._used()


def static_prefix(func, bound: dict, roles=None) -> str:
    """The text every run of `func` starts with, whatever its (unbound) arguments: its
    static part up to the first argument it uses or the first gen (what `f.cache()`
    computes into the prefix cache)."""
    params = list(inspect.signature(func).parameters.values())[1:]
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    args = {name: bound[name] if name in bound else _Argument(name) for name in names}
    return leading_text(trace_program(func, args, {}, roles).nodes)
