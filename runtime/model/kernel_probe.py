"""Quantized matmul kernels checked once per kernel, shape, dtype and machine, in a child process.

A native kernel that crashes on a shape kills the process that called it: in a notebook,
the user's Jupyter kernel and everything in it.
So before a model's quantized layers are used, each (kernel, [N, K], dtype) among them runs
in a child, `python -m sgl_nb.runtime.model.kernel_probe_child`, on random weights of that
shape against their dequantized values (runtime/model/kernel_probe_child.py). One child
takes every unchecked shape of a load, reporting each verdict as it goes; if it dies (a
signal, a non-zero exit, no answer in $SGL_NB_PROBE_TIMEOUT s, default 120) the shape it was
on is "crashed" and the rest go to a new child. That limit starts when the child reports it
is ready (torch imported, our extension loaded): a start-up takes 2 s on one machine and 10
s on a busy, slower one, and is no kernel's fault. The start-up has its own, generous limit
($SGL_NB_PROBE_START_TIMEOUT s, default 600), past which the child failed before checking a
kernel.
Verdicts are kept in `$SGL_NB_CACHE/kernel_checks/<key>.json`, the key covering
the CPU, torch and our extension's build, so later loads spawn nothing.

The child's weights are random, not the model's: what makes a kernel crash or miscompute
here is the shape, the dtype, the CPU and the operands' layout (which the layers fix,
runtime/model/kernel_rules.py), not the values. $SGL_NB_PROBE_FAULT (read by the child only) makes
a probe fail on purpose, for the tests: "<kernel> <N>x<K> <fault>[; ...]" with `*` for any
kernel or shape and fault one of crash (SIGSEGV), exit, hang, raise, wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sgl_nb.kernels import cpu_decode
from sgl_nb.runtime.model import kernel_rules
from sgl_nb.runtime.model.model_loader import cache_dir
from sgl_nb.runtime.model.quantize import INT4_GROUP, dequantize

FAULT_ENV = "SGL_NB_PROBE_FAULT"
TIMEOUT_ENV = "SGL_NB_PROBE_TIMEOUT"
START_TIMEOUT_ENV = "SGL_NB_PROBE_START_TIMEOUT"
REPORT_PREFIX = "sgl-nb-probe "  # the prefix of the child's report lines on its stdout
_ROWS = (1, 3, 9)  # rows per check: a decode row; torch's blocks of 4 rows, part and whole
_CHUNK = 8192  # weight rows dequantized at a time for the reference (an LM head is large)
_lock = threading.Lock()
_known: dict[Path, dict[str, str | None]] = {}  # verdict file -> its verdicts, read once


@dataclass(frozen=True)
class Probe:
    kernel: str  # runtime/model/kernel_rules.py's names
    n: int
    k: int
    dtype: str  # the activations' torch dtype by name, "bfloat16"

    @classmethod
    def of(cls, kernel: str, n: int, k: int, dtype: torch.dtype) -> Probe:
        return cls(kernel, n, k, str(dtype).removeprefix("torch."))

    @property
    def key(self) -> str:
        return f"{self.kernel} {self.n}x{self.k} {self.dtype}"

    @property
    def quantization(self) -> str:
        return self.kernel.rsplit("-", 1)[1]

    @property
    def shape(self) -> str:
        return kernel_rules.shape_text(self.n, self.k, self.dtype)

    @property
    def name(self) -> str:
        return kernel_rules.describe(self.kernel)


def verdicts(probes: Iterable[Probe]) -> dict[Probe, str | None]:
    """Each probe's verdict, None when its kernel may be used, else why not. Those not cached
    yet run together in a child process (more only if one dies), and are cached."""
    probes = list(dict.fromkeys(probes))
    with _lock:
        path = verdict_file()
        known = _known.get(path)
        if known is None:
            known = _known[path] = _read(path)
        missing = [p for p in probes if p.key not in known]
        unsure: dict[str, str] = {}
        if missing:
            found, unsure = run_probes(missing)
            known.update(found)
            _save(path, found)
        return {p: unsure[p.key] if p.key in unsure else known[p.key] for p in probes}


def environment() -> dict[str, str]:
    """What a verdict holds for: the CPU, torch (and the SIMD level it dispatches to, which
    ATEN_CPU_CAPABILITY can lower) and the build of our extension."""
    module = _extension()
    return {
        "cpu": cpu_decode.cpu_key(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "extension": Path(module.__file__).parent.name if module is not None else "none",
    }


def verdict_file() -> Path:
    env = json.dumps(environment(), sort_keys=True)
    return cache_dir() / "kernel_checks" / f"{hashlib.sha256(env.encode()).hexdigest()[:16]}.json"


def _extension():
    return cpu_decode.load() if cpu_decode.enabled() else None


def _read(path: Path) -> dict[str, str | None]:
    try:
        return dict(json.loads(path.read_text())["verdicts"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _save(path: Path, found: dict[str, str | None]) -> None:
    """Merge `found` into the file (re-read first: another process may have added some)."""
    if not found:
        return
    merged = {**_read(path), **found}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"environment": environment(), "verdicts": merged}, indent=1))
        os.replace(tmp, path)  # never a half-written file
    except OSError:  # a read-only cache: the verdicts hold for this process only
        pass


def _say(message: str) -> None:
    print(f"sgl-nb: {message}", file=sys.stderr, flush=True)


# ---- the parent side: children and their reports ---------------------------------------------


def run_probes(probes: list[Probe]) -> tuple[dict[str, str | None], dict[str, str]]:
    """Run `probes` in child processes: (verdicts to cache, and verdicts not to: for the
    probes left when a child failed before checking anything, an environment problem)."""
    _say(f"checking {len(probes)} quantized kernel shape(s) in a probe process "
         "(once per CPU, torch and build)")
    t0 = time.monotonic()
    found: dict[str, str | None] = {}
    pending = probes
    while pending:
        got, failure = _run_child(pending)
        found.update(got)
        pending = [p for p in pending if p.key not in found]
        if failure is not None:
            _say(failure)
            return found, {p.key: failure for p in pending}
    bad = sum(why is not None for why in found.values())
    _say(f"kernel checks done in {time.monotonic() - t0:.1f} s "
         f"({len(found) - bad} usable, {bad} not)")
    return found, {}


def _run_child(probes: list[Probe]) -> tuple[dict[str, str | None], str | None]:
    """One child over `probes`: the verdicts it reached (the one it died on: crashed), and a
    failure text when it died before starting any."""
    job = json.dumps({"probes": [asdict(p) for p in probes], "extension": _extension_path()})
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            # -P: the working directory off sys.path (a checkout's kernels/ folder would
            # shadow packages of the same name: Makefile, PYTHONSAFEPATH).
            [sys.executable, "-P", "-m", "sgl_nb.runtime.model.kernel_probe_child"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
        )
        proc.stdin.write(job)
        proc.stdin.close()
        got, current, status = _follow(proc, probes)
        code = proc.wait()
        proc.stdout.close()
        status = status or _exit_text(code)
        tail = _last_line(err)
    if current is not None:
        got[current.key] = (f"{current.name} crashed on {current.shape} in a probe process "
                            f"({status})")
        rest = "; checking the rest in a new one" if len(got) < len(probes) else ""
        _say(f"the probe process died on {current.name} on {current.shape} ({status}){rest}")
    elif not got:  # its own trouble (an import, the interpreter), none of a kernel's
        status = ": ".join(x for x in (status or "no verdict", tail) if x)
        return got, (f"the kernel probe process failed before checking a kernel ({status}): "
                     "quantized layers stay dense")
    return got, None


def _follow(proc: subprocess.Popen, probes: list[Probe]):
    """Read the child's reports until it exits or goes quiet: (verdicts, the probe it was
    on, and "no answer in ..." if it went quiet, killed)."""
    lines = _lines(proc.stdout)
    limit = float(os.environ.get(TIMEOUT_ENV, "120"))
    start_limit = float(os.environ.get(START_TIMEOUT_ENV, "600"))
    got: dict[str, str | None] = {}
    current, ready = None, False
    while True:
        wait = limit if ready else start_limit
        try:
            line = lines.get(timeout=wait)
        except queue.Empty:
            proc.kill()
            while lines.get(timeout=30) is not None:  # to the end of its output
                pass
            return got, current, f"no answer in {wait:g} s" if ready else \
                f"not ready in {wait:g} s"
        if line is None:
            return got, current, None
        if not line.startswith(REPORT_PREFIX):
            continue
        report = json.loads(line[len(REPORT_PREFIX):])
        if "ready" in report:
            ready = True
        elif "start" in report:
            current = probes[report["start"]]
        else:
            got[probes[report["done"]].key] = report["why"]
            current = None


def _lines(stream) -> queue.Queue:
    """The stream's lines on a queue, None at its end (a thread: reads block)."""
    q: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in stream:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True, name="sgl-nb-probe-reader").start()
    return q


