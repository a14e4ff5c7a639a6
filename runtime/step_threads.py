"""How many CPU threads an engine step runs on, set per step kind.

On CPU the torch decode path (~35 small ops per layer, each its own OpenMP region) ran
slower on two threads than on one from a thread other than the main one (81 vs 55 ms per
step at batch 1); the fused step (kernels/cpu_decode.cpp) gains from every core (int4: 24
-> 10 ms). Prefill always does. Where that module runs (its own threads: every matmul, and
the whole decode step) torch gets one thread, as an OpenMP worker spinning between torch
ops took the second core from ours (int4 decode 19 vs 10 ms per step; bf16 16-request
workload 6.4 vs 5.8 s, measured).
"""

from __future__ import annotations

import os

import torch

from sgl_nb.kernels import cpu_decode


class StepThreads:
    def __init__(self, extend_threads: int, fused: bool):
        """extend_threads: torch's thread count before the engine changed it; fused: the
        model decodes through the C++ step (Model.fused_decode_ready)."""
        self.extend = extend_threads
        default = extend_threads if fused else 1
        self.decode = int(os.environ.get("SGL_NB_DECODE_THREADS", default))
        self._fused = fused
        # The C++ module's thread count, set when it changes (not every step).
        self._kernel_threads = cpu_decode.load() if fused else None
        self._kernel_threads_now = 0

    def use_for(self, decode: bool) -> None:
        """Set the thread counts for a decode (or an extend) step."""
        want = self.decode if decode else self.extend
        torch_threads = 1 if self._fused else want
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        if self._kernel_threads is not None and self._kernel_threads_now != want:
            self._kernel_threads.set_num_threads(want)
            self._kernel_threads_now = want
