"""A process that uses the library exits with its own exit code, whatever still runs: scripts
that end mid-stream, raise mid-program, call sys.exit with a request decoding, or end with
tracing on, each in a fresh interpreter on the real model."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from sgl_nb.runtime.model.model_loader import cache_dir

pytestmark = pytest.mark.slow

STORY = """
import sgl_nb as sgl

@sgl.function
def story(s):
    s += "Once upon a time" + sgl.gen("tale", max_tokens=2000, ignore_eos=True)
"""

SCRIPTS = {
    "mid_stream": ("""
import sgl_nb as sgl
rt = sgl.Runtime()
it = rt.generate("Once upon a time", max_tokens=2000, ignore_eos=True, stream=True)
print("first:", next(it), flush=True)
""", 0),
    "raises_mid_program": (STORY + """
state = story.run(stream=True)
print("first:", next(state.text_iter()), flush=True)
raise RuntimeError("the script failed")
""", 1),
    "sys_exit_mid_request": ("""
import sys, threading, time
import sgl_nb as sgl
rt = sgl.Runtime()
h = rt.submit("Once upon a time", max_tokens=2000, ignore_eos=True)
waiter = threading.Thread(target=lambda: h.result())  # not a daemon: exit must not hang
waiter.start()
while not h.req.output_ids:  # a bare spin here held the GIL from the engine's thread
    time.sleep(0.01)
sys.exit(3)
""", 3),
    "ends_with_tracing_on": (STORY + """
import sys
sgl.enable_tracing(file=sys.argv[1])
state = story.run(stream=True)
print("first:", next(state.text_iter()), flush=True)
""", 0),
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_script_exits_with_its_own_code(name, tmp_path, model_path):
    source, code = SCRIPTS[name]
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(source))
    trace = tmp_path / "trace.jsonl"
    env = {**os.environ, "SGL_NB_CACHE": str(cache_dir())}
    p = subprocess.run([sys.executable, str(script), str(trace)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert p.returncode == code, p.stderr[-3000:]
    assert "terminate called" not in p.stderr and "Abort" not in p.stderr
    if "first:" in source:
        assert "first:" in p.stdout
    if code == 1:
        assert "RuntimeError: the script failed" in p.stderr
    if name == "ends_with_tracing_on":
        assert trace.exists() and trace.stat().st_size > 0  # the spans were exported
