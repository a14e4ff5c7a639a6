"""Programs run by SGLang's own frontend package (`import sglang`, from .venv-sglang:
`make sglang`) against a server, for tests/test_serve_sglang_frontend.py:

    .venv-sglang/bin/python tests/support/sglang_frontend.py URL NAME ...

A NAME is one of SGLang's test programs (sglang.test.test_programs, e.g. test_select) or
one of ours below (fork_concat, ...). Each prints one JSON line: {"name", "ok", ...}; ours
add what the pytest side checks against the engine, a failure its traceback and, for an
AssertionError, the source line of the assert. This file runs in SGLang's venv: it imports
sglang and the standard library, nothing of sgl_nb."""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from collections.abc import Callable

import sglang as sgl
from sglang.test import test_programs

# SGLang's programs take check_answer=False where they offer it (the content checks are
# for models far bigger than a 135M one).
NO_CONTENT_CHECK = {"test_select", "test_expert_answer", "test_parallel_encoding"}

FEW_SHOT = ("The following are questions with answers.\n\n"
            "Q: What is the capital of France?\nA: Paris\n"
            "Q: What is the capital of Germany?\nA: Berlin\n")
PARENT = "USER: Remember these statements.\n"
STATEMENTS = ["Ethan is the father of Liam.", "Noah is the father of Julian.",
              "Oliver is the father of Carlos."]
QUESTION = "Question: Who is the father of Julian?\nAnswer:"
SELECT_PROMPT = "Q: Is the sky blue on a clear day?\nA:"
SELECT_CHOICES = ["Yes", "No", "Maybe not"]
LONG_PREFIX = ("Here is a long shared preamble that a program reuses in every call, so that "
               "caching it once pays off for all the questions that follow it. ") * 3


@sgl.function
def few_shot(s, question):
    s += FEW_SHOT + "Q: " + question + "\nA:" + sgl.gen("answer", stop="\n", max_tokens=16)


@sgl.function
def fork_concat(s):
    s += PARENT
    forks = s.fork(len(STATEMENTS))
    forks += lambda i: f"Statement {i}: {STATEMENTS[i]}\n"
    forks.join(mode="concate_and_append")
    s += QUESTION + sgl.gen("answer", max_tokens=12, temperature=0)


@sgl.function
def fork_gather(s, topics):
    s += "List facts.\n"
    forks = s.fork(len(topics))
    for topic, branch in zip(topics, forks):
        branch += f"{topic} is" + sgl.gen("fact", max_tokens=6, temperature=0)
    forks.join()
    for topic, branch in zip(topics, forks):
        s += f"{topic}:{branch['fact']}\n"


@sgl.function
def pick(s, method):
    s += SELECT_PROMPT + sgl.select("answer", SELECT_CHOICES, choices_method=method)


@sgl.function
def stream_qa(s):
    s += "Q: Name three colors.\nA:" + sgl.gen("answer", max_tokens=16, temperature=0,
                                                 return_logprob=True)


@sgl.function
def at_least(s):
    s += "Q: Say yes.\nA:" + sgl.gen("answer", min_tokens=12, max_tokens=20, temperature=0,
                                      stop="\n")


@sgl.function
def after_prefix(s, question):
    s += LONG_PREFIX + question + sgl.gen("answer", max_tokens=2, temperature=0)


def _state(state) -> dict:
    error = state.stream_executor.error()
    return {"text": state.text(), "error": None if error is None else repr(error)}


def run_fork_concat() -> dict:
    state = fork_concat.run()
    return {**_state(state), "answer": state["answer"],
            "meta": state.get_meta_info("answer"), "parent": PARENT,
            "branches": [f"Statement {i}: {t}\n" for i, t in enumerate(STATEMENTS)],
            "question": QUESTION,
            "parallel_encoding": sgl.global_config.enable_parallel_encoding}


