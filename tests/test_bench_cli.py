"""`sgl-nb bench NAME`: each bench its own subcommand with its own flags (no model loaded)."""

from __future__ import annotations

import argparse
import importlib

import pytest
from support.ports import free_port

from sgl_nb.bench import BENCHES
from sgl_nb.cli import main

# Every bench's flags and their defaults: those of the one shared parser these subcommands
# replaced, but that the remote bench takes a running server's URL (it started vLLM itself
# from --vllm-python) and the tracing bench a running Phoenix's.
DEFAULTS = {
    "engine": {"model": None, "new_tokens": 256, "requests": 16, "prefix_tokens": 400,
               "shared_new_tokens": 32, "dtype": [], "quantization": [], "repeat": 2,
               "llamacpp_venv": ".venv-llamacpp", "json": None},
    "programs": {"model": None, "questions": 32, "fork_tokens": 64, "json_items": 4,
                 "sessions": 8, "turns": 4, "chat_tokens": 24, "json": None},
    "remote": {"model": None, "new_tokens": 256, "requests": 16, "prefix_tokens": 400,
               "shared_new_tokens": 32, "questions": 32, "fork_tokens": 64, "json_items": 4,
               "sessions": 8, "turns": 4, "chat_tokens": 24, "server": "http://x:1",
               "json": None},
    "scheduler": {"model": None, "batch_jobs": 8, "batch_tokens": 128,
                  "interactive_tokens": 32, "time_slice": 8, "programs": 32,
                  "program_tokens": 64, "json": None},
    "tracing": {"model": None, "questions": 32, "rounds": 3, "phoenix": None, "json": None},
    "cancel": {"model": None, "rounds": 3, "cancel_tokens": 3000},
    "batch": {"model": None, "programs": 1000, "num_threads": 8, "baseline_items": 50,
              "json": None},
    "views": {"model": None, "tokens": [250, 1000, 4000], "timeout": 1800.0, "json": None},
    "models": {"families": ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma2",
                            "gemma3", "phi3", "olmo2", "granite", "smollm3"],
               "new_tokens": 32, "repeat": 1, "no_general_path": False, "json": None},
    "gguf": {"model": None, "new_tokens": 128, "repeat": 6, "json": None},
    "copy": {"model": None, "dtype": "float32", "quantization": None, "hf_lookup_tokens": 10,
             "max_tokens": None, "repeat": 3, "json": None},
    "ahead": {"model": None, "quantization": "int4", "values": None, "new_tokens": 256,
              "requests": 8, "prefix_tokens": 400, "batch_tokens": 64, "repeat": 4,
              "json": None},
    "peers": {"files": ["Q4_0", "Q4_1", "Q8_0", "F32"], "new_tokens": 128, "repeat": 4,
              "llamacpp_venv": ".venv-llamacpp", "copy": False, "llama_lookup_tokens": 10,
              "json": None},
    "serve": {"model": None, "clients": 32, "duration": 180.0, "disconnect_fraction": 1 / 3,
              "warmup": 30.0, "rss_growth_mb": 64.0, "seed": 0, "kv_pool_tokens": None,
              "vllm_bench": None, "vllm_server": None, "rounds": 2, "input_len": 256,
              "output_len": 64, "num_prompts": 64, "max_concurrency": 8, "json": None},
}
REQUIRED = {"remote": ["--server", "http://x:1"]}


def parsed(monkeypatch, name: str, *flags: str) -> dict:
    """The flags `sgl-nb bench NAME ...` hands to the bench's run()."""
    got = {}
    monkeypatch.setattr(importlib.import_module(f"sgl_nb.bench.{name}"), "run",
                        lambda args: got.update(vars(args)) or 0)
    assert main(["bench", name, *REQUIRED.get(name, []), *flags]) == 0
    return {k: v for k, v in got.items() if k not in ("command", "bench", "func")}


def test_bench_help_lists_every_bench(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert set(BENCHES) == set(DEFAULTS)
    for name in BENCHES:
        assert f"    {name}" in out


@pytest.mark.parametrize("name", list(DEFAULTS))
def test_each_bench_has_its_own_flags_and_defaults(monkeypatch, name):
    assert parsed(monkeypatch, name) == DEFAULTS[name]


def test_bench_help_lists_only_its_flags(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "engine", "--help"])
    out = capsys.readouterr().out
    assert "--dtype" in out and "--repeat" in out
    assert "--questions" not in out and "--batch-jobs" not in out


def test_a_flag_of_another_bench_is_an_error_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "engine", "--questions", "4"])
    assert e.value.code == 2
    assert "sgl-nb bench engine: error: unrecognized arguments: --questions" in \
        capsys.readouterr().err


def test_flags_reach_the_bench(monkeypatch):
    got = parsed(monkeypatch, "engine", "--dtype", "bfloat16", "--repeat", "1")
    assert got["dtype"] == ["bfloat16"] and got["repeat"] == 1


def test_remote_needs_a_server(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "remote"])
    assert e.value.code == 2
    assert "--server" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["remote", "--server"], "no OpenAI-compatible server answers at"),
    (["tracing", "--phoenix"], "--phoenix: no Phoenix answers at"),
])
def test_a_server_that_does_not_answer_fails_before_the_model_loads(argv, says):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv, url])
    assert str(e.value.code).startswith(says) and "make bench-" in str(e.value.code)


