"""What `s += expr` records: an expression of the language (expressions.py) as the Nodes
it adds, each a (Node class, its fields, the expression it came from) for the state's
recorder to make and record. A Gen's grammar is compiled here, on the program's thread,
so a bad pattern fails at its program line; turns are checked not to nest."""

from __future__ import annotations

from sgl_nb.language.expressions import Concat, Gen, Role, RoleBlock, Select
from sgl_nb.language.program_run import ProgramRun
from sgl_nb.runtime.compiler.ir import (
    GenNode,
    Node,
    RoleBeginNode,
    RoleEndNode,
    SelectNode,
    TextNode,
    VarScopeNode,
)


class ScopeMark:
    """Where `with s.var_scope(name):` starts or ends."""

    def __init__(self, name: str, begin: bool):
        self.name, self.begin = name, begin


def expression_nodes(expr, run: ProgramRun, defaults: dict,
                     backend) -> list[tuple[type[Node], dict, object]]:
    """What `s += expr` adds to `run`: (Node class, its fields, the expression it came
    from). `defaults`: the program's sampling defaults; `backend` (None for a static
    graph) compiles a Gen's grammar."""
    if isinstance(expr, str):
        return [(TextNode, {"text": expr}, expr)]
    if isinstance(expr, Concat):
        return [n for part in expr.parts for n in expression_nodes(part, run, defaults, backend)]
    if isinstance(expr, ScopeMark):
        return [(VarScopeNode, {"name": expr.name, "begin": expr.begin}, expr)]
    if isinstance(expr, Gen):
        params = expr.sampling(defaults)
        if backend is not None and ("regex" in params or "json_schema" in params):
            # Compiled here, in the program's thread: a bad pattern fails at its line,
            # before any token is generated.
            backend.check_grammar(params.get("regex"), params.get("json_schema"))
        return [(GenNode, {"name": expr.name, "sampling": params}, expr)]
    if isinstance(expr, Select):
        fields = {"name": expr.name, "choices": expr.choices, "method": expr.method}
        allowed = expr.allowed()
        if len(allowed) < len(expr.choices):  # the gen's grammar ruled some out
            fields["allowed"] = allowed
        return [(SelectNode, fields, expr)]
    if isinstance(expr, RoleBlock):
        out = expression_nodes(Role(expr.role, True), run, defaults, backend)
        try:
            for part in expr.content:
                out.extend(expression_nodes(part, run, defaults, backend))
        except Exception:
            run.open_role = None  # nothing of the turn was added
            raise
        return [*out, *expression_nodes(Role(expr.role, False), run, defaults, backend)]
    if isinstance(expr, Role):
        track_role(run, expr)
        return [(RoleBeginNode if expr.begin else RoleEndNode, {"role": expr.role}, expr)]
    raise TypeError(f"cannot add {type(expr).__name__} to a program state: {expr!r}")


def track_role(run: ProgramRun, mark: Role) -> None:
    """Turns do not nest, and each ends the role it began."""
    if mark.begin and run.open_role is not None:
        raise ValueError(f"nested roles: {mark.role} inside an open {run.open_role}")
    if not mark.begin and run.open_role != mark.role:
        raise ValueError(f"{mark.role}_end without {mark.role}_begin (the open role is "
                         f"{run.open_role})")
    run.open_role = mark.role if mark.begin else None
