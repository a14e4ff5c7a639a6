"""The kernel probe process (runtime/model/kernel_probe.py) on single layers, with real children.

Faults are real: $SGL_NB_PROBE_FAULT makes the child itself segfault, exit, hang, raise or
return zeros on a given kernel and shape; the parent keeps that layer dense with the reason,
caches the verdict and still checks the other shapes. Cached verdicts spawn no child in a
later process, and a different CPU or torch version checks again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import env_with_tests, link_entries

from sgl_nb.kernels import cpu_decode
from sgl_nb.runtime.model.kernel_probe import FAULT_ENV, START_TIMEOUT_ENV, TIMEOUT_ENV
from sgl_nb.runtime.model.linear import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    check_kernels,
    make_linear,
)
from sgl_nb.runtime.model.model_loader import cache_dir
from sgl_nb.runtime.model.quantize import quantize

BF16 = torch.bfloat16
# (quantization, N, K): our int8 kernel, torch's int8 (90 outputs: no whole panel of 8 for
# ours), our int4 (three groups of 32).
SHAPES = [("int8", 64, 96), ("int8", 90, 64), ("int4", 32, 96)]
CHECKING = "quantized kernel shape(s) in a probe process"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder for the verdicts (our kernels built, or not, beforehand: the
    build lives in the cache folder too, linked into the fresh one for a child process)."""
    cpu_decode.available()
    link_entries(cache_dir(), tmp_path, "ext")
    monkeypatch.setenv("SGL_NB_CACHE", str(tmp_path))
    monkeypatch.delenv(FAULT_ENV, raising=False)
    return tmp_path


def _weights(quantization: str, n: int, k: int) -> tuple[torch.Tensor, dict]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    return w, quantize(w, quantization)


def make_layers(shapes=SHAPES) -> dict:
    """(layer, why) of make_linear for each (quantization, N, K)."""
    out = {}
    for quantization, n, k in shapes:
        w, t = _weights(quantization, n, k)
        out[quantization, n, k] = make_linear(w, None, BF16, "cpu", quantization, t)
    return out


def _verdicts(cache) -> dict:
    (path,) = (cache / "kernel_checks").glob("*.json")
    return json.loads(path.read_text())["verdicts"]


def test_one_probe_process_checks_every_new_shape_once(cache, capfd):
    check_kernels([(q, _weights(q, n, k)[1]) for q, n, k in SHAPES], BF16, "cpu")
    err = capfd.readouterr().err
    assert err.count(CHECKING) == 1 and f"checking 3 {CHECKING}" in err
    assert list(_verdicts(cache).values()) == [None, None, None]
    layers = make_layers()  # from the verdicts: no second process
    assert CHECKING not in capfd.readouterr().err
    assert all(why is None for _, why in layers.values())
    assert isinstance(layers[SHAPES[0]][0], Int8Linear) and layers[SHAPES[0]][0].native
    assert layers[SHAPES[1]][0].kernel == "torch-int8"
    assert isinstance(layers[SHAPES[2]][0], Int4Linear) and layers[SHAPES[2]][0].native


def test_a_crash_in_the_probe_process_keeps_only_that_shape_dense(cache, monkeypatch, capfd):
    monkeypatch.setenv(FAULT_ENV, "torch-int8 90x64 crash")  # the second of three
    check_kernels([(q, _weights(q, n, k)[1]) for q, n, k in SHAPES], BF16, "cpu")
    err = capfd.readouterr().err
    assert ("died on torch's int8 kernel on [90, 64] bf16 (signal 11); checking the rest in a "
            "new one") in err
    crashed = "torch's int8 kernel crashed on [90, 64] bf16 in a probe process (signal 11)"
    assert _verdicts(cache) == {
        "ours-int8 64x96 bfloat16": None, "torch-int8 90x64 bfloat16": crashed,
        "ours-int4 32x96 bfloat16": None,
    }
    layers = make_layers()
    assert isinstance(layers[SHAPES[1]][0], DenseLinear) and layers[SHAPES[1]][1] == crashed
    assert isinstance(layers[SHAPES[0]][0], Int8Linear) and layers[SHAPES[0]][1] is None
    assert isinstance(layers[SHAPES[2]][0], Int4Linear) and layers[SHAPES[2]][1] is None


@pytest.mark.parametrize("fault,status", [("exit", "(exit status 3)"),
                                          ("hang", "(no answer in 10 s)")])
def test_a_probe_process_that_exits_or_hangs_is_a_crash(cache, monkeypatch, fault, status):
    monkeypatch.setenv(FAULT_ENV, f"* 90x64 {fault}")
    monkeypatch.setenv(TIMEOUT_ENV, "10")
    (layer, why), = make_layers([("int8", 90, 64)]).values()
    assert isinstance(layer, DenseLinear)
    assert why == f"torch's int8 kernel crashed on [90, 64] bf16 in a probe process {status}"


