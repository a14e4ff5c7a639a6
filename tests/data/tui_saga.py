"""A program the terminal debugger's live tests cancel and pause while it decodes
(tests/test_tui_live.py). Its own file, so tui_program.py's replay snapshots stay put."""

import sgl_nb as sgl


@sgl.function
def saga(s):
    # Long enough that a key pressed after its first token lands while it still decodes,
    # however slow the machine: the TUI and the engine slow down together.
    s += "Here is a long story about a dragon."
    s += sgl.gen("tale", max_tokens=4096, ignore_eos=True)
