"""The stream view sends what changed: real programs on the real model, the messages its comm
publishes recorded as they go (outside a kernel ipywidgets' comm is the `comm` package's
DummyComm, which publishes nowhere), then applied in order as the front end applies them.

They add up to the program's text; a lane a fork branch; origins as the engine reported
them; the bytes grow linearly with the tokens; the traits are synced once, at the end. The
front end itself (stream.js) runs in Debian's Chromium on the same recorded messages. The
bench (`sgl-nb bench views`) runs on a real Jupyter kernel."""

from __future__ import annotations

import ast
import html
import json
import re
from pathlib import Path

import pytest
from support.waits import WAIT, until

import sgl_nb as sgl
from sgl_nb.cli import main
from sgl_nb.notebook.widgets import ProgramWidget, stream_model
from sgl_nb.notebook.widgets.stream import StreamView
from sgl_nb.notebook.widgets.stream_model import StreamModel
from sgl_nb.tracing.timeline import Timeline

slow = pytest.mark.slow
STREAM_JS = Path(sgl.__file__).parent / "notebook" / "widgets" / "stream.js"
CHROMIUM = "/usr/bin/chromium"


class Wire:
    """Every message the view's comm publishes, with its bytes as the kernel would send them
    (the content: comm id and data, as JSON)."""

    def __init__(self, view):
        self.view, self.sent = view, []
        comm, publish = view.comm, view.comm.publish_msg

        def record(msg_type, data=None, metadata=None, buffers=None, **keys):
            self.sent.append(data)
            return publish(msg_type, data=data, metadata=metadata, buffers=buffers, **keys)

        comm.publish_msg = record

    @property
    def bytes(self) -> int:
        cid = self.view.comm.comm_id
        return sum(len(json.dumps({"comm_id": cid, "data": d}, ensure_ascii=False).encode())
                   for d in self.sent)

    def custom(self) -> list[dict]:
        return [d["content"] for d in self.sent if d.get("method") == "custom"]

    def updates(self) -> list[dict]:
        return [d["state"] for d in self.sent if d.get("method") == "update"]


class Front:
    """What stream.js does with the messages, without the DOM."""

    def __init__(self, messages=()):
        self.root, self.lanes, self.nodes, self.stats = None, {}, {}, {}
        for m in messages:
            self.apply(m)

    def apply(self, m: dict) -> None:
        if m.get("t") == "f":
            self.__init__()
        if m.get("root") is not None:
            self.root = m["root"]
        self.nodes.update({int(k): v for k, v in m.get("n", {}).items()})
        for lane, at, items in m.get("l", []):
            have = self.lanes.setdefault(lane, [])
            assert len(have) >= at, f"lane {lane}: a delta at {at}, the front end has {len(have)}"
            del have[at:]
            have.extend(items)
        self.stats.update(m.get("s", {}))

    def pieces(self, lane: int) -> list[list]:
        return [it for it in self.lanes[lane] if isinstance(it, list)]

    def text(self, lane: int) -> str:
        return "".join(it[0] for it in self.pieces(lane))


def watch(runtime, fn, **kwargs):
    """What %%sgl does (the widget first, then the program), the stream's comm recorded."""
    w = ProgramWidget(runtime, title=fn.__name__)
    wire = Wire(w.stream)
    st = fn.run(stream=True, debug=True, **kwargs)
    w.attach(st)
    return w, st, wire


@sgl.function
def qa(s, q, n=24):
    s += sgl.user(q)
    s += sgl.assistant(sgl.gen("answer", max_tokens=n, ignore_eos=True))


@sgl.function
def long(s, n):
    s += "Once upon a time"
    s += sgl.gen("story", max_tokens=n, ignore_eos=True)


@sgl.function
def slogans(s):
    s += "Two slogans for a bakery:"
    forks = s.fork(2)
    forks += lambda i: f"\nSlogan {i + 1}:"
    forks += sgl.gen("slogan", max_tokens=6, ignore_eos=True)
    forks.join()
    s += "\nDone."


