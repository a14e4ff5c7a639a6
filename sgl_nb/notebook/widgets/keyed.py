"""A view that sends what changed: a keyed tree of rows (the stepper's Nodes, the cache
tree's nodes, the variables, the call stack's frames).

The Python side keeps what the front end has (`Item` by key). `show(items)` compares and
sends one custom message with only the rows that changed, the keys removed, and the new
order of the parents whose children changed; an unchanged render sends nothing. A view
opening later (a second output, a page reload) asks for everything once ("hello"). When
the owner is done, `freeze()` puts the whole tree in the `snapshot` trait, so a notebook
saved with its widget state shows it without a kernel; from then on a change updates the
snapshot instead of sending a patch (the front end redraws from it, keeping what it can):
the final state goes out as one message, not a patch and then the snapshot. The rows a
view is made with go into `snapshot` too, with the widget's opening, not as a patch. A
click on a row sets `clicked` to its key.
"""

from __future__ import annotations

import html as _html
from dataclasses import dataclass

import anywidget
from traitlets import Int, List, Unicode

_ESM = r"""
function render({ model, el }) {
  const root = document.createElement("div");
  root.className = model.get("root_class");
  el.appendChild(root);
  let nodes = new Map();  // key -> {wrap, row, kids, fold}
  // An item: {k: key, h: its html, p: parent key (absent at the top), f: 1 if it folds,
  // o: 1 if it opens when first drawn, c: classes of its wrapper}.
  function make(item) {
    const wrap = document.createElement(item.f ? "details" : "div");
    const row = document.createElement(item.f ? "summary" : "div");
    const kids = document.createElement("div");
    kids.className = "sgl-kids";
    wrap.appendChild(row);
    wrap.appendChild(kids);
    if (item.f) wrap.open = !!item.o;
    return { wrap, row, kids, fold: !!item.f };
  }
  function set(item) {
    let n = nodes.get(item.k);
    if (!n) {
      n = make(item);
      nodes.set(item.k, n);
    } else if (n.fold !== !!item.f) {  // a leaf that got children, or the reverse
      const m = make(item);
      m.kids.replaceWith(n.kids);
      m.kids = n.kids;
      n.wrap.replaceWith(m.wrap);
      n = m;
      nodes.set(item.k, n);
    }
    n.row.innerHTML = item.h;
    n.wrap.className = "sgl-item " + (item.c || "");
    n.wrap.dataset.key = item.k;
  }
  function place(parent, keys) {
    const box = parent === "" ? root : (nodes.get(parent) || {}).kids;
    if (!box) return;
    for (const k of keys) {
      const n = nodes.get(k);
      if (n) box.appendChild(n.wrap);  // moves an existing row, sends nothing again
    }
  }
  function apply(msg) {
    if (msg.reset) {
      root.replaceChildren();
      nodes = new Map();
    }
    for (const item of msg.set || []) set(item);
    for (const k of msg.del || []) {
      const n = nodes.get(k);
      if (n) n.wrap.remove();
      nodes.delete(k);
    }
    for (const [parent, keys] of Object.entries(msg.order || {})) place(parent, keys);
  }
  function fromSnapshot() {
    const items = model.get("snapshot") || [];
    if (!items.length) return;
    const order = {};
    for (const it of items) (order[it.p || ""] ||= []).push(it.k);
    // Rows it keeps stay where they are, folded or not as the user left them.
    const keep = new Set(items.map((it) => it.k));
    apply({ set: items, del: [...nodes.keys()].filter((k) => !keep.has(k)), order });
  }
  root.addEventListener("click", (e) => {  // a click on a row names it to the kernel
    const target = e.target.closest("[data-key]");
    if (!target || e.target.closest("summary")) return;  // a summary only folds
    if (model.get("clicked") === target.dataset.key) model.set("clicked", "");
    model.set("clicked", target.dataset.key);
    model.save_changes();
  });
  fromSnapshot();
  model.on("change:snapshot", fromSnapshot);
  model.on("msg:custom", apply);
  try {
    model.send({ hello: true });  // the kernel, if any, answers with everything it has
  } catch (e) {
    // no kernel (a saved notebook): the snapshot is all there is
  }
}
export default { render };
"""


