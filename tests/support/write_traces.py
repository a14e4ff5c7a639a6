"""Writes the traces tests/test_trace_compat.py replays, with what their replay shows.

    .venv/bin/python tests/support/write_traces.py tests/data/traces

Run it with the version whose traces must keep loading: it records, with the real default
model, `node.jsonl` (tests/data/tui_program.py's story, broken and chat, a stepped regex gen, a
cancelled program) and `token.jsonl` (story at the "token" level), and beside
each the replay's summary (tests/support/replay_summary.py) as `*.expected.json`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

import sgl_nb as sgl  # noqa: E402
from sgl_nb.tracing import load  # noqa: E402
from sgl_nb.tui.program_file import load_program  # noqa: E402
from support.replay_summary import dumps, summary  # noqa: E402

PROGRAM = Path(__file__).parent.parent / "data" / "tui_program.py"


@sgl.function
def year(s):
    s += "The year the first person walked on the moon: "
    s += sgl.gen("y", regex=r"(19|20)[0-9]{2}", max_tokens=8)


def _program(name: str):
    return load_program(f"{PROGRAM}:{name}").function


def _node_level(rt) -> None:
    for name in ("story", "broken", "chat"):
        _program(name).run(backend=rt).error()
    stepped = year.run(backend=rt, step=True)  # held at its start: paused, resumed
    assert stepped.debug.wait_until_held()
    stepped.debug.continue_()
    stepped.wait()
    cancelled = _program("long_story").run(backend=rt, stream=True)
    next(cancelled.text_iter("tale"))  # a token is out: cancel mid-gen
    cancelled.cancel()
    cancelled.wait()


def _write(rt, path: Path, level: str, record) -> None:
    rt.flush_cache()
    sgl.enable_tracing(file=path, level=level, runtime=rt)
    try:
        record(rt)
    finally:
        sgl.disable_tracing()
    path.with_suffix(".expected.json").write_text(dumps(summary(load(path), path.name)))


def main(folder: str) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    rt = sgl.Runtime(kv_pool_tokens=16384)
    try:
        _write(rt, out / "node.jsonl", "node", _node_level)
        _write(rt, out / "token.jsonl", "token",
               lambda rt: _program("story").run(backend=rt, topic="a port"))
    finally:
        rt.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