@slow
def test_the_deltas_add_up_to_the_text_and_the_traits_sync_once(default_backend):
    w, st, wire = watch(default_backend, qa, q="Tell me about bread.", n=48)
    assert w.wait(WAIT), "the widget never made its final render"
    view, sent = w.stream, wire.custom()
    assert len(sent) >= 2 and all("t" not in m for m in sent)  # deltas, no "full" one
    front = Front(sent)
    assert front.text(st.id) == st.text() == view.text
    # The generated text was sent once; only the prompt may go again (recoloured when the
    # gen's cache hit arrives), never the whole text on every render.
    pieces = "".join(it[0] for m in sent for _l, _at, items in m.get("l", [])
                     for it in items if isinstance(it, list))
    prompt = len(st.text()) - len(st["answer"]) - len("<|im_end|>\n")
    assert len(st.text()) <= len(pieces) <= len(st.text()) + prompt
    # The counts went out with the deltas; the traits once, at the end, with the snapshot.
    assert front.stats["g"] == 48 and front.stats["status"] == "done"
    synced = [u for u in wire.updates() if "text" in u]
    assert len(synced) == 1 and synced[0]["text"] == st.text()
    assert synced[0]["generated_tokens"] == 48 and synced[0]["snapshot"]["final"] is True
    assert not any("generated_tokens" in u for u in wire.updates() if u is not synced[0])
    # The snapshot is the whole view: a front end that starts from it has the same lanes.
    assert Front([{**view.snapshot, "t": "f"}]).lanes == front.lanes
    # A view that opens later says hello and gets the whole state in one message.
    view.comm.handle_msg({"content": {"data": {"method": "custom",
                                               "content": {"type": "hello"}}},
                          "buffers": []})
    full = wire.custom()[-1]
    assert full["t"] == "f" and Front([full]).lanes == front.lanes
    # The static fallback: the same text, coloured, self-contained.
    static = view.static_html()
    assert static.count("<style>") == 1 and ".sgl-generated{" in static
    body = static.split('class="sgl-stream"')[1]
    spans = re.findall(r'<span class="sgl-(?:template sgl-prompt|prompt|cached|generated|'
                       r'forced|drafted)"[^>]*>([^<]*)</span>', body)
    assert "".join(html.unescape(t) for t in spans) == st.text()
    assert 'data-var="answer"' in static and '<span class="sgl-role">user</span>' in static
    sampled = (r'<span class="sgl-generated" style="background:#dcfce7" '
               r'title="p=[0-9.]+ token \d+" data-node="\d+">')
    drafted = (r'<span class="sgl-drafted" style="background:#cffafe" '
               r'title="p=[0-9.]+ token \d+ \(drafted by prompt lookup\)" data-node="\d+">')
    assert len(re.findall(sampled, static)) + len(re.findall(drafted, static)) == 48


@slow
def test_origins_of_the_pieces(default_backend):
    q = "Name a colour of the rainbow, then say why."
    first, st1, _ = watch(default_backend, qa, q=q, n=8)
    assert first.wait(WAIT)
    w, st, wire = watch(default_backend, qa, q=q, n=8)
    assert w.wait(WAIT)
    front = Front(wire.custom())
    pieces = front.pieces(st.id)
    origins = [it[1] for it in pieces]
    text = st.text()
    gen = next(n for n in st.nodes if n.kind == "Gen")
    generated = [it for it in pieces if it[1] in "gf"]
    # The gen's tokens: one piece each, on its Node, with a probability and the token id
    # (a last token that adds no text to the kept answer shows none).
    tokens = [t.token for t in w.timeline.nodes[gen.id].tokens]
    assert "".join(it[0] for it in generated) == st["answer"] and len(tokens) == 8
    assert [it[4] for it in generated] == tokens[:len(generated)] and len(generated) >= 7
    assert all(it[2] == gen.id and len(it) == 5 and 0.0 <= it[3] <= 1.0
               and isinstance(it[4], int) for it in generated)
    assert front.nodes[gen.id] == ["Gen", "answer", "done"]
    # The second run read its prompt from the radix cache: cached first, and cached pieces
    # all come before the first generated one; nothing before the gen is "generated".
    first_gen = origins.index("g")
    assert "c" in origins[:first_gen] and set(origins[:first_gen]) <= {"c", "p", "t"}
    cached = "".join(it[0] for it in pieces if it[1] == "c")
    assert text.startswith(cached) and len(cached) > 0
    assert w.stream.cached_tokens > 0
    assert all(it[-1].endswith(", cached") for it in pieces if it[1] == "c")


