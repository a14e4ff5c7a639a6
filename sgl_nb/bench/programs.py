"""`sgl-nb bench programs`: SGLang-paper-style workloads, our programs against transformers.

The transformers side is written as a notebook user would: prompts rebuilt and `generate`
(or a forward pass, for a select) called for each step; JSON through xgrammar's logits
processor. Both sides use the same weights in fp32, greedy. Reports end-to-end ratios.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from sgl_nb.bench import add_json_argument, add_model_argument

SHOTS = [
    ("Is a whale a mammal?", "yes"), ("Is the sun a planet?", "no"),
    ("Can penguins fly?", "no"), ("Is water wet?", "yes"), ("Is ice hot?", "no"),
]
QUESTIONS = [
    "Is a tomato a fruit?", "Is the moon made of cheese?", "Do fish live in water?",
    "Is fire cold?", "Can dogs bark?", "Is Paris in France?", "Do cats have wings?",
    "Is snow white?", "Is the sea salty?", "Can rocks swim?", "Is gold a metal?",
    "Do trees have roots?",
]
QUESTIONS = [f"{q} (case {i})" if i else q for i in range(3) for q in QUESTIONS]
CITY_REGEX = (r'\{"name": "[A-Za-z ]{1,20}", "country": "[A-Za-z ]{1,20}", '
              r'"population": [0-9]{1,8}\}')


def few_shot_prefix() -> str:
    return "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in SHOTS)


def few_shot_program():
    """The few-shot workload's program (also what `bench tracing` runs)."""
    import sgl_nb as sgl

    @sgl.function
    def few_shot(s, question):
        s += few_shot_prefix() + f"Question: {question}\nAnswer:"
        s += sgl.select("answer", [" yes", " no"])

    return few_shot


def json_program():
    """The JSON workload's program: a regex with literal runs between the free fields, so
    jump-forward has the keys and punctuation to skip."""
    import sgl_nb as sgl

    @sgl.function
    def city_json(s, city):
        s += f"Describe {city} as JSON: "
        s += sgl.gen("json", regex=CITY_REGEX, max_tokens=64)

    return city_json


def run_json(args: argparse.Namespace, **options) -> tuple[float, list[str]]:
    """The JSON workload on the default backend: seconds, and the objects generated."""
    cities = ["Paris", "Tokyo", "Cairo", "Lima"][: args.json_items]
    t0 = time.perf_counter()
    states = json_program().run_batch([{"city": c} for c in cities], **options)
    return time.perf_counter() - t0, [st["json"] for st in states]


def jump_forward_figures(args: argparse.Namespace, rt) -> dict:
    """The JSON workload with jump-forward off, then on (each from an empty cache): seconds,
    engine steps, tokens jumped and decode steps saved, and whether the outputs agree."""
    out = {}
    for name, on in (("off", False), ("on", True)):
        rt.flush_cache()
        before = rt.metrics()
        seconds, texts = run_json(args, jump_forward=on)
        after = rt.metrics()
        steps = {k: after["steps"][k] - before["steps"][k] for k in after["steps"]}
        out[name] = {"s": seconds, "texts": texts, "steps": steps, **{
            k: after[k] - before[k] for k in ("generated_tokens", "forced_tokens",
                                              "jump_forward_tokens",
                                              "jump_forward_steps_saved")}}
    out["same_outputs"] = out["on"]["texts"] == out["off"]["texts"]
    return out


def run_ours(args: argparse.Namespace, rt, json_workload: bool = True) -> dict:
    import sgl_nb as sgl

    sgl.set_default_backend(rt)
    few_shot = few_shot_program()

    @sgl.function
    def fork_judge(s, topic):
        s += f"Write about {topic}.\n"
        forks = s.fork(4)
        forks += lambda i: f"Draft {i + 1}:"
        forks += sgl.gen("draft", max_tokens=args.fork_tokens, ignore_eos=True)
        forks.join()
        s += "The best draft is number"
        s += sgl.select("best", [" 1", " 2", " 3", " 4"])

    @sgl.function
    def chat(s, turns):
        for t in turns:
            s += sgl.user(t)
            s += sgl.assistant(sgl.gen(None, max_tokens=args.chat_tokens, ignore_eos=True))

    out = {}
    qs = QUESTIONS[: args.questions]
    out["few_shot"] = _timed(lambda: few_shot.run_batch([{"question": q} for q in qs]))
    out["fork"] = _timed(lambda: [fork_judge.run(topic=t) for t in ("rain", "bread")])
    if json_workload:
        out["json"] = run_json(args)[0]
    sessions = [{"turns": [f"Session {i}, turn {j}: tell me something about number {i + j}."
                           for j in range(args.turns)]} for i in range(args.sessions)]
    out["chat"] = _timed(lambda: chat.run_batch(sessions))
    return out