def _exit_text(code: int) -> str | None:
    if code == 0:
        return None
    return f"signal {-code}" if code < 0 else f"exit status {code}"


def _last_line(err) -> str:
    err.seek(0)
    lines = [line.strip() for line in err.read().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _extension_path() -> str | None:
    module = _extension()
    return None if module is None else module.__file__


def random_quantized(probe: Probe) -> dict[str, torch.Tensor]:
    """Quantized weights of the probe's shape in runtime/model/quantize.py's form, their scales
    exact in the kernels' own precision (int8: bf16; int4 and q8_0: fp16)."""
    n, k = probe.n, probe.k
    gen = torch.Generator().manual_seed(n * 65537 + k)

    def values(*shape: int, scale: float, offset: float = 0.0, dtype=torch.float16):
        return (torch.rand(*shape, generator=gen) * scale + offset).to(dtype)

    groups = k // INT4_GROUP
    if probe.quantization in ("int8", "q8_0"):
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        if probe.quantization == "q8_0":
            return {"qweight": q, "scale": values(n, groups, scale=0.02, offset=1e-3)}
        return {"qweight": q,
                "scale": values(n, scale=0.02, offset=1e-3, dtype=torch.bfloat16).float()}
    q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    return {"qweight": q, "scale": values(n, groups, scale=0.02, offset=1e-3),
            "min": values(n, groups, scale=0.04, offset=-0.2)}


def check_layer(layer, t: dict[str, torch.Tensor], probe: Probe, fault: str | None = None,
                device: torch.device | str = "cpu",
                bias: torch.Tensor | None = None) -> str | None:
    """None when `layer` agrees with its dequantized weights `t` (and `bias`) at each of
    _ROWS rows."""
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, probe.dtype)
    ours = probe.kernel.startswith("ours")
    for rows in _ROWS:
        x = torch.randn(rows, probe.k, generator=gen).to(dtype)
        _inject(fault)
        y = layer(x.to(device)).float().cpu()
        if fault == "wrong":
            y = torch.zeros_like(y)
        if y.shape != (rows, probe.n):
            return f"{probe.name} gave {list(y.shape)} for {rows} rows of {probe.shape}"
        want, bound = _reference(x, t, probe.quantization, ours)
        if bias is not None:
            want += bias.float().cpu()
        err = (y - want).abs()
        # 16-bit outputs: a few ulps of bf16 relative to the output's size; and the bound of
        # the rounding of x (_reference).
        sixteen_bit = 3e-2 * want.abs().max() if dtype != torch.float32 else 0.0
        tol = (sixteen_bit + 1e-6 + bound).expand_as(err)
        if not (err <= tol).all():  # also catches NaN
            worst = (err - tol).argmax()
            return (f"{probe.name} disagrees with the dequantized weight on {probe.shape} at "
                    f"{rows} rows (error {err.view(-1)[worst]:.3g} > {tol.reshape(-1)[worst]:.3g})")
    return None


