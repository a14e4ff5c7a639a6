"""The probe process's side of runtime/model/kernel_probe.py: run as
`python -m sgl_nb.runtime.model.kernel_probe_child`, it reads the probes on its stdin, loads
the parent's build of our kernels, and reports a verdict per probe on its stdout. A kernel
that crashes here kills this child, never the user's kernel."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch

from sgl_nb.kernels import cpu_decode
from sgl_nb.runtime.model import linear
from sgl_nb.runtime.model.kernel_probe import (
    FAULT_ENV,
    REPORT_PREFIX,
    Probe,
    check_layer,
    random_quantized,
)


def main() -> int:
    job = json.load(sys.stdin)
    _use_extension(job["extension"])
    probes = [Probe(**p) for p in job["probes"]]
    _report(ready=True)  # the parent's per-probe limit starts here, not at the spawn
    for i, probe in enumerate(probes):
        _report(start=i)
        print(f"sgl-nb: probing {probe.name} on {probe.shape} ({i + 1}/{len(probes)})",
              file=sys.stderr, flush=True)
        _report(done=i, why=check(probe, _fault(probe)))
    return 0


def _report(**fields) -> None:
    print(REPORT_PREFIX + json.dumps(fields), flush=True)


def _use_extension(path: str | None) -> None:
    """The parent's build of our kernels, loaded by path: the child checks the code the
    parent runs (the sources on disk may have changed since), and never builds."""
    module = None
    if path:
        spec = importlib.util.spec_from_file_location("sgl_nb_cpu_decode", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    with cpu_decode._lock:
        cpu_decode._state["module"] = module


def _fault(probe: Probe) -> str | None:
    for entry in os.environ.get(FAULT_ENV, "").split(";"):
        parts = entry.split()
        if len(parts) == 3 and parts[0] in ("*", probe.kernel) and \
                parts[1] in ("*", f"{probe.n}x{probe.k}"):
            return parts[2]
    return None


def check(probe: Probe, fault: str | None = None) -> str | None:
    """Build the layer for random weights of the probe's shape and compare it with them."""
    t = random_quantized(probe)
    try:
        layer = linear.quantized_linear(t, None, getattr(torch, probe.dtype), torch.device("cpu"),
                                        probe.quantization, probe.kernel)
        return check_layer(layer, t, probe, fault)
    except RuntimeError as e:  # the kernel rejected the input: a verdict, not a crash
        return f"{probe.name} raised on {probe.shape}: {str(e).splitlines()[0]}"


if __name__ == "__main__":
    sys.exit(main())
