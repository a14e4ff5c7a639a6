"""Programs the terminal debugger's tests run (tests/test_tui*.py)."""

import sgl_nb as sgl


@sgl.function
def story(s, topic="a small town"):
    s += "Once upon a time, in " + topic + ","
    s += sgl.gen("a", max_tokens=6, ignore_eos=True)
    s += " Then"
    s += sgl.gen("b", max_tokens=4, ignore_eos=True)


@sgl.function
def long_story(s):
    s += "Here is a long story about a dragon."
    s += sgl.gen("tale", max_tokens=64, ignore_eos=True)


@sgl.function
def broken(s):
    s += "The answer is"
    s += sgl.gen("answer", max_tokens=2, ignore_eos=True)
    raise ValueError("no number in " + s["answer"])


@sgl.function
def chat(s):
    with s.user():
        s += "Pick a colour."
    with s.assistant():
        s += sgl.select("colour", choices=["red", "blue"])
    forks = s.fork(2)
    forks += lambda i: f" Idea {i}:"
    forks += sgl.gen("idea", max_tokens=3, ignore_eos=True)
    forks.join()
