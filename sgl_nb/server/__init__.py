"""`sgl-nb serve`'s parts: the FastAPI app (app.py), its request models (requests_*.py), the
bodies parsed off the event loop (request_body.py) and the prompt limits (prompt_limits.py),
the OpenAI-compatible, vLLM tokenizer and SGLang-native routes (openai_routes.py,
tokenize_routes.py, sglang_routes.py), what ties a reply to its engine requests
(replies.py, streaming.py), errors, auth, metrics, and running it under uvicorn
(runner.py). `sgl_nb.server.serve` is the entry point."""
