"""The attributes that make a Gen / Select node span an LLM call to other tools: the
OpenTelemetry GenAI conventions (DESIGN.md "Traces"), and the OpenInference ones that
Arize Phoenix reads to show an LLM span with its token counts."""

from __future__ import annotations

from sgl_nb.runtime.events import NodeKind

OPERATION = {NodeKind.GEN: "text_completion", NodeKind.SELECT: "text_completion"}
LLM_KINDS = frozenset(OPERATION)  # the Nodes that are an LLM call
PROVIDER = "sgl-nb"


def node_span_name(kind: NodeKind | None, name: str | None) -> str:
    word = kind.value if kind is not None else "Node"
    return f"{word} {name}" if name else word


def node_llm_attrs(kind: NodeKind | None, model: str | None) -> dict:
    if kind not in LLM_KINDS:
        return {}
    out = {"gen_ai.operation.name": OPERATION[kind], "gen_ai.provider.name": PROVIDER,
           "gen_ai.system": PROVIDER, "openinference.span.kind": "LLM",
           "llm.provider": PROVIDER}
    if model:
        out["gen_ai.request.model"] = model
        out["gen_ai.response.model"] = model
        out["llm.model_name"] = model
    return out


def instruction_usage(finished: list[dict], n_tokens: int = 0) -> dict:
    """Token usage of a node from its Decode/Score instructions' finished data; without
    any (a runtime that does not report usage), the tokens seen stand for the output."""
    inputs = sum(d.get("input_tokens") or 0 for d in finished)
    outputs = sum(d.get("output_tokens") or 0 for d in finished) if finished else n_tokens
    cached = sum(d.get("cached_tokens") or 0 for d in finished)
    reasons = [str(d["finish_reason"]) for d in finished if d.get("finish_reason")]
    out = {"gen_ai.usage.input_tokens": inputs, "gen_ai.usage.output_tokens": outputs,
           "gen_ai.usage.cache_read.input_tokens": cached,
           "llm.token_count.prompt": inputs, "llm.token_count.completion": outputs,
           "llm.token_count.total": inputs + outputs,
           "llm.token_count.prompt_details.cache_read": cached}
    if reasons:
        out["gen_ai.response.finish_reasons"] = reasons
    return out