@pytest.mark.parametrize("argv, says", [
    (["copy", "--repeat", "0"], "--repeat must be at least 1"),
    (["copy", "--hf-lookup-tokens", "0"], "--hf-lookup-tokens must be at least 1"),
    (["copy", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["peers", "--new-tokens", "1"], "--new-tokens at least 2"),
    (["peers", "--llama-lookup-tokens", "0"], "--llama-lookup-tokens must be at least 1"),
])
def test_copy_and_peers_refuse_bad_numbers_before_loading(argv, says):
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert says in str(e.value.code)


@pytest.mark.slow
def test_the_ahead_bench_checks_its_tokens_and_gives_ratios(model_path, tmp_path):
    import json

    out = tmp_path / "ahead.json"
    assert main(["bench", "ahead", "--model", str(model_path), "--values", "1", "4",
                 "--new-tokens", "24", "--requests", "2", "--batch-tokens", "8",
                 "--repeat", "1", "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["same_tokens"] is True
    assert set(s["ratios"]) == {"one stream, 4 / 1", "batch, 4 / 1"}
    assert all(r["best"] > 0 for r in s["tok_s"].values())


def test_peers_without_llamacpp_venv_says_how_to_build_it(tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["bench", "peers", "--llamacpp-venv", str(tmp_path / "none")])
    assert "make llamacpp" in str(e.value.code) and "none/bin/python" in str(e.value.code)


def test_engine_without_llamacpp_says_how_to_build_it(tmp_path, capsys):
    """Without llama-cpp-python here or in --llamacpp-venv, the engine bench goes on without
    llama.cpp and says where it looked and how to build it."""
    from sgl_nb.bench.engine import llama_cpp_bench

    args = argparse.Namespace(llamacpp_venv=str(tmp_path / "none"), new_tokens=4,
                              shared_new_tokens=2)
    assert llama_cpp_bench(args, [1, 2, 3], [[1, 2]]) is None
    said = capsys.readouterr().out
    assert "make llamacpp" in said and "none/bin/python" in said


def test_peers_gguf_variant_keeps_the_files_metadata_and_values(tmp_path):
    """A Q8_0 file written from a Q4_1 one: same keys (tokenizer included), same tensors,
    every quantized weight Q8_0 (the embedding too) within Q8_0's rounding of the Q4_1
    values, norms untouched."""
    from gguf import GGMLQuantizationType, quants
    from support.tiny_checkpoint import tiny_checkpoint, tiny_config
    from support.tiny_gguf import write_gguf

    from sgl_nb.bench.peers_gguf import write_variant
    from sgl_nb.runtime.model.gguf_reading import FastGGUFReader as GGUFReader

    source = tmp_path / "tiny.Q4_1.gguf"
    write_gguf(tiny_checkpoint(tiny_config("llama"), tmp_path / "llama"), source, "Q4_1")
    write_variant(source, tmp_path / "tiny.Q8_0.gguf", "Q8_0")
    a, b = GGUFReader(source), GGUFReader(tmp_path / "tiny.Q8_0.gguf")
    assert set(a.fields) | {"general.file_type"} == set(b.fields)
    assert b.fields["general.file_type"].contents() == 7
    for key in ("tokenizer.ggml.tokens", "llama.block_count"):
        assert a.fields[key].contents() == b.fields[key].contents()
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        va = quants.dequantize(ta.data, ta.tensor_type)
        vb = quants.dequantize(tb.data, tb.tensor_type)
        if ta.tensor_type == GGMLQuantizationType.F32:
            assert tb.tensor_type == GGMLQuantizationType.F32 and (va == vb).all()
        else:
            assert tb.tensor_type == GGMLQuantizationType.Q8_0
            # Half a Q8_0 step per block, and its fp16 scale's rounding (127 x 2^-11 steps)
            step = abs(va).reshape(-1, 32).max(axis=1) / 127
            assert (abs(va - vb).reshape(-1, 32) <= step[:, None] * 0.6 + 1e-6).all()


@pytest.mark.slow
def test_the_batch_bench_samples_threads_and_memory(model_path, tmp_path):
    import json

    out = tmp_path / "batch.json"
    assert main(["bench", "batch", "--model", str(model_path), "--programs", "40",
                 "--num-threads", "4", "--baseline-items", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == ["run() one at a time, 3",
                                         "run_batch of 40, num_threads=auto",
                                         "run_batch of 40, num_threads=4"]
    assert all(r["seconds"] > 0 and r["peak_rss_mb"] > 0 for r in rows)
    assert rows[2]["peak_threads"] >= 1 and rows[2]["failed"] == 0
    # The body pool's 4 threads at most, above what ran before the batch.
    assert rows[2]["peak_threads"] <= rows[2]["threads_before"] + 4


def test_the_engine_bench_gives_the_rate_its_matmuls_read_weights_at(capsys):
    """The floor table's 'matmul GB/s': a step's weight bytes over its matmul phases only
    (attention and the rest left out), so a kernel slower than memory shows as a rate
    under 'read GB/s'; '-' where the step has no phases (not the fused CPU step)."""
    from sgl_nb.bench.engine import matmul_read_rate, print_bandwidth_floor

    phases = {"qkv matmul": 1.0, "attention": 3.0, "gate_up matmul": 2.0,
              "lm head matmul": 1.0, "engine around the forward (python)": 1.0}
    m = {"weight_bytes_per_token": 40e6, "read_gb_s": 20.0, "bandwidth_floor_tok_s": 285.7,
         "one_stream_tok_s": 100.0, "fraction_of_floor": 0.35, "decode_step_ms": 8.0,
         "decode_breakdown_ms": phases}
    assert matmul_read_rate(40e6, phases) == pytest.approx(10.0)  # 40 MB, 4 ms of matmuls
    bare = {**m, "decode_breakdown_ms": {}}
    assert matmul_read_rate(40e6, {}) is None
    print_bandwidth_floor({"int4": m, "cuda": bare})
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith(("int4", "cuda"))}
    assert rows["int4"][-1] == "10.0" and rows["cuda"][-1] == "-"
