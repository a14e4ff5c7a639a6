"""Loading checkpoints: the errors name the file, field or tensor; sharded safetensors load as
the unsharded ones; a GGUF file (F32, F16, Q8_0, Q4_K) of a native family gives the tokens its
weights give from safetensors; the chat template and the stop ids come from the folder's
files; a context longer than the KV pool is capped by it, with a warning naming both.
Tiny random-weight checkpoints built here: no download."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import link_entries
from support.tiny_checkpoint import TOKENIZER_FILES, tiny_checkpoint, tiny_config
from support.tiny_gguf import write_gguf

from sgl_nb.runtime.model.checkpoint import (
    CheckpointError,
    MissingTensorError,
    check_shapes,
    read_config,
    read_weights,
)
from sgl_nb.runtime.model.model import Model
from sgl_nb.runtime.model.model_config import ModelConfig
from sgl_nb.runtime.model.model_loader import (
    ModelNotFoundError,
    cache_dir,
    resolve_model_path,
)

PROMPTS = ["Hello there, how are", "A list of fruits: apple,", "x = 1\ny ="]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return tiny_checkpoint(tiny_config("llama"), tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """GGUF conversions and quantized weights go to the test's folder, not the user's cache;
    the default model and the built kernels are still found where they are."""
    default, real = resolve_model_path(progress=False), cache_dir()
    monkeypatch.setenv("SGL_NB_CACHE", str(tmp_path / "cache"))
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    (models / default.name).symlink_to(default)
    link_entries(real, tmp_path / "cache", "ext", "kernel_checks")


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def greedy(folder: Path | str, n: int = 16, ids: list[list[int]] | None = None
           ) -> list[list[int]]:
    """Greedy tokens of PROMPTS (or of token ids `ids`) on `folder`'s model."""
    from sgl_nb import Runtime

    with Runtime(folder, kv_pool_tokens=2048) as rt:
        ids = ids or [rt.tokenizer.encode(p) for p in PROMPTS]
        return [o.token_ids for o in rt.generate(ids, max_tokens=n, ignore_eos=True)]


# ---- errors naming the file, the field, the tensor ---------------------------------------------


def test_missing_config_and_weights_are_named(tiny_llama, tmp_path):
    no_config = copy_checkpoint(tiny_llama, tmp_path / "no-config")
    (no_config / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match=f"{no_config / 'config.json'} is missing"):
        resolve_model_path(no_config)
    no_weights = copy_checkpoint(tiny_llama, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match=f"no \\*.safetensors or \\*.gguf in {no_weights}"):
        resolve_model_path(no_weights)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors or \\*.gguf"):
        read_weights(no_weights)


@pytest.mark.parametrize("change, named", [
    ({"model_type": None, "architectures": None}, "neither 'model_type' nor 'architectures'"),
    ({"model_type": "no_such_model"}, "model_type 'no_such_model' is unknown to transformers"),
    ({"model_type": None, "architectures": ["NoSuchForCausalLM"]},
     "architectures \\['NoSuchForCausalLM'\\] name no class"),
    ({"architectures": "LlamaForCausalLM"}, "'architectures' must be a list"),
])
def test_unknown_or_missing_model_type_names_field_and_file(tiny_llama, tmp_path, change, named):
    folder = copy_checkpoint(tiny_llama, tmp_path / "bad")
    config = json.loads((folder / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"{folder / 'config.json'}: .*{named}"):
        read_config(folder)
    from sgl_nb import Runtime

    with pytest.raises(CheckpointError, match=named):
        Runtime(folder)


def test_architectures_derived_from_model_type(tiny_llama, tmp_path):
    folder = copy_checkpoint(tiny_llama, tmp_path / "no-arch")
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    assert read_config(folder)["architectures"] == ["LlamaForCausalLM"]
    # A class transformers lacks (an early conversion's spelling): model_type's, said so.
    config["architectures"] = ["LLaMAForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="\\['LLaMAForCausalLM'\\] name no class .* "
                                         "'llama' gives LlamaForCausalLM"):
        assert read_config(folder)["architectures"] == ["LlamaForCausalLM"]
    (folder / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match=f"{folder / 'config.json'} is not valid JSON"):
        read_config(folder)


def test_wrong_shape_names_tensor_and_shapes(tiny_llama, tmp_path):
    folder = copy_checkpoint(tiny_llama, tmp_path / "bad-shape")
    weights = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    assert tuple(weights[name].shape) == (128, 128)  # 2 KV heads of 64 over hidden 128
    weights[name] = weights[name][:64].contiguous()
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError,
                       match=f"tensor '{name}' in {folder} has shape \\(64, 128\\), but "
                             "config.json's numbers give \\(128, 128\\)"):
        Model.load(folder)


