"""The fused CPU decode step (cpu_decode.cpp), compiled once and cached.

`load()` builds the extension with torch's C++ toolchain into
`$SGL_NB_CACHE/ext/<hash of source, torch version and CPU>` (about a minute on 2 cores,
printed), and returns the module, or None when it cannot be built (no compiler: a warning,
and the torch path runs). SGL_NB_CPU_DECODE=0 turns it off.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
HEADERS = sorted(SOURCE.parent.glob("cpu_*.h"))
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    return os.environ.get("SGL_NB_CPU_DECODE", "1").strip() not in ("0", "false", "off")


def available() -> bool:
    """Whether the fused decode may be used (enabled and built; builds it if needed)."""
    return enabled() and load() is not None


# The /proc/cpuinfo flags that name instruction sets (x86 and Arm): what -march=native turns on.
_SIMD_FLAG = re.compile(r"^(sse|ssse|avx|amx|fma|f16c|bmi|gfni|vaes|vpclmul|pclmul|aes|sha|"
                        r"popcnt|abm|lzcnt|movbe|adx|asimd|sve|fp|bf16|i8mm|dotprod)")


def cpu_key() -> str:
    """The CPU as native code sees it: model name and instruction-set flags (/proc/cpuinfo).

    A cache folder shared by machines of different CPUs must never hand one the code built
    for the other (-march=native: SIGILL), nor a kernel verdict measured on the other.
    """
    first: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:  # the first processor's block: the file grows with the cores
                if not line.strip():
                    break
                name, _, value = line.partition(":")
                first.setdefault(name.strip(), value.strip())
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    model = first.get("model name") or first.get("CPU part") or platform.machine()
    flags = (first.get("flags") or first.get("Features") or "").split()
    return f"{model} | {' '.join(sorted(f for f in flags if _SIMD_FLAG.match(f)))}"


def build_dir() -> Path:
    # Keyed by everything that goes into the build: a change of any of it builds afresh.
    parts = [p.read_bytes() for p in (SOURCE, *HEADERS)] + [" ".join(CFLAGS).encode()]
    parts.append(cpu_key().encode())
    key = hashlib.sha256(b"\0".join(parts) + torch.__version__.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("SGL_NB_CACHE", Path.home() / ".cache" / "sgl_nb"))
    return cache / "ext" / f"cpu_decode-{key}"


def load() -> ModuleType | None:
    """The compiled module, building it on first use; None if it cannot be built."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def loaded() -> ModuleType | None:
    """The module if it was loaded already (never builds it): for work that has a torch path
    as good, and must not pay a build (the token picker's alternatives)."""
    return _state.get("module")


def stop_workers() -> None:
    """Stop and join the kernels' worker threads, if the module was loaded (never builds it)."""
    module = loaded()
    if module is not None:
        module.stop_workers()


def _build() -> ModuleType | None:
    from torch.utils import cpp_extension

    folder = build_dir()
    fresh = not any(folder.glob("*.so"))
    if fresh:
        print(f"sgl-nb: compiling the CPU decode kernel into {folder} (once, ~1 min)",
              file=sys.stderr, flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        module = cpp_extension.load(
            name="sgl_nb_cpu_decode",
            sources=[str(SOURCE)],
            # -fopenmp for the `omp simd` loops (the build CI measured); the module's threads
            # are its own (WorkerPool), not OpenMP's.
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers: the torch path still works
        errors = [line for line in str(e).splitlines() if "error" in line][:3]
        warnings.warn(f"the fused CPU decode kernel could not be built in {folder} "
                      f"({'; '.join(errors) or e}); decoding with the torch path (slower)",
                      stacklevel=3)
        return None
    if fresh:
        print("sgl-nb: CPU decode kernel ready", file=sys.stderr, flush=True)
    return module


if __name__ == "__main__":  # `python -m sgl_nb.kernels.cpu_decode`: build it now
    sys.exit(0 if load() is not None else 1)
