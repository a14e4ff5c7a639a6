"""The docs stay true to the repository: every file docs/architecture.md (and
docs/benchmarks.md) names exists, the README stays a short guide that links both, their
relative links resolve, and the layering the architecture states holds. No model, no
imports of the project: files are only read."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
README_MAX_LINES = 335  # the families table joined; the serve details moved to docs

# A backticked token is taken for a repository path when it contains a "/" or ends in one
# of these (`runtime/compiler/executor.py`, `kernels/`, `pyproject.toml`); `sgl_nb.runtime` or
# `ProgramState._flush` are names, not paths.
PATH_SUFFIXES = (".py", ".cpp", ".h", ".md", ".toml", ".ipynb", ".txt", ".json", ".sh")
PATH_TOKEN = re.compile(r"[A-Za-z0-9_][\w.*/-]*")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def named_paths(markdown: str) -> list[str]:
    """The repository paths a Markdown text names in inline code (code blocks left out:
    they hold commands and programs, not references)."""
    text = FENCE.sub("", markdown)
    tokens = re.findall(r"`([^`\n]+)`", text)
    return sorted({t for t in tokens if PATH_TOKEN.fullmatch(t)
                   and ("/" in t or t.endswith(PATH_SUFFIXES))})


def test_named_paths_reads_paths_not_names():
    text = ("`runtime/compiler/executor.py` `kernels/` `kernels/*.cpp` `pyproject.toml` "
            "`sgl_nb.runtime` `ProgramState._flush` `/v1/completions` `$SGL_NB_CACHE/ext` "
            "`a b/c.py`\n```sh\nmissing/in_a_block.py\n```\n")
    assert named_paths(text) == ["kernels/", "kernels/*.cpp", "pyproject.toml",
                                 "runtime/compiler/executor.py"]


@pytest.mark.parametrize("doc", [ARCHITECTURE, BENCHMARKS], ids=lambda p: p.name)
def test_every_path_a_doc_names_exists(doc):
    paths = named_paths(doc.read_text(encoding="utf-8"))
    missing = [p for p in paths if not any(ROOT.glob(p.rstrip("/")))]
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_architecture_walks_the_pipeline_file_by_file():
    paths = set(named_paths(ARCHITECTURE.read_text(encoding="utf-8")))
    for stage in ("sgl_nb/notebook/magics.py", "sgl_nb/notebook/cell_program.py",
                  "sgl_nb/language/function.py", "sgl_nb/language/body_pool.py",
                  "sgl_nb/language/state.py", "runtime/compiler/passes.py",
                  "runtime/compiler/instructions.py", "runtime/compiler/lowering.py",
                  "runtime/compiler/executor.py", "runtime/compiler/step_controller.py",
                  "sgl_nb/language/effects.py", "sgl_nb/backends/local_runtime.py",
                  "sgl_nb/backends/runtime_endpoint.py", "runtime/engine.py",
                  "runtime/scheduler.py", "runtime/radix_cache.py", "runtime/kv_pool.py",
                  "runtime/model/model.py", "runtime/events.py"):
        assert stage in paths, f"docs/architecture.md does not name {stage}"


def test_readme_is_a_short_guide():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; the guide stays under {README_MAX_LINES} (move "
        "architecture to docs/architecture.md and figures to docs/benchmarks.md)")


def test_readme_links_the_docs():
    links = set(LINK.findall(README.read_text(encoding="utf-8")))
    for doc in ("docs/architecture.md", "docs/benchmarks.md"):
        assert doc in links, f"README.md does not link {doc}"
        assert (ROOT / doc).is_file(), f"{doc} does not exist"


@pytest.mark.parametrize("doc", [README, ARCHITECTURE, BENCHMARKS], ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    targets = [t for t in LINK.findall(doc.read_text(encoding="utf-8"))
               if "://" not in t and not t.startswith("mailto:")]
    broken = [t for t in targets if not (doc.parent / t).resolve().exists()]
    outside = [t for t in targets if ROOT not in (doc.parent / t).resolve().parents
               and (doc.parent / t).resolve() != ROOT]
    assert not broken, f"{doc.name} links to missing files: {broken}"
    assert not outside, f"{doc.name} links outside the repository: {outside}"


# The layering rule docs/architecture.md states: nothing imports upward.
LAYERS = {
    "kernels": (),  # nothing of the project
    "runtime": ("sgl_nb.runtime", "sgl_nb.kernels"),
    # runtime's event types: the events, and the token choices a token event carries.
    "tracing": ("sgl_nb.tracing", "sgl_nb.runtime.events", "sgl_nb.runtime.token_choice"),
}


def _project_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return [n for n in names if n == "sgl_nb" or n.startswith("sgl_nb.")]


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_nothing_imports_upward(folder):
    allowed = LAYERS[folder]
    bad = [f"{path.relative_to(ROOT)}: {name}"
           for path in sorted((ROOT / folder).rglob("*.py"))  # runtime/compiler/, ... too
           for name in _project_imports(path)
           if not any(name == a or name.startswith(a + ".") for a in allowed)]
    assert not bad, f"{folder}/ imports above its layer: {bad}"


# ---- every identifier docs/architecture.md names exists ----------------------------------
SOURCE_FOLDERS = ("sgl_nb", "runtime", "kernels", "tracing", "tui")
# Other libraries' names the doc cites (called on their objects, never defined here).
EXTERNAL = {"find_jump_forward_string"}
CPP_NAME = re.compile(r"\b(?:struct|class|enum(?:\s+class)?)\s+(\w+)|(\w+)\s*\(")


def _module_names(tree: ast.Module) -> set[str]:
    """Every name a module defines, assigns, sets as an attribute, imports or spells as a
    string (a stats key, an event kind's wire name)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.update(re.findall(r"\w+", node.value))
    return names


def _source_index() -> tuple[set[str], dict[str, set[str]]]:
    """(every name any module defines, class -> the names its module defines)."""
    everything: set[str] = set()
    by_class: dict[str, set[str]] = {}
    for folder in SOURCE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            names = _module_names(tree)
            everything |= names
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    by_class.setdefault(node.name, set()).update(names)
        for path in [*(ROOT / folder).rglob("*.cpp"), *(ROOT / folder).rglob("*.h")]:
            for found in CPP_NAME.findall(path.read_text(encoding="utf-8")):
                everything.update(n for n in found if n)
    return everything, by_class


def _module_exists(dotted: str) -> bool:
    """sgl_nb.X.Y: a module or package, through pyproject.toml's package-dir mapping."""
    parts = dotted.split(".")[1:]
    folder = {"runtime": "runtime", "kernels": "kernels", "tracing": "tracing", "tui": "tui"}
    base = ROOT / folder[parts[0]] if parts and parts[0] in folder else ROOT / "sgl_nb"
    rest = parts[1:] if parts and parts[0] in folder else parts
    path = base.joinpath(*rest)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def named_identifiers(markdown: str) -> list[str]:
    """The code names a Markdown text puts in inline code that say which code they mean:
    a class (`TokenPicker`), a member (`Engine.step`), a private or snake_case name
    (`_flush`, `drop_drafts`), a constant; call parentheses dropped. Plain words (`gen`,
    `auto`), paths, options and the standard library's names are left out."""
    out = set()
    for token in re.findall(r"`([^`\n]+)`", FENCE.sub("", markdown)):
        if token.endswith(PATH_SUFFIXES):
            continue
        name = token.split("(", 1)[0]
        parts = name.split(".")
        if not all(p.isidentifier() for p in parts) or parts[0] in sys.stdlib_module_names:
            continue
        if len(parts) > 1 or "_" in name or any(c.isupper() for c in name):
            out.add(name)
    return sorted(out)


def test_named_identifiers_reads_code_names():
    text = ("`TokenPicker` `Engine.step` `_flush` `drop_drafts` `gen` `auto` `ast.parse` "
            "`Decode(name, params)` `runtime/engine.py` `pyproject.toml` `--arg KEY=VALUE`"
            "\n```\nNotThis\n```")
    assert named_identifiers(text) == ["Decode", "Engine.step", "TokenPicker", "_flush",
                                       "drop_drafts"]


def test_every_identifier_the_architecture_names_exists():
    everything, by_class = _source_index()
    missing = []
    for name in named_identifiers(ARCHITECTURE.read_text(encoding="utf-8")):
        owner, _, member = name.rpartition(".")
        if name.split(".")[0] == "sgl_nb":  # a module
            ok = _module_exists(name)
        elif name in EXTERNAL:
            ok = True
        elif owner and owner in by_class:  # `Class.member`: in the module defining Class
            ok = member in by_class[owner]
        else:
            ok = all(part in everything for part in name.split("."))
        if not ok:
            missing.append(name)
    assert not missing, f"docs/architecture.md names code that does not exist: {missing}"


# ---- no import cycles ---------------------------------------------------------------------
PACKAGE_OF = {"sgl_nb": "sgl_nb", "runtime": "sgl_nb.runtime", "kernels": "sgl_nb.kernels",
              "tracing": "sgl_nb.tracing", "tui": "sgl_nb.tui"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGE_OF.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules a file imports, at its top or inside a function (a lazy import
    hides a cycle, it does not break it); `if TYPE_CHECKING:` blocks left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    typing_only = {id(n) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for n in ast.walk(block)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            out |= submodules  # `from pkg import module` needs the module, not pkg's names
            if len(submodules) < len(node.names):
                out.add(node.module)
    return out & modules.keys()


def import_cycles() -> list[list[str]]:
    """Strongly connected groups of more than one module in the import graph (Tarjan)."""
    modules = _modules()
    graph = {m: sorted(_imported_modules(p, modules)) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, f"modules that import each other (directly or round a loop): {cycles}"
