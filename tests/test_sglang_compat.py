"""The rest of SGLang's frontend surface, as programs written for it use it: role begin/end
markers, the select methods by name, gen's and run()'s sampling and logprob arguments,
separate_reasoning, flush_cache / get_server_info, and clear errors for what a text-only
engine cannot do. On the real default model; logprobs checked against transformers."""

from __future__ import annotations

import pytest
import torch

import sgl_nb as sgl
from sgl_nb.language.reasoning import split_reasoning
from sgl_nb.server.serve import start_in_thread

pytestmark = pytest.mark.slow


@sgl.function
def markers(s, q):
    s += sgl.system_begin() + "You are terse." + sgl.system_end()
    s += sgl.user_begin()
    s += q
    s += sgl.user_end()
    s += sgl.assistant_begin()
    s += sgl.gen("a", max_tokens=12)
    s += sgl.assistant_end()


@sgl.function
def blocks(s, q):
    s += sgl.system("You are terse.")
    with s.user():
        s += q
    s += sgl.assistant(sgl.gen("a", max_tokens=12))


def test_role_begin_end_markers_make_the_same_turns_as_blocks(default_backend):
    a, b = markers.run(q="Name a fruit."), blocks.run(q="Name a fruit.")
    assert a.error() is None and b.error() is None
    assert a.text() == b.text() and a.messages() == b.messages()
    assert [m["role"] for m in a.messages()] == ["system", "user", "assistant"]


def test_empty_role_call_is_an_empty_turn(default_backend):
    @sgl.function
    def empty(s):
        s += sgl.user("Hi") + sgl.assistant()

    st = empty.run()
    assert st.error() is None and st.messages()[-1] == {"role": "assistant", "content": ""}
    roles = default_backend.chat_roles
    assert st.text().endswith(roles.prefix["assistant"] + roles.suffix["assistant"])


@pytest.mark.parametrize("body,named", [
    (lambda s: [s.__iadd__(sgl.user_begin()), s.__iadd__(sgl.assistant_begin())],
     "nested roles: assistant inside an open user"),
    (lambda s: s.__iadd__(sgl.user_end()), "user_end without user_begin"),
    (lambda s: [s.__iadd__(sgl.user_begin()), s.__iadd__(sgl.assistant_end())],
     "assistant_end without assistant_begin"),
])
def test_unbalanced_markers_are_named(default_backend, body, named):
    prog = sgl.function(lambda s: body(s))
    assert named in str(prog.run().error())


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized])
def test_select_methods_by_their_sglang_names(default_backend, method):
    @sgl.function
    def pick(s, m):
        s += "Q: Is the sky blue on a clear day? A:"
        s += sgl.select("a", [" yes", " no", " purple"], choices_method=m)
        s += sgl.gen("b", choices=[" yes", " no", " purple"], choices_method=m)

    st = pick.run(m=method)
    assert st.error() is None and st["a"] == st["b"]
    scores = st.get_meta_info("a")["scores"]
    assert st["a"] == [" yes", " no", " purple"][scores.index(max(scores))]


def test_gen_logprobs_in_sglang_shape_match_transformers(default_backend, hf_model):
    @sgl.function
    def lp(s):
        s += "The capital of France is"
        s += sgl.gen("a", max_tokens=6, ignore_eos=True, return_logprob=True,
                     top_logprobs_num=3, return_text_in_logprobs=True, logprob_start_len=0)

    st = lp.run()
    meta, tok = st.get_meta_info("a"), default_backend.tokenizer
    out = meta["output_token_logprobs"]
    assert len(out) == meta["completion_tokens"] == 6
    prompt_ids = tok.encode("The capital of France is")
    ids = prompt_ids + [t for _, t, _ in out]
    with torch.inference_mode():
        logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    for i, (value, token, text) in enumerate(out):
        assert text == tok.decode([token])
        assert abs(value - float(logp[len(prompt_ids) - 1 + i, token])) < 1e-3
        top = meta["output_top_logprobs"][i]
        assert len(top) == 3 and top[0][1] == token  # greedy: the chosen one is the best
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == prompt_ids and inp[0][0] is None
    for j, (value, token, _) in enumerate(inp[1:], start=1):
        assert abs(value - float(logp[j - 1, token])) < 1e-3


