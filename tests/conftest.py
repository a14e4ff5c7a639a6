"""Shared fixtures: the real default model, loaded once per session.

Waiting in a test (the suite runs on machines 3x slower than the 2-core one it is written
on, with the CPU shared, and must pass there unchanged):
- Wait for a STATE, never for a time: a kernel idle, a cell's prompt, a server answering,
  a request finished or producing its k-th token, a file written, an event received. No
  `sleep(0.3)  # a few steps in`: poll the state it stands for (support.waits.until, an
  event queue, a handle's result, playwright's expect, a Textual pilot polling).
- A limit on a wait only catches a hang: `support.waits.WAIT` (minutes) for anything that
  takes seconds here, `limit(N)` for longer things (a server or a model starting), both
  scaled by $SGL_NB_TEST_TIMEOUT_SCALE, as is pytest-timeout's per-test limit
  (pyproject.toml; see pytest_configure below). Nested limits grow outwards: nbclient's
  per-cell timeout above the waits inside the cell, the test's above them all.
- No assertion that something happens within N seconds; speed is measured by
  `sgl-nb bench ...` only. A negative check ("nothing decoded while held", "the body
  stopped") first waits for a positive signal that the system has acted (the handle
  finished, the thread joined, the count settled), then checks.
- Where only a timer can start something (a signal sent while a call blocks), send it once
  the state it needs holds (the request decoding, the main thread inside the call:
  support.interrupts.interrupt_main_inside), not after a fixed delay.
- A click in a browser on something that moves while text streams above it goes through
  the element's click event (playwright's dispatch_event), not the mouse.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from support.waits import limit

from sgl_nb.runtime.model.model_loader import resolve_model_path


def pytest_sessionstart(session):
    """Stop at once, with the reason, where the checkout's kernels/ folder shadows the PyPI
    package `kernels` (the working directory on sys.path: `python -m pytest` without -P):
    transformers imports that package, so every test that loads a transformers model would
    fail with an ImportError that names neither."""
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if spec is not None and (spec.origin or "").startswith(os.path.join(root, "kernels")):
        pytest.exit("the checkout's kernels/ folder shadows the package `kernels` that "
                    "transformers imports: run `python -P -m pytest` (or PYTHONSAFEPATH=1, "
                    "as `make test` does)", returncode=4)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """pytest-timeout's per-test limit from pyproject.toml grows with
    $SGL_NB_TEST_TIMEOUT_SCALE like every wait in the tests (unless --timeout or
    PYTEST_TIMEOUT sets it); tryfirst: before pytest-timeout reads it."""
    try:
        given, ini = config.getoption("timeout"), config.getini("timeout")
    except ValueError:  # pytest-timeout is not installed
        return
    if given is None and not os.environ.get("PYTEST_TIMEOUT") and ini:
        config.option.timeout = limit(float(ini))


@pytest.fixture
def python_sigint():
    """SIGINT raises KeyboardInterrupt, as in a script or a kernel, whatever an earlier test
    of this process installed (the browser test's driver replaces the handler)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="session")
def ipython_shell():
    """IPython's one global test shell (a second start_ipython() returns None), with the
    magics loaded."""
    from IPython.testing import globalipapp

    globalipapp.start_ipython()
    ip = globalipapp.get_ipython()
    ip.run_line_magic("load_ext", "sgl_nb")
    return ip


@pytest.fixture(scope="session")
def model_path():
    return resolve_model_path()


@pytest.fixture(scope="session")
def runtime(model_path):
    from sgl_nb import Runtime

    rt = Runtime(model_path, kv_pool_tokens=16384)
    yield rt
    rt.shutdown()


@pytest.fixture(scope="session")
def default_backend(runtime):
    """Programs (`@sgl.function`) run on the session's Runtime."""
    import sgl_nb as sgl

    sgl.set_default_backend(runtime)
    return runtime


@pytest.fixture(scope="session")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers `generate`, greedy, exactly n new tokens (EOS does not stop it)."""
    from transformers import GenerationConfig

    # The model's own generation_config would stop at EOS: use a bare one.
    hf.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    assert out.shape[1] == len(ids) + n
    return out[0, len(ids):].tolist()
