"""Shared fixtures: the real default model, loaded once per session."""

from __future__ import annotations

import signal

import pytest
import torch

from sgl_nb.runtime.model.model_loader import resolve_model_path


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
