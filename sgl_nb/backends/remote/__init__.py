"""Remote backends: HTTP clients for vLLM's OpenAI-compatible API and SGLang's native API
(used by sgl_nb.backends.runtime_endpoint.RuntimeEndpoint)."""
