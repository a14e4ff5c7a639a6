"""llama.cpp's side of `sgl-nb bench peers`, run as a script by the python of the venv that
has llama-cpp-python (`make llamacpp`): it imports nothing of sgl_nb, torch or numpy.

It reads one JSON request a line on stdin and answers one JSON line on stdout:
    {"model": "x.gguf", "ids": [...], "n": 128, "threads": 2, "stop_at_eos": false,
     "lookup": 0}
    -> {"tokens": [...], "seconds": ..., "decode_seconds": ...}
"lookup" > 0 drafts that many tokens by prompt lookup (LlamaPromptLookupDecoding).
"keep_prefix": true keeps what the model evaluated for the request before, so that generate
computes only what follows their longest common prefix (`sgl-nb bench engine`'s
shared-prefix requests, one after another). Greedy
(top_k=1): llama.cpp's generate yields tokens until told to stop. Each model stays loaded
between requests (the bench alternates them round by round). {"ping": true} answers the
library's version once everything imports.
"""

import json
import sys
import time

from llama_cpp import Llama, __version__
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

_loaded: dict = {}


def model(path: str, threads: int, lookup: int) -> Llama:
    key = (path, threads, lookup)
    if key not in _loaded:
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
        # With a draft model llama-cpp-python keeps every row's logits but sizes its score
        # buffer by the logits_all argument: without it, a prompt past n_batch tokens fails
        # ("could not broadcast ... into shape (0,)").
        _loaded[key] = Llama(model_path=path, n_ctx=4096, n_batch=512, n_threads=threads,
                             n_threads_batch=threads, draft_model=draft,
                             logits_all=draft is not None, verbose=False)
    return _loaded[key]


def one_stream(req: dict) -> dict:
    llm = model(req["model"], req["threads"], req.get("lookup", 0))
    eos = llm.token_eos() if req.get("stop_at_eos") else None
    tokens, stamps = [], []
    if not req.get("keep_prefix"):
        llm.reset()
    t0 = time.perf_counter()
    for token in llm.generate(req["ids"], top_k=1, temp=0.0, reset=True):
        stamps.append(time.perf_counter())
        if token == eos:
            break
        tokens.append(token)
        if len(tokens) == req["n"]:
            break
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "decode_seconds": stamps[-1] - stamps[0]}


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = {"version": __version__} if req.get("ping") else one_stream(req)
        except Exception as e:  # the bench shows it with the request that failed
            reply = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
