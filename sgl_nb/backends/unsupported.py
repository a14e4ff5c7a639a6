"""SGLang's names for backends and engines sgl-nb does not have. Each is a callable that
says so and what to use instead, so a program ported from SGLang fails at the line that
names it, with a reason (not an AttributeError on the module)."""

from __future__ import annotations

_HOSTED = ("is a hosted chat API, not a backend of sgl-nb (programs here need the model's "
           "tokenizer and prompt logprobs): run programs on sgl.Runtime() in this process, "
           "or on a vLLM / SGLang server with sgl.RuntimeEndpoint(url)")

REASONS = {
    "OpenAI": "sgl.OpenAI (OpenAI's hosted API) " + _HOSTED + "; an OpenAI-compatible "
              "server is sgl.RuntimeEndpoint(base_url, api='openai')",
    "Anthropic": "sgl.Anthropic " + _HOSTED,
    "VertexAI": "sgl.VertexAI " + _HOSTED,
    "LiteLLM": "sgl.LiteLLM " + _HOSTED,
    "Crusoe": "sgl.Crusoe " + _HOSTED,
    "Engine": "sgl.Engine is SGLang's offline engine; sgl-nb's is sgl.Runtime(model_path, "
              "...): rt.generate(prompt, max_tokens=...), rt.submit(...)",
    "ServerArgs": "sgl.ServerArgs configures SGLang's server; sgl.Runtime(**settings) takes "
                  "this engine's settings (SGLang's names where one exists), and `sgl-nb "
                  "serve` starts a server",
}


def _refused(name: str):
    def refuse(*_args, **_kwargs):
        raise NotImplementedError(REASONS[name])

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Not in sgl-nb: calling it raises NotImplementedError ({REASONS[name]})."
    return refuse


OpenAI = _refused("OpenAI")
Anthropic = _refused("Anthropic")
VertexAI = _refused("VertexAI")
LiteLLM = _refused("LiteLLM")
Crusoe = _refused("Crusoe")
Engine = _refused("Engine")
ServerArgs = _refused("ServerArgs")