def test_missing_tensor_is_named(tiny_llama, tmp_path):
    folder = copy_checkpoint(tiny_llama, tmp_path / "no-tensor")
    weights = load_file(str(folder / "model.safetensors"))
    name = "model.layers.2.mlp.down_proj.weight"
    del weights[name]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(MissingTensorError, match=f"tensor '{name}' is missing from {folder}"):
        Model.load(folder)
    expected = {name: (128, 256), "model.norm.weight": (128,)}
    with pytest.raises(MissingTensorError, match=f"'{name}' is missing from there"):
        check_shapes(expected, weights, "there")


# ---- sharded safetensors ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory, tiny_llama) -> Path:
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("sharded") / "llama"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    model.save_pretrained(folder, max_shard_size="4MB")
    for name in TOKENIZER_FILES:
        if (tiny_llama / name).is_file():
            shutil.copy(tiny_llama / name, folder / name)
    return folder


def test_sharded_loads_as_unsharded(tiny_llama, sharded_llama):
    shards = sorted(sharded_llama.glob("*.safetensors"))
    assert len(shards) > 2 and (sharded_llama / "model.safetensors.index.json").is_file()
    whole, parts = read_weights(tiny_llama), read_weights(sharded_llama)
    assert sorted(whole) == sorted(parts)
    assert all(torch.equal(whole[k], parts[k]) for k in whole)
    assert greedy(sharded_llama) == greedy(tiny_llama)


def test_missing_shard_is_named(sharded_llama, tmp_path):
    folder = copy_checkpoint(sharded_llama, tmp_path / "missing-shard")
    shard = sorted(folder.glob("*.safetensors"))[1]
    shard.unlink()
    index = folder / "model.safetensors.index.json"
    with pytest.raises(FileNotFoundError, match=f"{index} names 1 shard\\(s\\) missing from "
                                                f"{folder}: {shard.name}"):
        read_weights(folder)
    # A shard that lacks a tensor the index puts in it.
    folder = copy_checkpoint(sharded_llama, tmp_path / "short-shard")
    shard = sorted(folder.glob("*.safetensors"))[0]
    tensors = load_file(str(shard))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"puts tensor '{dropped}' in {shard.name}"):
        read_weights(folder)


# ---- GGUF ------------------------------------------------------------------------------------


def reference_folder(source: Path, weights: dict[str, torch.Tensor], folder: Path) -> Path:
    """`source`'s config and tokenizer with `weights`: what a GGUF should load as."""
    from transformers import AutoConfig

    folder.mkdir()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    # Every value written, as the GGUF's conversion writes them: save_pretrained leaves out
    # those equal to the config class's defaults (Gemma 2's query_pre_attn_scalar of 256).
    config = AutoConfig.from_pretrained(source).to_dict()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder


