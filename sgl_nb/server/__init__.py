"""`sgl-nb serve`'s parts: the FastAPI app (app.py), its request models (requests_*.py), the
OpenAI-compatible and SGLang-native routes (openai_routes.py, sglang_routes.py), what ties a
reply to its engine requests (replies.py, streaming.py), errors, auth, metrics, and running
it under uvicorn (runner.py). `sgl_nb.server.serve` is the entry point."""
