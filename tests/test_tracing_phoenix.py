"""A real receiver: spans exported over OTLP/HTTP to Arize Phoenix (`phoenix serve`,
installed by `make phoenix`) and read back with the Phoenix client."""

from __future__ import annotations

import os

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.phoenix_server import PhoenixServer

import sgl_nb as sgl

pytestmark = pytest.mark.slow
PROJECT = "sgl-nb-test"


@pytest.fixture(scope="session")
def phoenix():
    px = PhoenixServer()
    if not px.available:
        msg = f"Phoenix is not installed at {px.exe}: run `make phoenix`"
        if os.environ.get("SGL_NB_CI") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    px.start()
    yield px
    px.stop()
    assert px.proc is None


@sgl.function
def answer(s, q):
    s += "Q: " + q + "\nA:"
    s += sgl.gen("a", max_tokens=5, ignore_eos=True)
    s += " Sure?"
    s += sgl.select("sure", choices=[" yes", " no"])


def test_phoenix_receives_the_span_tree(phoenix, default_backend):
    mem = InMemorySpanExporter()
    sgl.enable_tracing(endpoint=phoenix.traces_url, exporter=mem, runtime=default_backend,
                       resource_attributes={"openinference.project.name": PROJECT})
    try:
        st = answer.run(q="What color is the sky?")
    finally:
        sgl.disable_tracing()
    assert st.error() is None
    sent = {f"{s.context.span_id:016x}": s for s in mem.get_finished_spans()}
    got = {s["context"]["span_id"]: s for s in phoenix.spans(PROJECT, expect=len(sent))}
    assert got.keys() == sent.keys()
    for sid, s in sent.items():
        p = got[sid]
        assert p["name"] == s.name
        assert p["parent_id"] == (f"{s.parent.span_id:016x}" if s.parent else None)
        assert p["context"]["trace_id"] == f"{s.context.trace_id:032x}"
    gen = next(p for p in got.values() if p["name"] == "Gen a")
    a, mine = gen["attributes"], sent[gen["context"]["span_id"]].attributes
    assert gen["span_kind"] == "LLM"  # Phoenix shows it as an LLM call ...
    assert a["llm.token_count.completion"] == 5  # ... with its token counts
    assert a["llm.token_count.prompt"] == mine["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.usage.output_tokens"] == 5
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == default_backend.model_path.name
    assert a["gen_ai.usage.cache_read.input_tokens"] == \
        mine["gen_ai.usage.cache_read.input_tokens"]
    sel = next(p for p in got.values() if p["name"] == "Select sure")
    assert sel["span_kind"] == "LLM" and sel["attributes"]["gen_ai.usage.input_tokens"] > 0
    root = next(p for p in got.values() if p["parent_id"] is None)
    assert root["name"] == "program answer"