def run_hf(args: argparse.Namespace, hf, tok) -> dict:
    def generate(text: str, n: int, processors=None) -> str:
        ids = torch.tensor([tok.encode(text)])
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=n, do_sample=False,
                              logits_processor=processors, pad_token_id=tok.eos_token_id)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    def select(text: str, choices: list[str]) -> str:
        pre = tok.encode(text)
        scores = []
        for c in choices:
            ids = pre + tok.encode(c)
            with torch.inference_mode():
                lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
            toks = range(len(pre), len(ids))
            scores.append(sum(lp[p - 1, ids[p]].item() for p in toks) / len(toks))
        return choices[max(range(len(choices)), key=scores.__getitem__)]

    def few_shot() -> None:
        for q in QUESTIONS[: args.questions]:
            select(few_shot_prefix() + f"Question: {q}\nAnswer:", [" yes", " no"])

    def fork() -> None:
        for topic in ("rain", "bread"):
            base = f"Write about {topic}.\n"
            drafts = [generate(base + f"Draft {i + 1}:", args.fork_tokens) for i in range(4)]
            select(base + "".join(f"Draft {i + 1}:{d}" for i, d in enumerate(drafts))
                   + "The best draft is number", [" 1", " 2", " 3", " 4"])

    def json_decode() -> None:
        import xgrammar as xgr
        from xgrammar.contrib.hf import LogitsProcessor

        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size)
        grammar = xgr.GrammarCompiler(info).compile_regex(CITY_REGEX)
        for c in ["Paris", "Tokyo", "Cairo", "Lima"][: args.json_items]:
            generate(f"Describe {c} as JSON: ", 64, [LogitsProcessor(grammar)])

    def chat() -> None:
        for i in range(args.sessions):
            messages = []
            for j in range(args.turns):
                messages.append({"role": "user", "content":
                                 f"Session {i}, turn {j}: tell me something about number "
                                 f"{i + j}."})
                prompt = tok.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
                messages.append({"role": "assistant",
                                 "content": generate(prompt, args.chat_tokens)})

    return {"few_shot": _timed(few_shot), "fork": _timed(fork), "json": _timed(json_decode),
            "chat": _timed(chat)}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The four workloads' sizes (the remote bench runs them too)."""
    parser.add_argument("--questions", type=int, default=32, help="few-shot questions")
    parser.add_argument("--fork-tokens", type=int, default=64, help="tokens per fork branch")
    parser.add_argument("--json-items", type=int, default=4, help="JSON objects")
    parser.add_argument("--sessions", type=int, default=8, help="chat sessions")
    parser.add_argument("--turns", type=int, default=4, help="turns per chat session")
    parser.add_argument("--chat-tokens", type=int, default=24, help="tokens per chat reply")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    add_workload_arguments(parser)
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    from sgl_nb import Runtime

    print("loading our engine ...", flush=True)
    rt = Runtime(args.model)
    rt.generate("warm up", max_tokens=2)
    print("ours ...", flush=True)
    ours = run_ours(args, rt, json_workload=False)
    jump = jump_forward_figures(args, rt)
    ours["json"], ours["json_no_jump"] = jump["on"]["s"], jump["off"]["s"]
    # Loaded after ours ran: OpenMP work on this thread slows the engine thread's own
    # (see runtime.engine.off_main_thread), which would understate our side.
    print("transformers (same weights, fp32) ...", flush=True)
    hf = AutoModelForCausalLM.from_pretrained(str(rt.model_path), dtype=torch.float32).eval()
    theirs = run_hf(args, hf, rt.tokenizer)
    rt.shutdown()
    theirs["json_no_jump"] = theirs["json"]
    targets = {"few_shot": 5.0, "fork": 2.0, "json": 2.0, "json_no_jump": 2.0, "chat": 5.0}
    names = {
        "few_shot": f"few-shot: 5-shot prefix, {args.questions} questions, select",
        "fork": f"fork: 4 branches x {args.fork_tokens} tokens, judging select (x2)",
        "json": f"JSON by regex, {args.json_items} objects",
        "json_no_jump": f"JSON by regex, {args.json_items} objects, jump_forward=False",
        "chat": f"multi-turn chat: {args.sessions} sessions x {args.turns} turns",
    }
    print(f"\n{'workload (seconds end to end)':<56}{'ours':>8}{'HF':>9}{'ratio':>8}{'target':>8}")
    rows = {}
    for k in targets:
        ratio = theirs[k] / ours[k]
        rows[k] = {"ours_s": ours[k], "hf_s": theirs[k], "ratio": ratio}
        print(f"{names[k]:<56}{ours[k]:>8.2f}{theirs[k]:>9.2f}{ratio:>7.2f}x"
              f"{'>=' + format(targets[k], 'g') + 'x':>8}")
    print_jump_forward(jump)
    if args.json:
        rows["json_jump_forward"] = {k: jump[k] for k in ("on", "off", "same_outputs")}
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def print_jump_forward(jump: dict) -> None:
    on, off = jump["on"], jump["off"]
    print(f"\nJSON workload, jump-forward on / off: {on['s']:.2f} / {off['s']:.2f} s "
          f"({off['s'] / on['s']:.2f}x); engine steps {sum(on['steps'].values())} / "
          f"{sum(off['steps'].values())} (extend {on['steps']['extend']} / "
          f"{off['steps']['extend']}, decode {on['steps']['decode']} / "
          f"{off['steps']['decode']}); {on['generated_tokens']} tokens, "
          f"{on['jump_forward_tokens']} jumped, {on['jump_forward_steps_saved']} decode steps "
          f"saved; outputs {'identical' if jump['same_outputs'] else 'DIFFERENT'}")
