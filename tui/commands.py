"""`sgl-nb debug FILE.py[:FUNCTION] [--arg k=v ...]` and `sgl-nb replay TRACE.jsonl`."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def debug_command(target: str, pairs: list[str], model: str | None = None,
                  record: str | None = None, show_timings: bool = True) -> int:
    """Run the program live under the debugger, paused before its first Node."""
    from sgl_nb.tui.program_file import load_program

    try:
        program = load_program(target, pairs)  # bad input fails before the model loads
    except ValueError as e:
        print(f"sgl-nb debug: {e}", file=sys.stderr)
        return 2
    import sgl_nb as sgl
    from sgl_nb.tui.app import DebuggerApp
    from sgl_nb.tui.live import LiveSession

    print("loading the model ...", flush=True)
    t0 = time.monotonic()
    rt = sgl.Runtime(model)
    print(f"loaded {rt.model_path.name} in {time.monotonic() - t0:.1f} s", flush=True)
    try:
        if record:
            sgl.enable_tracing(file=record, runtime=rt)
        DebuggerApp(LiveSession(program, rt), show_timings=show_timings).run()
    finally:
        if record:
            sgl.disable_tracing()
            print(f"trace written to {record} (replay it: sgl-nb replay {record})")
        rt.shutdown()
    return 0


def replay_command(path: str, show_timings: bool = True) -> int:
    """Step through an exported trace, forward and backward; no model is loaded."""
    from sgl_nb.tracing import TraceFormatError, load
    from sgl_nb.tui.app import DebuggerApp
    from sgl_nb.tui.replay import ReplaySession

    if not Path(path).is_file():
        print(f"sgl-nb replay: no such trace file: {path}", file=sys.stderr)
        return 2
    try:
        session = ReplaySession(load(path), Path(path).name)
    except (TraceFormatError, ValueError) as e:
        print(f"sgl-nb replay: {e}", file=sys.stderr)
        return 2
    DebuggerApp(session, show_timings=show_timings).run()
    return 0
