"""A `%%sgl` cell body compiled into an `@sgl.function`.

The body becomes the body of `def NAME(s, <--arg names>)`: `s` and the DSL names (`gen`,
`select`, `user`, ...) are in scope, and every other name is looked up in the notebook's
namespace when the program runs. Line numbers are the cell's own, counting the `%%sgl` line
as line 1, so a syntax error, a traceback and the debugger's Node lines point at the cell.
"""

from __future__ import annotations

import ast
import functools
import linecache
import types

import sgl_nb.language.expressions as dsl
from sgl_nb.language.function import SglFunction
from sgl_nb.language.rerun_cursor import MISSING
from sgl_nb.runtime.compiler.ir import NodeKind

# The names a cell body sees without importing anything.
DSL_NAMES = (
    "gen", "gen_int", "gen_string", "select", "system", "user", "assistant",
    "REGEX_INT", "REGEX_FLOAT", "REGEX_BOOL", "REGEX_STR",
)
_SEEDED = ("gen", "gen_int", "gen_string")  # the DSL calls that take a seed


def cell_filename(name: str, count: int | None) -> str:
    """The file name tracebacks show for a cell: it names the program and the cell."""
    return f"<%%sgl {name} In[{count if count is not None else '?'}]>"


def parse_arg_value(text: str):
    """`--arg key=value`: a Python literal when it is one (3, 0.5, [1, 2], 'x'), else the
    string itself (so `--arg topic=cats` needs no quotes)."""
    try:
        return ast.literal_eval(text)
    # TypeError: a literal that cannot be built ({[]: 1}); the others: nested too deeply.
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def parse_args(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        if len(pair) > 1 and pair[0] == pair[-1] and pair[0] in "'\"":
            pair = pair[1:-1]  # IPython's splitter keeps the quotes of "key=a b"
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"--arg takes key=value with a Python name as key, got {pair!r}")
        out[key] = parse_arg_value(value)
    return out


SAMPLING_HINT = "temperature=0.8 max_tokens=40 seed=2"


def parse_edit(kind: NodeKind, value: str, sampling_text: str) -> tuple[object, dict]:
    """What the boxes say as rerun's (value, sampling): a Gen with sampling arguments or an
    empty value is generated again; otherwise the value replaces the Node's output."""
    sampling = {}
    if kind is NodeKind.GEN and sampling_text.strip():
        try:
            sampling = parse_args(sampling_text.split())
        except ValueError:
            raise ValueError(f"sampling arguments are key=value pairs separated by spaces, "
                             f"e.g. {SAMPLING_HINT}; got {sampling_text.strip()!r}") from None
    if sampling or (kind is NodeKind.GEN and value == ""):
        return MISSING, sampling
    return value, {}


def compile_cell(body: str, name: str, magic_line: str, user_ns: dict, args: dict,
                 count: int | None = None, seed: int | None = None) -> SglFunction:
    """The cell as a program. Raises SyntaxError at the cell's own line and file name."""
    if not name.isidentifier():
        raise ValueError(f"the program name must be a Python name, got {name!r}")
    filename = cell_filename(name, count)
    source = f"%%sgl {magic_line}\n{body}"
    # Kept in linecache so tracebacks (IPython's and traceback's) print the cell's lines.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        tree = ast.parse(body, filename)
    except SyntaxError as e:
        raise _cell_syntax_error(e, filename, source) from None
    ast.increment_lineno(tree, 1)  # the `%%sgl` line is line 1 of the cell
    func = _build(tree.body, name, list(args), filename, user_ns, _dsl_scope(seed))
    func.__defaults__ = tuple(args.values()) or None
    return SglFunction(func)


def _cell_syntax_error(e: SyntaxError, filename: str, source: str) -> SyntaxError:
    lineno = (e.lineno or 0) + 1
    lines = source.splitlines()
    text = lines[lineno - 1] if 0 < lineno <= len(lines) else e.text
    err = SyntaxError(e.msg, (filename, lineno, e.offset, text,
                              (e.end_lineno or 0) + 1 if e.end_lineno else None,
                              e.end_offset))
    return err


def _dsl_scope(seed: int | None) -> dict:
    scope = {n: getattr(dsl, n) for n in DSL_NAMES}
    if seed is not None:
        # A cell's --seed is the default seed of every gen in it; a gen's own seed= wins.
        for n in _SEEDED:
            scope[n] = functools.partial(scope[n], seed=seed)
    return scope


def _build(stmts: list[ast.stmt], name: str, arg_names: list[str], filename: str,
           user_ns: dict, scope: dict) -> types.FunctionType:
    """def __sgl_scope__(<DSL names>): def NAME(s, <args>): <body>; return NAME

    The DSL names become closure cells of NAME (they win over notebook names of the same
    spelling); NAME's globals are the notebook's namespace itself, read at run time."""
    if "s" in arg_names:
        raise ValueError("--arg s=... would hide the program state `s`")
    # Parsed from a template (not built node by node) so it compiles on every Python 3.10+.
    params = ", ".join(["s", *arg_names])
    template = ast.parse(f"def __sgl_scope__({', '.join(scope)}):\n"
                         f"    def {name}({params}):\n        pass\n    return {name}\n")
    outer = template.body[0]
    outer.body[0].body = stmts or [ast.Pass()]
    module = ast.fix_missing_locations(template)
    code = compile(module, filename, "exec")
    outer_code = next(c for c in code.co_consts if isinstance(c, types.CodeType))
    factory = types.FunctionType(outer_code, user_ns, "__sgl_scope__")
    return factory(**scope)