def test_run_sampling_options_reach_every_gen_unless_a_gen_sets_its_own(default_backend):
    @sgl.function
    def count(s):
        s += "1, 2, 3, 4, 5,"
        s += sgl.gen("a", max_tokens=24)
        s += "\n1, 2, 3,"
        s += sgl.gen("b", max_tokens=24, stop=" 5")

    st = count.run(stop=",", ignore_eos=True, use_thread=True)
    assert st.error() is None
    assert st["a"] == default_backend.generate("1, 2, 3, 4, 5,", max_tokens=24, stop=",").text
    assert st["a"] == " 6" and st["b"] == " 4,"
    assert st.get_meta_info("b")["matched_stop"] == " 5"


def test_gen_penalties_and_min_tokens_reach_the_engine(default_backend):
    prompt = "Repeat after me: red blue red blue red blue red blue red blue"

    @sgl.function
    def loop(s):
        s += prompt
        s += sgl.gen("a", max_tokens=16, frequency_penalty=0.8, presence_penalty=0.4,
                     min_tokens=10, ignore_eos=True)

    st = loop.run()
    want = default_backend.generate(prompt, max_tokens=16, frequency_penalty=0.8,
                                    presence_penalty=0.4, min_tokens=10, ignore_eos=True)
    assert st["a"] == want.text
    assert want.text != default_backend.generate(prompt, max_tokens=16, ignore_eos=True).text


def test_separate_reasoning_splits_the_thinking_off(default_backend):
    @sgl.function
    def think(s):
        s += "Think, then answer. Is ice cold?\n"
        s += sgl.separate_reasoning(
            sgl.gen("a", regex=r"<think>[a-z ]{4,24}</think> (yes|no)", max_tokens=40),
            model_type="qwen3")

    st = think.run()
    assert st.error() is None
    assert st["a"] in ("yes", "no")
    assert st["a_reasoning_content"] and "<" not in st["a_reasoning_content"]
    assert f"<think>{st['a_reasoning_content']}" in st.text()  # the text keeps both
    assert split_reasoning("thought</think>answer", "deepseek-r1") == ("thought", "answer")
    assert split_reasoning("just an answer", "qwen3") == ("", "just an answer")
    assert split_reasoning("<think>cut off", "qwen3") == ("cut off", "")
    with pytest.raises(ValueError, match="unknown model_type 'nope'"):
        sgl.separate_reasoning(sgl.gen("x"), model_type="nope")


def test_what_a_text_only_engine_cannot_do_is_named(default_backend):
    @sgl.function
    def look(s):
        s += sgl.user(sgl.image("cat.png") + "What is this?")

    assert "sgl.image" in str(look.run().error())
    with pytest.raises(ValueError, match=r"s.fork\(2\)"):
        sgl.gen("x", n=2)
    with pytest.raises(TypeError, match="temprature"):
        markers.run_batch([{"q": "a"}], temprature=0.5)


def test_flush_cache_and_server_info_locally_and_over_http(default_backend):
    rt = default_backend
    prompt = "A long and particular sentence to be cached, about lighthouses and gulls."
    first = rt.generate(prompt, max_tokens=8, ignore_eos=True)
    assert rt.generate(prompt, max_tokens=1).meta["cached_tokens"] > 0
    assert sgl.flush_cache() > 0
    again = rt.generate(prompt, max_tokens=8, ignore_eos=True)
    assert again.meta["cached_tokens"] == 0 and again.token_ids == first.token_ids
    info = sgl.get_server_info()
    assert info["model_path"] == str(rt.model_path) and info["context_len"] > 0
    server = start_in_thread(rt)
    try:
        ep = sgl.RuntimeEndpoint(server.url, api="sglang")
        assert ep.get_server_info()["model_path"] == str(rt.model_path)
        rt.generate(prompt, max_tokens=1)
        sgl.flush_cache(ep)
        assert rt.generate(prompt, max_tokens=1).meta["cached_tokens"] == 0
        with pytest.raises(ValueError, match="api='sglang'"):
            sgl.RuntimeEndpoint(server.url, api="openai").flush_cache()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("api", ["openai", "sglang"])
