"""The docs stay true to the repository: every file docs/architecture.md (and
docs/benchmarks.md) names exists, the README stays a short guide that links both, their
relative links resolve, and the layering the architecture states holds. No model, no
imports of the project: files are only read."""

from __future__ import annotations

import ast
import re
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