def _slow_start(tmp_path, monkeypatch, seconds: float) -> None:
    """Every child Python sleeps `seconds` before its own code: a slow, busy machine."""
    site = tmp_path / "slow_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import time\ntime.sleep({seconds})\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))


def test_the_probe_limit_starts_when_the_child_is_ready(cache, monkeypatch, tmp_path):
    """A start-up longer than the per-probe limit is not a kernel's fault."""
    _slow_start(tmp_path, monkeypatch, 15)
    monkeypatch.setenv(TIMEOUT_ENV, "10")
    (layer, why), = make_layers([("int8", 90, 64)]).values()
    assert why is None and not isinstance(layer, DenseLinear)


def test_a_child_never_ready_fails_before_any_kernel_and_caches_nothing(cache, monkeypatch,
                                                                        tmp_path):
    _slow_start(tmp_path, monkeypatch, 3600)
    monkeypatch.setenv(START_TIMEOUT_ENV, "2")
    (layer, why), = make_layers([("int8", 90, 64)]).values()
    assert isinstance(layer, DenseLinear)
    assert why.startswith("the kernel probe process failed before checking a kernel "
                          "(not ready in 2 s")
    assert not list((cache / "kernel_checks").glob("*.json"))


@pytest.mark.parametrize("fault,reason", [
    ("wrong", "our int8 kernel disagrees with the dequantized weight on [64, 96] bf16 at 1 rows"),
    ("raise", f"our int8 kernel raised on [64, 96] bf16: injected by {FAULT_ENV}"),
])
def test_a_kernel_that_raises_or_computes_wrongly_is_not_used(cache, monkeypatch, fault, reason):
    monkeypatch.setenv(FAULT_ENV, f"ours-int8 * {fault}")
    (layer, why), = make_layers([("int8", 64, 96)]).values()
    assert isinstance(layer, DenseLinear) and why.startswith(reason)


def test_a_second_process_takes_the_cached_verdicts_and_spawns_none(cache, capfd):
    make_layers(SHAPES[:1])
    assert CHECKING in capfd.readouterr().err
    # A fresh process in which any probe process would crash: the verdict is the file's.
    code = ("import test_kernel_probe as t\n"
            "(layer, why), = t.make_layers(t.SHAPES[:1]).values()\n"
            "assert why is None and layer.native, why\n")
    again = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent,
                           env=env_with_tests(**{FAULT_ENV: "* * crash"}), capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert CHECKING not in again.stderr


@pytest.mark.parametrize("change", ["cpu", "torch"])
def test_another_cpu_or_torch_version_checks_again(cache, monkeypatch, capfd, change):
    make_layers(SHAPES[:1])
    monkeypatch.setenv(FAULT_ENV, "* * crash")  # from here on a probe crashes: it shows
    if change == "cpu":
        monkeypatch.setattr(cpu_decode, "cpu_key", lambda: "Another CPU | avx2 fma")
    else:
        monkeypatch.setattr(torch, "__version__", "2.99.0")
    (layer, why), = make_layers(SHAPES[:1]).values()
    assert isinstance(layer, DenseLinear) and "crashed" in why
    assert len(list((cache / "kernel_checks").glob("*.json"))) == 2
    assert capfd.readouterr().err.count(CHECKING) == 2


def test_a_probe_process_that_cannot_start_caches_nothing(cache, monkeypatch, tmp_path):
    broken = tmp_path / "broken"
    (broken / "sgl_nb").mkdir(parents=True)
    (broken / "sgl_nb" / "__init__.py").write_text("raise SystemExit('no sgl_nb here')\n")
    monkeypatch.setenv("PYTHONPATH", str(broken))  # the child imports this one first
    monkeypatch.chdir(tmp_path)  # not the checkout's own (python -m puts the cwd first)
    (layer, why), = make_layers(SHAPES[:1]).values()
    assert isinstance(layer, DenseLinear)
    assert why.startswith("the kernel probe process failed before checking a kernel "
                          "(exit status 1: no sgl_nb here)")
    assert not list((cache / "kernel_checks").glob("*.json"))
    monkeypatch.delenv("PYTHONPATH")  # not cached: the next load checks it
    (layer, why), = make_layers(SHAPES[:1]).values()
    assert why is None and isinstance(layer, Int8Linear)


def test_the_extensions_build_folder_is_keyed_by_the_cpu(monkeypatch):
    """Built with -march=native: another CPU sharing the cache folder builds its own."""
    key = cpu_decode.cpu_key()
    if os.uname().machine == "x86_64":  # every x86-64 CPU has SSE2
        assert "sse2" in key.split(" | ")[1].split()
    here = cpu_decode.build_dir()
    monkeypatch.setattr(cpu_decode, "cpu_key", lambda: "Another CPU | avx2 fma")
    assert cpu_decode.build_dir().parent == here.parent and cpu_decode.build_dir() != here