def test_penalties_over_http_give_the_local_tokens(default_backend, api):
    server = start_in_thread(default_backend)
    try:
        ep = sgl.RuntimeEndpoint(server.url, api=api)
        kwargs = {"max_tokens": 12, "ignore_eos": True, "frequency_penalty": 0.7,
                  "presence_penalty": 0.3, "repetition_penalty": 1.2, "min_tokens": 4}
        prompt = "Repeat after me: red blue red blue red blue"
        remote = ep.generate(prompt, **kwargs)
        assert remote.token_ids == default_backend.generate(prompt, **kwargs).token_ids
    finally:
        server.shutdown()
        server.server_close()


def test_copy_get_var_set_var_as_sglang_spells_them(default_backend):
    @sgl.function
    def side(s):
        s += "Q: What is 1 + 1?\nA:"
        c = s.copy()  # a branch from here; s goes on by itself
        c += sgl.gen("x", max_tokens=4, stop="\n")
        s.set_var("from_copy", c.get_var("x"))
        s += sgl.gen("y", max_tokens=4, stop="\n")
        one = s.fork()  # fork's size defaults to 1, as in SGLang
        assert len(one) == 1

    st = side.run()
    assert st.error() is None
    assert st.get_var("from_copy") == st["y"]  # same text, greedy: the same answer
    assert st["y"] and "A:" + st["y"] in st.text()
    assert st.text().count("A:") == 1  # the copy's gen did not land in s


@pytest.mark.parametrize("api", ["openai", "sglang"])
def test_gen_logprobs_over_http_equal_the_local_ones(default_backend, api):
    @sgl.function
    def lp(s, top):
        s += "The capital of Italy is"
        s += sgl.gen("a", max_tokens=5, ignore_eos=True, return_logprob=True,
                     top_logprobs_num=top, logprob_start_len=1)

    server = start_in_thread(default_backend)
    try:
        ep = sgl.RuntimeEndpoint(server.url, api=api)
        top = 2 if api == "sglang" else 0
        got, want = lp.run(top=top, backend=ep), lp.run(top=top)
        assert got.error() is None, got.error()
        g, w = got.get_meta_info("a"), want.get_meta_info("a")
        for key in ("output_token_logprobs", "input_token_logprobs", "output_top_logprobs"):
            assert (key in g) == (key in w), key
            for a, b in zip(g.get(key, []), w.get(key, []), strict=True):
                pairs = zip(a, b) if key == "output_top_logprobs" else [(a, b)]
                for x, y in pairs:
                    assert x[1] == y[1] and (x[0] is None) == (y[0] is None)
                    assert x[0] is None or abs(x[0] - y[0]) < 1e-4
        if api == "openai":
            failed = lp.run(top=2, backend=ep).error()
            assert "api='sglang'" in str(failed) and "top_logprobs_num" in str(failed)
    finally:
        server.shutdown()
        server.server_close()


def test_global_config_and_token_usage(default_backend):
    """SGLang's test programs read sgl.global_config.default_backend.token_usage."""
    runtime = default_backend
    assert sgl.global_config.default_backend is runtime
    usage = sgl.global_config.default_backend.token_usage
    usage.reset()
    assert (usage.prompt_tokens, usage.completion_tokens) == (0, 0)
    out = runtime.generate("The capital of France is", max_tokens=5, ignore_eos=True)
    assert usage.prompt_tokens == out.meta["prompt_tokens"] and usage.completion_tokens == 5

    @sgl.function(num_api_spec_tokens=64)  # accepted; a no-op on the in-kernel engine
    def character(s):
        s += "Name:" + sgl.gen("name", max_tokens=4, stop="\n")

    usage.reset()
    st = character.run()
    assert st.error() is None
    assert usage.completion_tokens == st.get_meta_info("name")["completion_tokens"]
