"""What a program raises to its caller."""

from __future__ import annotations

from sgl_nb.runtime.compiler.instructions import Cancelled


class ProgramError(RuntimeError):
    """An exception inside a program, with the program line it came from."""


class ProgramCancelled(ProgramError, Cancelled):
    """The program was cancelled (`state.cancel()`, `fut.cancel()`, an interrupt while
    waiting on it). What it produced until then is kept on the state."""