@slow
def test_each_fork_branch_has_its_lane(default_backend):
    w, st, wire = watch(default_backend, slogans)
    assert w.wait(WAIT)
    front = Front(wire.custom())
    root = front.lanes[st.id]
    fork = next(it for it in root if isinstance(it, dict) and it["k"] == "fork")
    assert fork["b"] == w.forks[fork["n"]] and len(fork["b"]) == 2  # in branch order
    for i, lane in enumerate(fork["b"]):
        assert front.text(lane) == f"\nSlogan {i + 1}:{st['slogan'][i]}"
        assert any(it[1] == "g" for it in front.pieces(lane))
    after = root[root.index(fork) + 1:]
    assert any(isinstance(it, dict) and it["k"] == "mark" for it in after)  # the Join
    assert front.text(st.id) == st.text()  # the branches' text is in their lanes
    static = w.stream.static_html()
    assert "branch 0" in static and "branch 1" in static
    assert static.count('data-var="slogan"') == 2


@sgl.function
def stepped(s):
    s += "Count: one, two,"
    s += sgl.gen("n", max_tokens=6, ignore_eos=True)


@slow
def test_a_held_program_shows_every_token_it_has(default_backend):
    """A delta held back by the rate goes out on its own when no render follows (a program
    held by the stepper renders no more)."""
    w, st, wire = watch(default_backend, stepped, step=True, passes=())
    debug = st.debug
    assert debug.wait_until_held(WAIT)
    debug.breakpoint(name="n")
    debug.continue_()
    assert debug.wait_until_held(WAIT)
    for _ in range(2):  # the prefill (the first token), then one decode step
        debug.step_instruction()
        assert debug.wait_until_held(WAIT)
    w.sync()
    assert w.stream.generated_tokens == 2
    until(lambda: Front(wire.custom()).text(st.id) == w.stream.text, "the held-back delta")
    front = Front(wire.custom())
    assert front.text(st.id) == w.stream.text and front.text(st.id).startswith("Count:")
    assert front.stats["g"] == 2
    debug.continue_()
    assert w.wait(WAIT)
    assert Front(wire.custom()).text(st.id) == st.text()


@slow
def test_a_delta_held_back_by_the_rate_still_goes_out(default_backend):
    """Renders faster than the view's rate, then none (a held program, a pause in the
    tokens): what the last render changed goes out on its own, within an interval or so."""
    w, st, _ = watch(default_backend, long, n=20)
    assert w.wait(WAIT)
    # One delta a second (three for a token or two): far slower than the renders below
    # come, however slow or busy the machine.
    view = StreamView(rate=1.0)
    wire = Wire(view)
    tl = Timeline()
    for e in w.timeline.events:  # the real run's events, folded again, a render a token
        tl.apply(e)
        if e.kind == "token":
            model = StreamModel(tl, st.id, forks=w.forks)
            view.update(model, "running")
    assert len(wire.custom()) < 20  # renders came faster than the rate: merged
    until(lambda: Front(wire.custom()).text(st.id) == model.text(), "the held-back delta")
    assert view.generated_tokens == 20
    assert wire.updates() == []  # still running: no trait went out


@sgl.function
def fails(s):
    s += "Say hi:" + sgl.gen("hi", max_tokens=3, ignore_eos=True)
    raise ValueError("boom" + " in the cell")  # its line, shown with it, does not repeat it


@slow
def test_an_error_shows_once_under_the_header_and_in_the_text(default_backend):
    w, st, wire = watch(default_backend, fails)
    assert w.wait(WAIT)
    assert isinstance(st.error(), ValueError)
    front = Front(wire.custom())
    assert front.stats["status"] == "error"
    extras = [m["x"] for m in wire.custom() if "x" in m]
    assert len(extras) == 1 and extras[0].count("boom in the cell") == 1
    assert w.stream.header.value.count("boom in the cell") == 1  # not once a render
    assert any(isinstance(it, dict) and it["k"] == "perr" and "boom" in it["t"]
               for it in front.lanes[st.id])
    assert w.stream.snapshot["x"] == extras[0] and "boom in the cell" in w.stream.static_html()


@slow
def test_the_bytes_grow_linearly_with_the_tokens(default_backend):
    sizes = {}
    for n in (100, 200):
        w, st, wire = watch(default_backend, long, n=n)
        assert w.wait(WAIT) and w.stream.generated_tokens == n
        sizes[n] = wire.bytes
        p = w.timeline.programs[st.id]
        seconds = (p.end_ns - p.start_ns) / 1e9
        print(f"{n} tokens: {wire.bytes} bytes, {len(wire.sent)} messages in {seconds:.1f} s "
              f"({wire.bytes / n:.0f} bytes a token)")
        assert wire.bytes / n < 300
        # At most 10 deltas a second (the view's rate), the final one and the final state.
        assert len(wire.custom()) <= 10 * seconds + 2 and len(wire.updates()) == 1
    assert sizes[200] < 2.5 * sizes[100]


