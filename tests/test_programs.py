"""A suite of programs in the styles of SGLang's own frontend tests, run on our engine."""

from __future__ import annotations

import json

import pytest

import sgl_nb as sgl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("default_backend")]


def test_few_shot_qa_with_run_batch():
    @sgl.function
    def few_shot_qa(s, question):
        s += "The following are questions with answers.\n\n"
        s += "Q: What is the capital of France?\nA: Paris\n\n"
        s += "Q: What is the capital of Germany?\nA: Berlin\n\n"
        s += "Q: What is the capital of Italy?\nA: Rome\n\n"
        s += "Q: " + question + "\nA:"
        s += sgl.gen("answer", stop="\n", max_tokens=8, temperature=0)

    questions = ["What is the capital of Spain?", "What is the capital of Japan?",
                 "What is the capital of Egypt?"]
    states = few_shot_qa.run_batch([{"question": q} for q in questions])
    answers = [s["answer"].strip() for s in states]
    assert answers[0] == "Madrid" and answers[1] == "Tokyo"
    assert all("\n" not in a for a in answers)


def test_multi_turn_chat_in_both_role_forms():
    @sgl.function
    def multi_turn(s, q1, q2):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(q1)
        s += sgl.assistant(sgl.gen("a1", max_tokens=24))
        with s.user():
            s += q2
        with s.assistant():
            s += sgl.gen("a2", max_tokens=24)

    st = multi_turn.run(q1="Name a primary colour.", q2="Name another one.")
    roles = [m["role"] for m in st.messages()]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert st.messages()[2]["content"] == st["a1"] and st.messages()[4]["content"] == st["a2"]


def test_tool_use_with_python_between_gens():
    @sgl.function
    def calculator(s, a, b):
        s += f"Q: What is {a} times {b}? Use the calculator.\n"
        s += f"Calculator input: {a}*{b}\n"
        result = a * b  # the "tool": plain Python
        s += f"Calculator output: {result}\nSo the answer is"
        s += sgl.gen("answer", max_tokens=8, stop="\n")

    st = calculator.run(a=12, b=7)
    assert "Calculator output: 84" in st.text() and st["answer"]


def test_react_loop_branching_on_select():
    @sgl.function
    def react(s, question):
        s += "Answer by thinking step by step. Question: " + question + "\n"
        for step in range(3):
            s += f"Thought {step + 1}:"
            s += sgl.gen(f"thought_{step}", max_tokens=12, stop="\n")
            s += "\nAction:"
            s += sgl.select(f"action_{step}", [" finish", " search"])
            s += "\n"
            if s[f"action_{step}"] == " finish":
                break
        s += "Final answer:"
        s += sgl.gen("final", max_tokens=8, stop="\n")

    st = react.run(question="What is 2 + 2?")
    steps = [k for k in st.variables() if k.startswith("action_")]
    assert 1 <= len(steps) <= 3 and st.error() is None
    last = st[steps[-1]]
    assert last == " finish" or len(steps) == 3
    assert "final" in st.variables()


def test_recursive_decomposition_until_select_says_stop():
    @sgl.function
    def solve(s, task, depth):
        s += f"Task: {task}\nIs this task simple enough to do directly?"
        s += sgl.select("simple", [" yes", " no"])
        s += "\n"
        if s["simple"] == " yes" or depth >= 1:
            s += "Do it:"
            s += sgl.gen("result", max_tokens=8, stop="\n")
            return
        s += "Sub-task:"
        s += sgl.gen("sub", max_tokens=10, stop="\n")
        inner = solve.run(task=s["sub"].strip(), depth=depth + 1)
        s["result"] = inner["result"]

    st = solve.run(task="Plan a picnic for four friends", depth=0)
    assert st.error() is None and isinstance(st["result"], str)


def test_dtype_decoding_and_json_schema():
    @sgl.function
    def profile(s):
        s += "Alice is 31 years old and 1.68 metres tall.\nAge: "
        s += sgl.gen("age", dtype=int, max_tokens=4)
        s += "\nHeight: "
        s += sgl.gen("height", dtype=float, max_tokens=10)
        s += "\nAs JSON: "
        s += sgl.gen("json", max_tokens=60, json_schema=json.dumps({
            "type": "object", "properties": {"age": {"type": "integer", "maximum": 200}},
            "required": ["age"]}))

    st = profile.run()
    assert st.error() is None, st.error()
    assert isinstance(st["age"], int) and isinstance(st["height"], float)
    assert isinstance(json.loads(st["json"])["age"], int)


def test_invalid_json_schema_names_the_schema():
    @sgl.function
    def bad(s):
        s += "x"
        s += sgl.gen("j", json_schema="{not a schema")

    st = bad.run()
    assert isinstance(st.error(), ValueError) and "not a schema" in str(st.error())


def test_nested_calls_on_the_same_state_with_a_call_stack():
    @sgl.function
    def expand(s, point, depth):
        s += f"\n{'  ' * depth}- {point}:"
        s += sgl.gen(f"detail_{depth}", max_tokens=5, stop="\n", temperature=0)
        if depth < 2:
            expand(s, point=f"part of {point}", depth=depth + 1)  # nested, itself included

    @sgl.function
    def outline(s, topic):
        s += f"An outline about {topic}."
        expand(s, point=topic, depth=0)
        s += "\nEnd."

    st = outline.run(topic="bridges")
    assert st.error() is None
    assert [k for k in st.snapshot().vars if k.startswith("detail_")] == ["detail_0", "detail_1",
                                                               "detail_2"]
    gens = [n for n in st.nodes if n.kind == "Gen"]
    assert [n.stack for n in gens] == [("outline", "expand"), ("outline", "expand", "expand"),
                                       ("outline", "expand", "expand", "expand")]
    assert st.text().endswith("\nEnd.") and "    - part of part of bridges:" in st.text()
    assert st.call_stack == [{"function": "outline", "args": {"topic": "bridges"}}]
