"""vLLM's /tokenize and /detokenize: a text or a chat (its template applied, as
/v1/chat/completions would) to the model's token ids, `{count, max_model_len, tokens,
token_strs}`; token ids back to text, `{prompt}`. Clients count a prompt's tokens with them
before they send it, and benchmarks (`vllm bench serve`) read the vocabulary through them."""

from __future__ import annotations

from sgl_nb.server.openai_routes import CHAT_PROMPT, chat_prompt
from sgl_nb.server.prompt_limits import PromptLimits
from sgl_nb.server.refusals import BadRequest
from sgl_nb.server.replies import Served
from sgl_nb.server.requests_common import refuse_unsupported
from sgl_nb.server.requests_openai import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from sgl_nb.server.tool_calls import template_of, tool_use


def tokenize(served: Served, body: TokenizeCompletionRequest | TokenizeChatRequest,
             limits: PromptLimits) -> dict:
    served.check_model(body.model)
    rt = served.runtime
    if isinstance(body, TokenizeChatRequest):
        refuse_unsupported(body.unsupported())
        tools = tool_use(body, lambda schema: rt.check_grammar(None, schema))
        text, what = chat_prompt(rt, body, template_of(rt.tokenizer), tools), CHAT_PROMPT
    else:
        text, what = body.prompt, "prompt"
    ids = limits.encode(rt.tokenizer, text, body.add_special_tokens, what)
    out = {"count": len(ids), "max_model_len": limits.context_len, "tokens": ids,
           "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = rt.tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(served: Served, body: DetokenizeRequest) -> dict:
    served.check_model(body.model)
    rt = served.runtime
    vocab = rt.engine.config.vocab_size
    outside = [i for i, t in enumerate(body.tokens) if t >= vocab]
    if outside:
        i = outside[0]
        raise BadRequest(f"tokens[{i}]: {body.tokens[i]} is not a token id of this model "
                         f"(its vocabulary is [0, {vocab}))")
    return {"prompt": rt.tokenizer.decode(body.tokens)}
