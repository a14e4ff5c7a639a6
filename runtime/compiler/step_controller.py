"""Stepping one program: run, pause, step one Node, step one Instruction, breakpoints.

It sits where the executor dispatches a program's Nodes (before each Node) and where the
engine picks its decode batch (before each token of a Gen, one Decode instruction): a paused
program waits there, and only it; the executor and the engine keep serving every other
program. Nothing here blocks them: they ask (`enter_node`, `may_decode`) and are woken when a
step is granted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import StrEnum

from sgl_nb.runtime.compiler.ir import Node, NodeKind


class Hold(StrEnum):
    """Where a step controller holds its program."""

    NODE = "node"  # before a Node starts
    DECODE = "decode"  # inside a Gen, before its next token (one Decode step)


@dataclass(frozen=True)
class Breakpoint:
    name: str | None = None  # a variable name (gen/select/var_scope)
    kind: NodeKind | None = None  # a Node kind (its name, "Gen", is taken too)
    line: int | None = None  # a source line

    def __post_init__(self) -> None:
        if self.kind is not None and not isinstance(self.kind, NodeKind):
            try:
                object.__setattr__(self, "kind", NodeKind(self.kind))
            except ValueError:
                kinds = ", ".join(k.value for k in NodeKind)
                raise ValueError(f"no Node kind {self.kind!r}; the kinds are {kinds}") from None

    def hits(self, node: Node) -> bool:
        return ((self.name is None or node.name == self.name)
                and (self.kind is None or node.kind is self.kind)
                and (self.line is None or node.line == self.line))


class StepController:
    def __init__(self, paused: bool = False, on_change=None):
        self._cond = threading.Condition()
        self._paused = paused
        self._node_steps = 0  # Nodes allowed to start while paused
        self._token_steps = 0  # Decode instructions allowed while paused
        self._stop_after_node = False
        self.breakpoints: set[Breakpoint] = set()
        self.current: Node | None = None
        self.waiting_at: Hold | None = None  # where it is held, if it is
        self._on_change = on_change  # called (without the lock) on pause/resume
        self._wakers: list = []  # the executor's and the engine's wake(), called on a grant
        self._holding_node = False  # held before `current` (the paused event was sent)
        # Called with a Hold when the program becomes held there, and with None
        # when it goes on (events: paused / resumed). Runs under the lock: must not block.
        self.on_hold = None

    # ---- controls ----------------------------------------------------------------------

    def pause(self) -> None:
        with self._cond:
            self._paused = True
            self._cond.notify_all()

    def continue_(self) -> None:
        with self._cond:
            self._paused, self._node_steps, self._token_steps = False, 0, 0
            # A step granted earlier whose Node has not ended (another fork branch was the
            # one held) must not pause the program again when it does.
            self._stop_after_node = False
            self.waiting_at = None
            self._cond.notify_all()
        self._wake()

    def step(self) -> None:
        """Run the next Node to its end, then pause (a Gen runs all its tokens)."""
        with self._cond:
            self._paused = True
            if self.waiting_at is not Hold.DECODE:  # at a Node boundary: the next may start
                self._node_steps += 1
            self._token_steps = -1  # and run all of its tokens
            self._stop_after_node = True
            self.waiting_at = None  # granted: wait_until_held waits for the next hold
            self._cond.notify_all()
        self._wake()

    def step_instruction(self) -> None:
        """One Instruction: one token of the current Gen, or the next Node's first one."""
        with self._cond:
            self._paused = True
            if self.waiting_at is Hold.DECODE:
                self._token_steps += 1
            else:
                # The next Node's first Instruction: an Extend, or a Gen's prefill, which
                # yields its first token; each later token is one more step.
                self._node_steps += 1
            self.waiting_at = None
            self._cond.notify_all()
        self._wake()

    def breakpoint(self, name: str | None = None, kind: NodeKind | str | None = None,
                   line: int | None = None) -> Breakpoint:
        if name is None and kind is None and line is None:
            raise ValueError("a breakpoint needs a name, a kind or a line")
        bp = Breakpoint(name, kind, line)
        self.breakpoints.add(bp)
        return bp

    def clear_breakpoint(self, bp: Breakpoint) -> None:
        self.breakpoints.discard(bp)

    @property
    def paused(self) -> bool:
        return self._paused

    def wait_until_held(self, timeout: float = 60.0) -> bool:
        """Block until the program waits at a Node or a Decode (for headless use)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.waiting_at is not None, timeout)

    # ---- called by the executor and by the engine -----------------------------------------

    def add_waker(self, wake) -> None:
        """Call `wake()` whenever a step is granted (the executor's, the engine's)."""
        if wake not in self._wakers:
            self._wakers.append(wake)

    def enter_node(self, node: Node) -> bool:
        """The executor, before it starts `node`: may it start now? If not, the program is
        held there (and `wake` is called when a step is granted)."""
        with self._cond:
            if self.current is not node:  # asked for the first time
                self.current = node
                if any(bp.hits(node) for bp in self.breakpoints):
                    self._paused = True
            if self._paused and self._node_steps == 0:
                if not self._holding_node:
                    self._holding_node = True
                    self._held(Hold.NODE)
                self.waiting_at = Hold.NODE
                self._cond.notify_all()
                return False
            if self._holding_node:  # a grant cleared waiting_at already: say it goes on
                self._holding_node = False
                self._held(None)
            self.waiting_at = None
            if self._paused:
                self._node_steps -= 1
            return True

    def after_node(self, node: Node) -> None:
        with self._cond:
            if self._stop_after_node:
                self._stop_after_node = False
                self._token_steps = 0
                self._paused = True

    def may_decode(self) -> bool:
        """Engine thread, once per step: may this program's Gen make its next token?"""
        with self._cond:
            if not self._paused or self._token_steps < 0 or self._token_steps > 0:
                if self._token_steps > 0:
                    self._token_steps -= 1
                if self.waiting_at is Hold.DECODE:
                    self._held(None)
                self.waiting_at = None
                return True
            if self.waiting_at is not Hold.DECODE:
                self.waiting_at = Hold.DECODE
                self._held(Hold.DECODE)
                self._cond.notify_all()
            return False

    def _held(self, at: Hold | None) -> None:
        if self.on_hold is not None:
            self.on_hold(at, self.current)

    def _wake(self) -> None:
        for wake in list(self._wakers):
            wake()