def _inject(fault: str | None) -> None:
    if fault == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif fault == "exit":
        os._exit(3)
    elif fault == "hang":
        time.sleep(3600)
    elif fault == "raise":
        raise RuntimeError(f"injected by {FAULT_ENV}")


def _reference(x: torch.Tensor, t: dict[str, torch.Tensor], quantization: str, ours: bool):
    """x @ w.T in fp32 from the dequantized weight, and the most each output may be off:
    with fp32 x, fp32 rounding (1e-5 of sum |x| |w|: the exact path, or torch's); with
    16-bit x into our kernels, which round each row to int8 per group of 32, sum |w| * half
    a step of x. The weight is dequantized a chunk of rows at a time."""
    xf = x.float()
    rows, k = xf.shape
    half = None
    if x.dtype == torch.float32:
        half = 1e-5 * xf.abs()
    elif ours:
        step = xf.view(rows, -1, INT4_GROUP).abs().amax(-1, keepdim=True) / 254
        half = step.expand(rows, k // INT4_GROUP, INT4_GROUP).reshape(rows, k)
    outs, bounds = [], []
    for a in range(0, t["qweight"].shape[0], _CHUNK):
        w = dequantize({name: v[a:a + _CHUNK] for name, v in t.items()}, quantization)
        outs.append(xf @ w.T)
        if half is not None:
            bounds.append(half @ w.abs().T)
    return torch.cat(outs, 1), (torch.cat(bounds, 1) if bounds else torch.zeros(()))
