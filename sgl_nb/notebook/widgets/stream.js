// The stream view's front end (anywidget): it appends what the kernel sends.
//
// Messages from the kernel (see stream.py for the items):
//   {root, l: [[lane, at, items], ...], n: {node: [kind, name, status]}, s: {...}, x}
//     a delta: each lane keeps its first `at` items and gets `items` after them;
//   {t: "f", ...the same keys}: the whole state (the answer to our "hello"); it replaces ours.
// The `snapshot` trait holds the whole state once the run has ended (a saved notebook, a
// view opened later); before that a new view asks for it with {type: "hello"}.
//   {type: "why", node, index, top: [[rank, text, p, masked, taken], ...], ...}: the answer
//     to our {type: "why", node, index} (a click on a token), shown under the stream.

const ORIGIN = {
  p: "prompt", c: "cached", g: "generated", f: "forced", d: "drafted", t: "template",
};
const TITLE_NOTE = { f: " (forced by the grammar)", d: " (drafted by prompt lookup)" };

function span(cls, text) {
  const s = document.createElement("span");
  if (cls) s.className = cls;
  s.textContent = text;
  return s;
}

function pieceTitle(it) {
  if (it.length >= 6 && it[5]) return it[5];
  if (it.length >= 5) {
    const p = it[3] === null || it[3] === undefined ? "p=?" : `p=${it[3].toFixed(3)}`;
    return `${p} token ${it[4]}` + (TITLE_NOTE[it[1]] ?? "");
  }
  return "";
}

function header(stats, extra) {
  const h = document.createElement("div");
  h.className = "sgl-head";
  const b = document.createElement("b");
  b.textContent = stats.status ?? "waiting";
  h.appendChild(b);
  const forced = stats.f ? ` (${stats.f} forced)` : "";
  h.appendChild(document.createTextNode(
    ` · prompt ${stats.p ?? 0} tokens (${stats.c ?? 0} cached) · generated ${stats.g ?? 0}` +
    `${forced} · ${(stats.r ?? 0).toFixed(1)} tok/s`));
  if (extra) {
    const x = document.createElement("span");
    x.innerHTML = extra;  // HTML the kernel escaped (the program's error)
    h.appendChild(x);
  }
  return h;
}

class Stream {
  constructor(el, model) {
    this.model = model;
    this.head = document.createElement("div");
    const legend = document.createElement("div");
    legend.className = "sgl-legend";
    for (const o of ["prompt", "cached", "generated", "forced", "drafted"]) {
      legend.appendChild(span(`sgl-${o}`, o));
    }
    this.body = document.createElement("div");
    this.body.className = "sgl-stream";
    this.whyEl = document.createElement("div");
    this.whyEl.className = "sgl-why";
    this.whyEl.hidden = true;
    el.append(this.head, legend, this.body, this.whyEl);
    this.reset();
  }

  // Which token of its Node a piece is (what the kernel's Timeline indexes), or -1.
  tokenIndex(target) {
    if (target.dataset.tok === undefined) return -1;
    const same = this.body.querySelectorAll(`[data-node="${target.dataset.node}"][data-tok]`);
    return Array.prototype.indexOf.call(same, target);
  }

  askWhy(target) {
    const index = this.tokenIndex(target);
    if (index < 0) return;
    for (const s of this.body.querySelectorAll(".sgl-why-on")) s.classList.remove("sgl-why-on");
    target.classList.add("sgl-why-on");
    this.model.send({ type: "why", node: Number(target.dataset.node), index });
  }

  closeWhy() {
    this.whyEl.hidden = true;
    for (const s of this.body.querySelectorAll(".sgl-why-on")) s.classList.remove("sgl-why-on");
  }

  why(msg) {
    const close = document.createElement("button");
    close.className = "sgl-why-close";
    close.title = "close";
    close.textContent = "×";
    close.addEventListener("click", () => this.closeWhy());
    const rows = msg.error ? [document.createTextNode(msg.error)] : whyBody(msg);
    this.whyEl.replaceChildren(close, ...rows);
    this.whyEl.hidden = false;
  }

  reset() {
    this.body.replaceChildren();
    this.root = null;
    this.lanes = new Map();  // lane id -> {el, items: [[dom nodes], ...]}
    this.nodes = new Map();  // node id -> [kind, name, status]
    this.stats = {};
    this.extra = "";
    this.stale = false;
  }

  lane(id) {
    let lane = this.lanes.get(id);
    if (!lane) {
      const el = document.createElement("span");
      el.className = "sgl-lane";
      el.dataset.lane = id;
      lane = { el, items: [] };
      this.lanes.set(id, lane);
    }
    return lane;
  }

  apply(msg) {
    if (msg.t === "f") this.reset();
    if (msg.root !== undefined && msg.root !== null && this.root !== msg.root) {
      this.root = msg.root;
      this.body.replaceChildren(this.lane(msg.root).el);
    }
    for (const [id, info] of Object.entries(msg.n ?? {})) {
      const old = this.nodes.get(Number(id));
      this.nodes.set(Number(id), info);
      if (old && old[2] !== info[2]) {
        for (const s of this.body.querySelectorAll(`[data-node="${id}"]`)) {
          s.dataset.status = info[2];
        }
      }
    }
    for (const [id, at, items] of msg.l ?? []) {
      const lane = this.lane(id);
      if (lane.items.length < at) {  // we missed a delta: ask for everything once
        this.stale = true;
        continue;
      }
      for (const dead of lane.items.splice(at)) for (const d of dead) d.remove();
      for (const it of items) {
        const dom = this.item(it);
        lane.el.append(...dom);
        lane.items.push(dom);
      }
    }
    if (msg.s) Object.assign(this.stats, msg.s);
    if (msg.x !== undefined) this.extra = msg.x;
    if (msg.s || msg.x !== undefined || msg.t === "f") {
      this.head.replaceChildren(header(this.stats, this.extra));
    }
    if (this.stale) {
      this.stale = false;
      this.model.send({ type: "hello" });
    }
  }

