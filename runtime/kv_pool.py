"""Token-granular KV storage: one slot holds one token's K and V for every layer.

Page size is 1, so a request's KV is an arbitrary list of slot ids and the radix cache can
share any prefix without copying. Slot ids are int64 CPU tensors; callers move them to the
buffers' device when they index.
"""

from __future__ import annotations

import torch

# Calls with at most this many slots check and flag them in Python: below it that beats the fixed
# overhead of torch ops (alloc(1) + free: ~30 us, against ~100 us with tensor ops only, measured
# on a busy 2-core CPU where one torch op costs 2-5 us).
_SMALL = 32


class KVPool:
    """Token-granular paged KV storage (page size 1): slot i holds one token's K and V for every
    layer. Slot 0 is reserved padding (kernels may point unused rows at it) and never allocated."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        head_major: bool = False,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.capacity = num_slots
        self.k_buffers = [self._buffer(num_slots + 1, head_major) for _ in range(num_layers)]
        self.v_buffers = [self._buffer(num_slots + 1, head_major) for _ in range(num_layers)]
        # Free slots are _stack[_top:]; alloc takes from the front, free pushes back onto it,
        # so recently freed (cache-warm) slots are reused first and the first allocations
        # come out in ascending order.
        self._stack = torch.arange(1, num_slots + 1, dtype=torch.int64)
        self._stack_np = self._stack.numpy()  # the same memory: alloc's small calls
        self._top = 0
        # Invariant: slot s is free iff it is in _stack[_top:] iff _flags[s] == 1. Slot 0 is
        # never free, so it can neither be handed out nor "freed" into the stack.
        # _flags and _is_free are one buffer seen two ways: Python indexing for the small
        # calls of every decode step (a torch op costs microseconds of fixed overhead, a
        # bytearray lookup nanoseconds), tensor indexing for the big calls of a prefill.
        self._flags = bytearray(num_slots + 1)
        self._is_free = torch.frombuffer(self._flags, dtype=torch.bool)
        self._is_free[1:] = True

    def _buffer(self, slots: int, head_major: bool) -> torch.Tensor:
        """One layer's K or V: [slots, kv_heads, head_dim], each row's head_dim values
        adjacent. head_major: stored [kv_heads, slots, head_dim] (a permuted view), so that a
        KV head's rows of a request's slots lie together. The CPU decode step's attention reads
        one KV head's rows per task: slot-major, the other heads' lines between them cost as
        much to read as those rows (a standalone read of one head of 174 slots, 7.0 us a layer,
        all three 8.1), and the int4 one stream's attention took 0.43 ms a step against 0.375
        head-major, RoPE and the KV store 0.065 against 0.081 (alternating in one process,
        medians of 14, a 2-core Zen 4)."""
        shape = (self.num_kv_heads, slots, self.head_dim) if head_major else (
            slots, self.num_kv_heads, self.head_dim)
        buf = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return buf.permute(1, 0, 2) if head_major else buf

    def available(self) -> int:
        return self.capacity - self._top

    def used(self) -> int:
        return self._top

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slot ids (int64, CPU), or None when fewer than n are free (nothing taken)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self.available():
            return None
        if n <= _SMALL:  # every decode step: numpy's slice and copy cost half torch's
            ids = self._stack_np[self._top : self._top + n].copy()
            self._top += n
            for s in ids.tolist():
                self._flags[s] = False
            return torch.from_numpy(ids)
        # clone: the stack region is overwritten by later frees.
        slots = self._stack[self._top : self._top + n].clone()
        self._top += n
        self._set_flags(slots, False)
        return slots

    def free(self, slots: torch.Tensor) -> None:
        """Give slots back. Raises ValueError (naming a slot) on slot 0, an out-of-range id, a slot
        that is already free, or the same slot twice in `slots`; nothing is freed then."""
        slots = slots.reshape(-1)
        if slots.dtype != torch.int64 or slots.device.type != "cpu":
            slots = slots.to(device="cpu", dtype=torch.int64)
        n = slots.numel()
        if n == 0:
            return
        # A slot freed twice would sit in the stack twice and later go to two requests.
        if n <= _SMALL:
            self._check_freeable_small(slots.tolist())
        else:
            self._check_freeable_large(slots)
        self._set_flags(slots, True)
        self._top -= n
        self._stack[self._top : self._top + n] = slots

    def _set_flags(self, slots: torch.Tensor, free: bool) -> None:
        if slots.numel() <= _SMALL:
            for s in slots.tolist():
                self._flags[s] = free
        else:
            # index_fill_/index_select, not tensor[idx]: advanced indexing took ~8 ms for 4096
            # slots on a busy 2-core CPU (intra-op threads), these take ~30 us.
            self._is_free.index_fill_(0, slots, free)

    def _check_freeable_small(self, ids: list[int]) -> None:
        seen = set()
        for s in ids:
            if not 1 <= s <= self.capacity:
                raise ValueError(f"KV slot {s} is not a valid slot id (1..{self.capacity})")
            if self._flags[s] or s in seen:
                raise ValueError(f"double free of KV slot {s}")
            seen.add(s)

    def _check_freeable_large(self, slots: torch.Tensor) -> None:
        lo, hi = slots.aminmax()
        if lo < 1 or hi > self.capacity:
            bad = slots[(slots < 1) | (slots > self.capacity)]
            raise ValueError(f"KV slot {int(bad[0])} is not a valid slot id (1..{self.capacity})")
        was_free = self._is_free.index_select(0, slots)
        if was_free.any():
            raise ValueError(f"double free of KV slot {int(slots[was_free][0])}")
        if torch.unique(slots).numel() < slots.numel():
            uniq, counts = torch.unique(slots, return_counts=True)
            raise ValueError(f"double free of KV slot {int(uniq[counts > 1][0])}")

    def __repr__(self) -> str:
        return (
            f"KVPool(layers={self.num_layers}, slots={self.capacity}, used={self.used()}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"device={self.device})"
        )
