"""`state.rerun(at=..., value=..., **sampling)`: run a program again from one of its Nodes,
with an edit. The program's Python runs again from the start; before `at` each Node's
recorded output is replayed (the states run with a Rerun strategy over a RerunCursor:
sgl_nb/language/rerun_strategy.py, rerun_cursor.py; no decoding, and the radix cache still
holds the prompt), `at` gets the edit, and what follows runs live. From a live state
or from a trace (`sgl_nb.tracing.load(path).rerun(...)`, when the program's function can be
imported)."""

from __future__ import annotations

import importlib
import json
import sys

from sgl_nb.language.expressions import SAMPLING_ARGS, sampling_args
from sgl_nb.language.rerun_cursor import MISSING, Edit, RerunCursor, RerunReport
from sgl_nb.language.rerun_strategy import Rerun
from sgl_nb.language.run_record import (
    NodeRecord,
    ProgramRecord,
    record_of_state,
    record_of_timeline,
)
from sgl_nb.runtime.compiler.ir import Node, NodeKind
from sgl_nb.runtime.sampling_params import SamplingParams
from sgl_nb.runtime.status import Status
from sgl_nb.tracing.timeline import Timeline

BINDING = (NodeKind.GEN, NodeKind.SELECT)  # what `at` may name by its variable
EDITABLE = (*BINDING, NodeKind.TEXT)
# Beyond SGLang's sampling names, a gen's grammar may change too.
GRAMMAR_ARGS = ("regex", "json_schema")


def rerun_state(state, at, value=MISSING, *, stream: bool = False, backend=None,
                debug: bool = False, **sampling):
    """The re-run of a live program (a fork branch's Nodes are its top program's)."""
    while state.parent is not None:
        state = state.parent
    if state.call is None:
        raise ValueError(f"program {state.id} was not started by an @sgl.function's run: "
                         "there is nothing to run again")
    state.sync()  # until it has ended, or a step controller holds it
    record = record_of_state(state)
    call = state.call
    options = {**call.options, "debug": debug}
    return _start(call.function, call.args, call.defaults, options, record, at, value,
                  stream, backend or state.backend, sampling)


def rerun_timeline(tl: Timeline, at, value=MISSING, *, function_type: type,
                   program: int | None = None, stream: bool = False, backend=None,
                   debug: bool = False, **sampling):
    """The re-run of a traced program: its function is imported by the module and name the
    trace recorded (a notebook's own programs are found in its namespace, `__main__`).
    `function_type`: SglFunction (function.py passes it: this module does not import it)."""
    record = record_of_timeline(tl, program)
    function = _import_function(record, function_type)
    raw = record.call.get("args")
    if raw is None:
        raise ValueError(f"the trace did not record program {record.id}'s arguments as JSON "
                         "(they were not JSON values): it cannot be re-run from the trace")
    args = json.loads(raw)
    defaults = json.loads(record.call.get("options") or "{}")
    return _start(function, args, defaults, {"debug": debug}, record, at, value, stream,
                  backend, sampling)


def _start(function, args: dict, defaults: dict, options: dict, record: ProgramRecord, at,
           value, stream: bool, backend, sampling: dict):
    path, index, node = resolve_at(record, at)
    edit = Edit(value, check_edit(node, value, sampling))
    if backend is not None and ("regex" in edit.sampling or "json_schema" in edit.sampling):
        backend.check_grammar(edit.sampling.get("regex"), edit.sampling.get("json_schema"))
    where = f"{node.label} (line {node.line})" if node.line is not None else node.label
    report = RerunReport(where)
    cursor = RerunCursor(record, (path, index), edit, report)
    fut = function.start(dict(args), backend, strategy=Rerun(cursor), **options, **defaults)
    fut.state.rerun_report = report
    fut.state.rerun_of = record
    return fut.state if stream else fut.result()


