"""Which runner a checkpoint takes: our native model (model.Model) for the families it
implements, transformers' modeling code with our paged attention (TransformersModel) for any
other decoder-only causal LM the installed transformers knows, else a ValueError saying why.

SGL_NB_MODEL_RUNNER=native|transformers|auto (or load_model's `runner`) forces one path:
`transformers` runs a native family through transformers too (to compare the two, e.g. in
`sgl-nb bench models`); `native` refuses what the native runner does not implement.
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path

import torch

from sgl_nb.runtime.model.checkpoint import read_config
from sgl_nb.runtime.model.transformers_model import (
    TransformersModel,
    attention_reason,
    encoder_reason,
    hybrid_reason,
)

RUNNER_ENV = "SGL_NB_MODEL_RUNNER"


class Runner(StrEnum):
    AUTO = "auto"
    NATIVE = "native"  # model.Model
    TRANSFORMERS = "transformers"  # transformers_model.TransformersModel


def load_model(
    folder: Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
    runner: Runner | str | None = None,
):
    """The model for a checkpoint folder, on the path `runner` (None: $SGL_NB_MODEL_RUNNER,
    else auto) picks; its `.path` says which ("native" or "transformers")."""
    from sgl_nb.runtime.model.model import Model

    config = read_config(folder)  # a missing or bad config.json: an error naming it
    chosen = choose_runner(config, runner)
    if chosen == Runner.NATIVE:
        return Model.load(folder, dtype=dtype, device=device, quantization=quantization)
    return TransformersModel.load(folder, dtype=dtype, device=device, quantization=quantization)


def choose_runner(config: dict, runner: Runner | str | None = None) -> Runner:
    """NATIVE or TRANSFORMERS for a config.json's contents; a ValueError naming the
    architecture and why when neither can run it."""
    runner = _runner(runner)
    arch = architecture(config)
    native = is_native(config)
    if runner == Runner.NATIVE and not native:
        raise ValueError(f"{arch}: {RUNNER_ENV}=native, but the native runner does not "
                         f"implement it ({_native_families()})")
    if runner == Runner.NATIVE or (runner == Runner.AUTO and native):
        return Runner.NATIVE
    why = transformers_reason(config)
    if why is not None:
        raise ValueError(f"{arch} cannot run on sgl-nb: {why}")
    return Runner.TRANSFORMERS


def architecture(config: dict) -> str:
    return (config.get("architectures") or [config.get("model_type") or "?"])[0]


def is_native(config: dict) -> bool:
    from sgl_nb.runtime.model.families import native_family

    return native_family(config) is not None


def transformers_reason(config: dict) -> str | None:
    """Why the transformers path cannot run this config (before loading any weight), or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    for reason in (encoder_reason(config), hybrid_reason(config)):
        if reason:
            return reason
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        import transformers

        return (f"model_type {model_type!r} is neither a native family ({_native_families()}) "
                f"nor a causal LM of the installed transformers ({transformers.__version__})")
    return attention_reason(config)


def _runner(runner: Runner | str | None) -> Runner:
    value = runner if runner is not None else os.environ.get(RUNNER_ENV, "").strip() or "auto"
    try:
        return Runner(str(value).lower())
    except ValueError:
        raise ValueError(f"{RUNNER_ENV} / runner must be one of "
                         f"{', '.join(r.value for r in Runner)}, got {value!r}") from None


def _native_families() -> str:
    from sgl_nb.runtime.model.families import FAMILIES

    return "native: " + ", ".join(sorted(FAMILIES))
