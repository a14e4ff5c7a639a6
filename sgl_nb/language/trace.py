"""`f.trace(**args)`: the static part of a program as a graph, without running the model.

The program runs against a state that only records Nodes; the first thing that needs a
generated value (reading `s["x"]`, `s.text()`) ends the static part.
"""

from __future__ import annotations

import inspect

from sgl_nb.language.state import ForkGroup, ProgramState
from sgl_nb.runtime.compiler.ir import ForkNode, JoinNode, Node, RoleEndNode, RoleNode, dot
from sgl_nb.runtime.compiler.listing import listing
from sgl_nb.runtime.compiler.passes import leading_text
from sgl_nb.runtime.status import Status


class _EndOfStatic(Exception):
    pass


class TraceState(ProgramState):
    """Records what a program says; runs nothing."""

    def __init__(self, defaults: dict, parent: TraceState | None = None, roles=None):
        # Deliberately not ProgramState.__init__: no executor, no backend.
        self.id, self.defaults, self.parent = id(self), defaults, parent
        self.roles = roles  # ChatRoles, to show the text role markers will add
        self.backend = self.debug = self.events = None
        self.passes, self.pass_counts = frozenset(), {}
        self._held_text = None
        self.nodes: list[Node] = []
        self._open_role = None
        self._error, self._vars, self._text, self._fork_point = None, {}, "", 0
        self._copy_of = None

    def _submit(self, expr, frame=None) -> None:
        line, file = (frame.f_lineno, frame.f_code.co_filename) if frame else (None, None)
        for cls, fields, _ in self._to_nodes(expr):
            preds = [self.nodes[-1].id] if self.nodes else []
            if self.roles is not None and issubclass(cls, RoleNode):
                fields["text"] = self._role_text(cls, fields["role"])
            self.nodes.append(cls(program=self.id, preds=preds, file=file, line=line,
                                  status=Status.TRACED, **fields))

    def _role_text(self, cls: type[RoleNode], role: str) -> str:
        if cls is RoleEndNode:
            return self.roles.suffix[role]
        first = not self.nodes
        default = self.roles.default_system if first and role != "system" else ""
        return default + self.roles.prefix[role]

    def __getitem__(self, name: str):
        raise _EndOfStatic(f"reads s[{name!r}]")

    def sync(self) -> None:
        pass

    def text(self) -> str:
        raise _EndOfStatic("reads s.text()")

    def _fork(self, n: int, caller=None) -> ForkGroup:
        preds = [self.nodes[-1].id] if self.nodes else []
        node = ForkNode(program=self.id, preds=preds, n=n, status=Status.TRACED)
        self.nodes.append(node)
        return _TraceForks(self, [TraceState(self.defaults, self) for _ in range(n)], node)


class _TraceForks(ForkGroup):
    def _join(self, mode: str, caller=None) -> None:
        p = self.parent
        for s in self.states:
            p.nodes.extend(s.nodes)
        preds = [s.nodes[-1].id for s in self.states if s.nodes] or [self.node.id]
        p.nodes.append(JoinNode(program=p.id, preds=preds, mode=mode, status=Status.TRACED))


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
    state = TraceState(defaults, roles=roles)
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