@dataclass(frozen=True)
class Item:
    """One row: `key` unique in the view, `parent` the key of the row it nests under ("" at
    the top), `html` its own markup, `fold` a collapsible row (<details>), `open` whether it
    opens when first drawn, `cls` extra classes on its wrapper."""

    key: str
    html: str
    parent: str = ""
    fold: bool = False
    open: bool = False
    cls: str = ""

    def as_dict(self) -> dict:
        """What the front end gets: short names, defaults left out (sent on every change)."""
        d = {"k": self.key, "h": self.html}
        if self.parent:
            d["p"] = self.parent
        if self.fold:
            d["f"] = 1
        if self.open:
            d["o"] = 1
        if self.cls:
            d["c"] = self.cls
        return d


class KeyedView(anywidget.AnyWidget):
    _esm = _ESM
    root_class = Unicode("").tag(sync=True)
    snapshot = List().tag(sync=True)  # the whole tree, set by freeze() (saved notebooks)
    clicked = Unicode("").tag(sync=True)  # the key of the row the user clicked last
    patches = Int(0)  # messages sent so far (not synced: for tests and the curious)
    rows_sent = Int(0)  # rows sent so far, over all messages

    def __init__(self, root_class: str = "", items: list[Item] = (), **kwargs):
        super().__init__(root_class=root_class, snapshot=[it.as_dict() for it in items],
                         **kwargs)
        self._items: dict[str, Item] = {it.key: it for it in items}  # the front end's, in order
        self._frozen = False
        self.on_msg(self._on_front_end)
        self.last_patch: dict = {}
        self.sent: list[dict] = []  # the patches sent, newest last (the last 1,000 at most)

    @property
    def items(self) -> list[Item]:
        return list(self._items.values())

    def show(self, items: list[Item]) -> dict:
        """Make the front end show exactly `items` (in order); sends only the difference.
        Returns the patch sent ({} when nothing changed)."""
        new = {it.key: it for it in items}
        changed = [it for it in items if self._items.get(it.key) != it]
        gone = [k for k in self._items if k not in new]
        order: dict[str, list[str]] = {}
        old_kids, new_kids = _children(self._items.values()), _children(items)
        for parent, keys in new_kids.items():
            if old_kids.get(parent) != keys:
                order[parent] = keys
        self._items = new
        patch = {}
        if changed:
            patch["set"] = [it.as_dict() for it in changed]
        if gone:
            patch["del"] = gone
        if order:
            patch["order"] = order
        if patch and self._frozen:
            self.snapshot = [it.as_dict() for it in items]
        elif patch:
            self.send(patch)
            self.sent.append(patch)
            if len(self.sent) > 1000:
                del self.sent[:500]
            self.patches += 1
            self.rows_sent += len(changed)
        self.last_patch = patch
        return patch

    def freeze(self) -> None:
        """Put the whole tree in the synced state (the final view, kept when saved); what
        `show()` changes from now on goes there too, not in a patch. Freeze before the
        final `show()`, inside the owner's hold_sync: the final rows and the snapshot are
        then one message."""
        self._frozen = True
        self.snapshot = [it.as_dict() for it in self._items.values()]

    def _on_front_end(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and content.get("hello"):
            items = self.items
            self.send({"reset": True, "set": [it.as_dict() for it in items],
                       "order": _children(items)})

    def html(self) -> str:
        """The markup the front end builds from the rows (static output, tests)."""
        kids = _children(self._items.values())

        def build(key: str) -> str:
            it = self._items[key]
            inner = "".join(build(k) for k in kids.get(key, []))
            cls = _html.escape(f"sgl-item {it.cls}".strip())
            if it.fold:
                opened = " open" if it.open else ""
                return (f'<details class="{cls}"{opened} data-key="{_html.escape(key)}">'
                        f'<summary>{it.html}</summary><div class="sgl-kids">{inner}</div>'
                        "</details>")
            return (f'<div class="{cls}" data-key="{_html.escape(key)}"><div>{it.html}</div>'
                    f'<div class="sgl-kids">{inner}</div></div>')

        body = "".join(build(k) for k in kids.get("", []))
        css = getattr(self, "_css", "")
        style = f"<style>{css}</style>" if css else ""
        return f'{style}<div class="{_html.escape(self.root_class)}">{body}</div>'


def _children(items) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for it in items:
        out.setdefault(it.parent, []).append(it.key)
    return out