def _browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (make test installs Debian's chromium)")
    from playwright.sync_api import sync_playwright

    return sync_playwright()


# A stand-in for anywidget's model in the page: traits in `state`, handlers by event name,
# what the view sends and sets recorded.
PAGE = """
async ([src, state]) => {
  const mod = await import(URL.createObjectURL(new Blob([src], {type: "text/javascript"})));
  const handlers = {};
  window.sent = []; window.saved = [];
  const model = {
    get: (k) => state[k], set: (k, v) => { state[k] = v; },
    save_changes: () => window.saved.push(JSON.stringify(state.clicked_node)),
    send: (m) => window.sent.push(m),
    on: (e, f) => { (handlers[e] ??= []).push(f); }, off: () => {},
  };
  window.emit = (e, m) => (handlers[e] ?? []).forEach((f) => f(m));
  const el = document.createElement("div");
  document.body.appendChild(el);
  mod.default.render({model, el});
}
"""

# The text of a lane's pieces: the root's (branches left out), or branch i's.
PIECES = """(i) => [...(i === null ? document.querySelector(".sgl-stream")
                                   : document.querySelectorAll(".sgl-branch")[i])
  .querySelectorAll(".sgl-prompt, .sgl-cached, .sgl-generated, .sgl-forced")]
  .filter((s) => i !== null || !s.closest(".sgl-branch"))
  .map((s) => s.textContent).join("")"""


@slow
def test_the_front_end_draws_the_deltas(default_backend):
    w, st, wire = watch(default_backend, slogans)
    assert w.wait(WAIT)
    view = w.stream
    sent, snapshot = wire.custom(), view.snapshot
    src = STREAM_JS.read_text()
    with _browser() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu"],
                                    timeout=WAIT * 1000)
        page = browser.new_page()
        page.set_default_timeout(WAIT * 1000)
        # A view opened while the program runs asks for everything, then takes deltas.
        page.evaluate(PAGE, [src, {"snapshot": {}, "clicked_node": None}])
        assert page.evaluate("window.sent") == [{"type": "hello"}]
        for m in sent:
            page.evaluate("(m) => window.emit('msg:custom', m)", m)
        assert page.evaluate(PIECES, None) == st.text()
        assert page.locator(".sgl-branch").count() == 2
        for i, slogan in enumerate(st["slogan"]):
            assert page.evaluate(PIECES, i) == f"\nSlogan {i + 1}:{slogan}"
        assert "done" in page.locator(".sgl-head").inner_text()
        # The same deltas again (each cuts its lane back to `at`), then the whole state (the
        # answer to a hello): nothing changes.
        view.comm.handle_msg({"content": {"data": {"method": "custom",
                                                   "content": {"type": "hello"}}},
                              "buffers": []})
        for m in [*sent[-4:], wire.custom()[-1]]:
            page.evaluate("(m) => window.emit('msg:custom', m)", m)
        assert page.evaluate(PIECES, None) == st.text()
        assert page.evaluate(PIECES, 0) == f"\nSlogan 1:{st['slogan'][0]}"
        # A click on a token says which Node it belongs to.
        token = page.locator(".sgl-stream .sgl-generated").first
        node = int(token.get_attribute("data-node"))
        token.click()
        assert page.evaluate("window.saved") == [str(node)]
        # A view opened after the end draws the snapshot and asks nothing.
        page2 = browser.new_page()
        page2.evaluate(PAGE, [src, {"snapshot": snapshot, "clicked_node": None}])
        assert page2.evaluate("window.sent") == []
        assert page2.evaluate(PIECES, None) == st.text()
        assert page2.evaluate(PIECES, 1) == f"\nSlogan 2:{st['slogan'][1]}"
        browser.close()


@slow
def test_the_views_bench_in_a_real_kernel(model_path, tmp_path):
    out = tmp_path / "views.json"
    assert main(["bench", "views", "--model", str(model_path), "--tokens", "160",
                 "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())
    assert row["generated"] == 160 and row["status"] == "done"
    assert row["stream_bytes_per_token"] < 300
    # At most 30 renders a second, one message each, and the final render's.
    assert row["stream_msgs"] > 0 and row["stream_peak_msgs_in_1s"] <= 30 + 2
    assert row["comm_msg"] > 0 and row["total_bytes"] > row["stream_bytes"]


def test_the_model_is_plain_python():
    """The stream's model (what a replay and the TUI could build too) needs no widget."""
    path = Path(stream_model.__file__)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"ipywidgets", "anywidget", "traitlets", "IPython"}, imported