  item(it) {
    if (Array.isArray(it)) {  // a piece: [text, origin, node, p, token, title]
      const origin = ORIGIN[it[1]] ?? "prompt";
      const s = span(origin === "template" ? "sgl-template sgl-prompt" : `sgl-${origin}`, it[0]);
      const title = pieceTitle(it);
      if (title) s.title = title;
      s.dataset.node = it[2];
      if (it.length === 5) s.dataset.tok = it[4] ?? "";  // a generated token: it has a "why"
      const node = this.nodes.get(it[2]);
      if (node) {
        s.dataset.status = node[2];
        if (node[1] && (node[0] === "Gen" || node[0] === "Select")) {
          s.classList.add("sgl-var");
          s.dataset.var = node[1];
        }
      }
      return [s];
    }
    const node = it.n ?? null;
    let s;
    if (it.k === "role") s = span("sgl-role", it.t);
    else if (it.k === "var") s = span("sgl-varname", it.t);
    else if (it.k === "mark") s = span("sgl-mark", it.t);
    else if (it.k === "err") s = span("sgl-error", it.t);
    else if (it.k === "perr") {
      s = document.createElement("div");
      s.className = "sgl-error";
      s.textContent = it.t;
    } else if (it.k === "fork") {
      s = span("sgl-mark", it.t);
      const block = document.createElement("div");
      block.className = "sgl-branches";
      (it.b ?? []).forEach((child, i) => {
        const b = document.createElement("div");
        b.className = "sgl-branch";
        b.append(span("sgl-mark", `branch ${i}`), " ", this.lane(child).el);
        block.appendChild(b);
      });
      if (node !== null) s.dataset.node = node;
      return [s, block];
    } else s = span("", it.t ?? "");
    if (node !== null) s.dataset.node = node;
    return [s];
  }

  draw(snapshot) {
    this.apply({ ...snapshot, t: "f" });
  }
}

function pct(p) {
  return p === null || p === undefined ? "?" : `${(100 * p).toFixed(2)}%`;
}

// The answer's lines: the token, where it came from, then its alternatives (all as text).
function whyBody(m) {
  const grammar = m.allowed >= 0 ? `grammar allowed ${m.allowed} tokens` : "no grammar";
  const head = document.createElement("div");
  const b = document.createElement("b");
  b.textContent = `token ${m.index} of ${m.label}: ${JSON.stringify(m.text)} p=${pct(m.p)}`;
  head.append(b, ` (${m.forced ? "forced" : "sampled"}; ${grammar})`);
  const where = document.createElement("div");
  const cache = m.prompt === null || m.prompt === undefined ? ""
    : ` · cache hit ${m.cached ?? 0}/${m.prompt} prompt tokens`;
  const line = m.line === null || m.line === undefined ? "no line"
    : `line ${m.line}${m.source ? ": " + m.source : ""}`;
  where.textContent = `${line} · ${m.instruction ?? "no instruction"}${cache}`;
  const table = document.createElement("table");
  const tr = (cells, tag) => {
    const r = document.createElement("tr");
    for (const c of cells) {
      const d = document.createElement(tag);
      d.textContent = c;
      r.appendChild(d);
    }
    return table.appendChild(r);
  };
  tr(["rank", "token", "prob", "marks"], "th");
  for (const [rank, text, p, masked, taken] of m.top ?? []) {
    const marks = [masked ? "masked" : "", taken && m.forced ? "forced" : ""];
    const r = tr([rank ?? "-", JSON.stringify(text), pct(p), marks.join(" ").trim()], "td");
    if (taken) r.className = "sgl-why-taken";
    if (masked) r.classList.add("sgl-why-masked");
  }
  if (!(m.top ?? []).length) tr(["", "(no alternatives recorded)", "", ""], "td");
  return [head, where, table];
}

function render({ model, el }) {
  const view = new Stream(el, model);
  const onMsg = (msg) => (msg.type === "why" ? view.why(msg) : view.apply(msg));
  const onSnapshot = () => {
    const snap = model.get("snapshot");
    if (snap && snap.final) view.draw(snap);
  };
  model.on("msg:custom", onMsg);
  model.on("change:snapshot", onSnapshot);
  const snap = model.get("snapshot");
  if (snap && snap.final) view.draw(snap);
  else model.send({ type: "hello" });  // the run goes on: ask for what it has so far
  el.addEventListener("click", (e) => {
    const target = e.target.closest("[data-node]");
    if (!target) return;
    const id = Number(target.dataset.node);
    if (model.get("clicked_node") === id) {  // a second click on it still says so
      model.set("clicked_node", null);
      model.save_changes();
    }
    model.set("clicked_node", id);
    model.save_changes();
    view.askWhy(target);
  });
  return () => {
    model.off("msg:custom", onMsg);
    model.off("change:snapshot", onSnapshot);
  };
}

export default { render };