# Each tensor type once at least (F32, F16, Q8_0, Q4_K), each family's GGUF keys once.
@pytest.mark.parametrize("family, qtype, overrides", [
    ("llama", "Q4_K", {"hidden_size": 256, "intermediate_size": 512}),
    # GGUF's qwen2 has no head_dim key: transformers takes hidden_size / heads; for
    # qwen3 and phi3 Qwen3Config's default head_dim (128) and hidden_size / heads.
    ("qwen2", "Q8_0", {"hidden_size": 256}),
    ("qwen3", "F16", {"head_dim": 128}),
    ("phi3", "Q8_0", {"hidden_size": 256}),
    # Gemma 2's soft-caps and Llama 3's rope scaling (rope_freqs) are read by checkpoint.py,
    # not by transformers; query_pre_attn_scalar is in no GGUF key: its default (256).
    ("gemma2", "F32", {"query_pre_attn_scalar": 256}),
    ("llama3", "Q8_0", {}),
])
def test_gguf_gives_the_tokens_of_its_weights(tmp_path, family, qtype, overrides):
    # GGUF keeps rms_norm_eps as a float32: one that float32 holds exactly keeps the two
    # loads bit for bit the same (Gemma 2's final soft-cap of 4 leaves near-ties greedy
    # choice would break on a 1e-6 vs 9.99999997e-7 difference).
    overrides = {"rms_norm_eps": 2.0**-20, **overrides}
    source = tiny_checkpoint(tiny_config(family, **overrides), tmp_path / family)
    gguf = tmp_path / "gguf" / f"tiny-{family}.{qtype}.gguf"
    gguf.parent.mkdir()
    decoded = write_gguf(source, gguf, qtype)
    want = reference_folder(source, decoded, tmp_path / "reference")
    # A folder holding the .gguf loads as the file does.
    path = gguf.parent if family == "qwen2" else gguf
    converted = resolve_model_path(path, progress=False)
    loaded = read_weights(converted)
    assert sorted(loaded) == sorted(decoded)
    for name, tensor in decoded.items():
        assert torch.equal(loaded[name].float(), tensor.float()), name  # exactly its values
    if qtype == "F16":  # kept 16-bit, not widened
        assert loaded["model.layers.0.mlp.down_proj.weight"].dtype == torch.float16
    from transformers import AutoConfig, AutoTokenizer

    # The numbers the weights need come through (the rope scaling and soft-caps too).
    src, got = AutoConfig.from_pretrained(source), AutoConfig.from_pretrained(converted)
    def head_dim(c):  # Phi-3's config has none: hidden_size / heads
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    assert head_dim(got) == head_dim(src)
    for key in ("model_type", "num_hidden_layers", "rope_parameters",
                "sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
                "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(got, key, None) == getattr(src, key, None), key
    from sgl_nb import Runtime

    reference_tokenizer = AutoTokenizer.from_pretrained(str(source))
    ids = [reference_tokenizer.encode(p) for p in PROMPTS]
    with Runtime(path, kv_pool_tokens=2048) as rt:
        got = [o.token_ids for o in rt.generate(ids, max_tokens=16, ignore_eos=True)]
        # The GGUF's tokenizer (and chat template) is the default model's, as written; but
        # transformers builds a Gemma GGUF's tokenizer as Gemma's, whatever the file holds.
        if family != "gemma2":
            assert [rt.tokenizer.encode(p) for p in PROMPTS] == ids
        assert rt.tokenizer.chat_template == reference_tokenizer.chat_template
    assert got == greedy(want, ids=ids)


def test_gguf_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match=f"{bad}: cannot read it as a GGUF model"):
        resolve_model_path(bad, progress=False)
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"x")
    (two / "b.gguf").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="holds 2 .gguf files \\(a.gguf, b.gguf\\)"):
        resolve_model_path(two, progress=False)