def run_fork_gather() -> dict:
    topics = ["water", "iron"]
    state = fork_gather.run(topics=topics)
    return {**_state(state), "topics": topics, "facts": state["fact"]}


def run_select() -> dict:
    out = {}
    for method in ("token_length_normalized", "greedy_token_selection",
                   "unconditional_likelihood_normalized"):
        state = pick.run(method=getattr(sgl, method))
        out[method] = {**_state(state), "answer": state["answer"],
                       "meta": state.get_meta_info("answer")}
    return {"prompt": SELECT_PROMPT, "choices": SELECT_CHOICES, "methods": out}


def run_batch() -> dict:
    questions = ["What is the capital of Japan?", "What is the capital of Italy?",
                 "What is the capital of Spain?"]
    states = few_shot.run_batch([{"question": q} for q in questions], temperature=0)
    return {"prompts": [FEW_SHOT + "Q: " + q + "\nA:" for q in questions],
            "answers": [st["answer"] for st in states],
            "errors": [_state(st)["error"] for st in states]}


def run_stream() -> dict:
    state = stream_qa.run(stream=True)
    chunks = list(state.text_iter("answer"))

    async def with_meta() -> list:
        st = stream_qa.run(stream=True)
        return [[text, meta] async for text, meta in
                st.text_async_iter("answer", return_meta_data=True)]

    return {**_state(state), "prompt": "Q: Name three colors.\nA:", "chunks": chunks,
            "answer": state["answer"], "with_meta": asyncio.run(with_meta())}


def run_min_tokens() -> dict:
    state = at_least.run()
    return {**_state(state), "prompt": "Q: Say yes.\nA:", "answer": state["answer"],
            "meta": state.get_meta_info("answer")}


def run_cache_prefix() -> dict:
    backend = sgl.global_config.default_backend
    sgl.flush_cache()
    # run() returns at once: the program runs on the frontend's executor thread, so the
    # flush after it waits until it has finished (sync), or it would flush first.
    cold = after_prefix.run(question="Q1:")
    cold.sync()
    sgl.flush_cache()
    backend.cache_prefix(LONG_PREFIX)
    warm = after_prefix.run(question="Q2:")
    return {"prefix": LONG_PREFIX, "cold": {**_state(cold), "meta": cold.get_meta_info("answer")},
            "warm": {**_state(warm), "meta": warm.get_meta_info("answer")}}


def run_server_info() -> dict:
    return {"info": sgl.get_server_info(),
            "model_path": sgl.global_config.default_backend.get_model_name()}


def run_profile() -> dict:
    try:
        sgl.global_config.default_backend.start_profile()
    except RuntimeError as e:
        return {"refused": str(e)}
    return {"refused": None}


OURS: dict[str, Callable[[], dict]] = {
    "fork_concat": run_fork_concat, "fork_gather": run_fork_gather, "select": run_select,
    "batch": run_batch, "stream": run_stream, "min_tokens": run_min_tokens,
    "cache_prefix": run_cache_prefix, "server_info": run_server_info,
    "profile": run_profile,
}


def run_sglang_program(name: str) -> dict:
    program = getattr(test_programs, name)
    kwargs = {"check_answer": False} if name in NO_CONTENT_CHECK else {}
    program(**kwargs)
    return {}


def failed_assert_line(tb) -> str:
    """The source of the line whose assert failed (the innermost frame)."""
    frames = traceback.extract_tb(tb)
    return frames[-1].line if frames else ""


def run(name: str) -> dict:
    try:
        out = OURS[name]() if name in OURS else run_sglang_program(name)
        return {"name": name, "ok": True, **out}
    except AssertionError as e:
        return {"name": name, "ok": False, "assert": failed_assert_line(e.__traceback__),
                "error": traceback.format_exc()}
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        return {"name": name, "ok": False, "error": traceback.format_exc()}


def main(argv: list[str]) -> int:
    url, names = argv[0], argv[1:]
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    for name in names:
        print(json.dumps(run(name)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