def resolve_at(record: ProgramRecord, at) -> tuple[tuple, int, NodeRecord]:
    """`at` (a Node, a NodeRecord, a node id, or the variable a gen or select binds) as its
    place in the record."""
    nodes = list(record.walk())
    if isinstance(at, Node | NodeRecord):
        at = at.id
    if isinstance(at, int) and not isinstance(at, bool):
        found = [x for x in nodes if x[2].id == at]
        what = f"node {at}"
    elif isinstance(at, str):
        found = [x for x in nodes if x[2].name == at and x[2].kind in BINDING]
        what = f"gen or select named {at!r}"
    else:
        raise TypeError(f"rerun(at=...) takes a Node, a node id or a variable name, got "
                        f"{type(at).__name__}")
    if not found:
        names = sorted({n.name for _, _, n in nodes if n.name and n.kind in EDITABLE})
        ended = "" if record.status is Status.DONE else \
            f" (it {record.status.value} before any other)"
        raise KeyError(f"no {what} in program {record.id}; its gens and selects: "
                       f"{names}{ended}")
    if len(found) > 1:
        places = ", ".join(f"node {n.id} (line {n.line})" for _, _, n in found)
        raise ValueError(f"{what} ran {len(found)} times ({places}): pass at=<node id> or "
                         "the Node (state.nodes) to say which")
    path, index, node = found[0]
    if node.kind not in EDITABLE:
        raise ValueError(f"rerun(at=...) takes a gen, a select or a text Node; node "
                         f"{node.id} is {node.label}")
    return path, index, node


def check_edit(node: NodeRecord, value, sampling: dict) -> dict:
    """The edit's sampling arguments as SamplingParams fields; errors name what is wrong."""
    if sampling and node.kind is not NodeKind.GEN:
        raise TypeError(f"sampling arguments ({', '.join(sorted(sampling))}) apply to a gen; "
                        f"{node.label} is a {node.kind.value}")
    unknown = set(sampling) - set(SAMPLING_ARGS) - set(GRAMMAR_ARGS)
    if unknown:
        raise TypeError(f"unknown sampling arguments {sorted(unknown)}; a gen takes "
                        f"{sorted({*SAMPLING_ARGS, *GRAMMAR_ARGS})}")
    if value is not MISSING and sampling:
        raise TypeError("give value= (the Node's new output) or sampling arguments (to "
                        "generate it again with them), not both")
    if node.kind is NodeKind.SELECT and value is not MISSING:
        choices = node.params.get("choices", [])
        if value not in choices:
            raise ValueError(f"{value!r} is not a choice of {node.label}")
    if node.kind is NodeKind.TEXT and value is not MISSING and not isinstance(value, str):
        raise TypeError(f"a text Node's value must be a str, got {type(value).__name__}")
    out = sampling_args({k: v for k, v in sampling.items() if k in SAMPLING_ARGS})
    out.update({k: sampling[k] for k in GRAMMAR_ARGS if k in sampling})
    try:
        SamplingParams(**out)  # a bad value fails here, before anything runs
    except TypeError as e:
        raise TypeError(f"bad sampling arguments {out}: {e}") from None
    return out


def _import_function(record: ProgramRecord, SglFunction: type):  # noqa: N803 - the class
    module, qualname = record.call.get("module"), record.call.get("qualname")
    if not module or not qualname:
        raise ValueError(f"the trace does not say where program {record.id}'s function "
                         f"({record.function}) is defined: it cannot be re-run from the trace")
    # A function defined inside another (a `%%sgl` cell's, in its scope) is found by its
    # own name in its module's namespace, where the cell binds it (to its state).
    parts = qualname.split(".")
    if "<locals>" in parts:
        parts = parts[-1:]
    try:
        obj = _namespace(module)
        for part in parts:
            obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    except (ImportError, AttributeError, KeyError) as e:
        raise ImportError(f"cannot import {module}.{qualname}, the function of program "
                          f"{record.id} in the trace: {e}") from e
    call = getattr(obj, "call", None)  # a `%%sgl NAME` cell binds NAME to its last state
    if call is not None and isinstance(getattr(call, "function", None), SglFunction):
        return call.function
    if not isinstance(obj, SglFunction) and not callable(obj):
        raise TypeError(f"{module}.{qualname} is a {type(obj).__name__}, not the program's "
                        "function: it cannot be re-run from the trace")
    return obj if isinstance(obj, SglFunction) else SglFunction(obj)


def _namespace(module: str):
    """The module, or for `__main__` in IPython (a notebook's kernel) its user namespace."""
    if module == "__main__" and "IPython" in sys.modules:
        shell = sys.modules["IPython"].get_ipython()
        if shell is not None:
            return shell.user_ns
    return sys.modules.get(module) or importlib.import_module(module)