# ---- chat template and stop ids from the files -------------------------------------------------

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}<</{{ m['role'] }}>>\n"
            "{% endfor %}{% if add_generation_prompt %}<<assistant>>{% endif %}")


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_chat_template_comes_from_the_folder(tiny_llama, tmp_path, where):
    import sgl_nb as sgl

    folder = copy_checkpoint(tiny_llama, tmp_path / "templated")
    jinja = folder / "chat_template.jinja"
    if where == "chat_template.jinja":
        jinja.write_text(TEMPLATE)
    else:  # the older place: a key of tokenizer_config.json
        jinja.unlink()
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = TEMPLATE
        (folder / "tokenizer_config.json").write_text(json.dumps(config))

    @sgl.function
    def chat(s):
        s += sgl.user("Hi")
        s += sgl.assistant(sgl.gen("answer", max_tokens=3))

    with sgl.Runtime(folder, kv_pool_tokens=1024) as rt:
        assert rt.apply_chat_template([{"role": "user", "content": "Hi"}]) == \
            "<<user>>Hi<</user>>\n<<assistant>>"
        state = chat.run(backend=rt)
        assert state.text().startswith("<<user>>Hi<</user>>\n<<assistant>>")
        assert state.text().endswith("<</assistant>>\n")


def test_eos_ids_come_from_generation_config(tiny_llama, tmp_path):
    from sgl_nb import Runtime

    first = greedy(tiny_llama, n=4)[0]
    stop = first[2]  # the third greedy token, made a stop id by generation_config.json alone
    folder = copy_checkpoint(tiny_llama, tmp_path / "eos")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop]}))
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == 2
    assert ModelConfig.from_folder(folder).eos_token_ids == (2, stop)
    with Runtime(folder, kv_pool_tokens=1024) as rt:
        assert stop in rt.engine.eos_ids
        out = rt.generate(rt.tokenizer.encode(PROMPTS[0]), max_tokens=16)
    assert out.token_ids == first[:first.index(stop) + 1]
    assert out.meta["finish_reason"] == "stop" and out.meta["matched_stop"] == stop


# ---- the context capped by the KV pool ---------------------------------------------------------


def test_context_longer_than_the_pool_is_capped_with_a_warning(tiny_llama):
    from sgl_nb import Runtime

    assert json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"] == 1024
    with pytest.warns(UserWarning, match="context \\(1024 tokens.*KV pool \\(300 tokens\\).*"
                                         "capped at 300"):
        rt = Runtime(tiny_llama, kv_pool_tokens=300)
    with rt:
        assert rt.engine.context_len == 300
        assert rt.get_server_info()["context_length"] == 300
        with pytest.raises(ValueError, match="prompt is 310 tokens, longer than the model's "
                                             "context of 300.*never fit the KV pool of 300"):
            rt.generate([5] * 310, max_tokens=2)
        assert len(rt.generate([5] * 290, max_tokens=4, ignore_eos=True).token_ids) == 4
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a pool that holds the whole context: no warning
        with Runtime(tiny_llama, kv_pool_tokens=1024) as big:
            assert big.engine.context_len == 1024


# ---- %sgl_model PATH -------------------------------------------------------------------------


def test_sgl_model_magic_loads_a_gguf_path(ipython_shell, capsys, tiny_llama, tmp_path):
    import sgl_nb as sgl
    from sgl_nb.language.function import current_backend

    gguf = tmp_path / "a folder" / "tiny llama.gguf"  # spaces: the path is quoted
    gguf.parent.mkdir()
    decoded = write_gguf(tiny_llama, gguf, "F16")
    want = greedy(reference_folder(tiny_llama, decoded, tmp_path / "reference"), n=8)[0]

    @sgl.function
    def complete(s):
        s += PROMPTS[0] + sgl.gen("more", max_tokens=8, ignore_eos=True)

    magics = ipython_shell.magics_manager.registry["SglMagics"]
    before, owned = current_backend(), magics.owned_runtime
    try:
        ipython_shell.run_line_magic("sgl_model", f'"{gguf}"')
        rt = sgl.get_default_backend()
        assert rt is not before and rt.engine.config.num_layers == 3
        assert f"model: {rt.model_path}" in capsys.readouterr().out
        state = complete.run()
        assert state.text() == PROMPTS[0] + rt.tokenizer.decode(want)  # the GGUF's weights
    finally:
        sgl.set_default_backend(before)
        if magics.owned_runtime is not owned:
            magics.release_owned_runtime()
