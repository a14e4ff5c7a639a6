"""The cache tree: the radix tree as its events tell it (tracing/cache_tree.py's CacheTree,
folded by the Timeline, so a live run and a replay draw it the same way), each edge's text
decoded, its hit count, locked (in use by a running request) or evictable, and the path of
this program's text highlighted. Nested <details> collapse, the box scrolls, and past
`max_nodes` the rest is summarised (this program's path and the nodes in use come first,
so they are never the ones cut), so a long tree stays readable. One row per tree node
(keyed.py): a render sends only the nodes whose text, hits, lock or children changed."""

from __future__ import annotations

import html

import ipywidgets as W
from traitlets import Float, Int, List

from sgl_nb.notebook.widgets.keyed import Item, KeyedView
from sgl_nb.runtime.radix_cache import common_prefix_len

_CSS = """
.sgl-cache{font-family:monospace;font-size:12px;max-height:320px;overflow:auto;
 border:1px solid #ddd;padding:4px}.sgl-cache .sgl-kids{margin-left:14px}
.sgl-cache summary,.sgl-cache .sgl-leaf{white-space:pre}.sgl-cache .sgl-leaf{margin-left:12px}
.sgl-edge{background:#f3f4f6}.sgl-onpath>summary .sgl-edge,.sgl-leaf.sgl-onpath .sgl-edge{
 background:#fde68a;font-weight:bold}.sgl-locked{color:#b91c1c}.sgl-evictable{color:#15803d}
.sgl-meta{color:#666;font-size:11px}
"""


def path_nodes(root, tokens: list[int]) -> list[int]:
    """Ids of the tree nodes a token sequence runs through (read-only: no split, no stats)."""
    out, node, pos, tokens = [], root, 0, tuple(tokens)  # keys are tuples
    while pos < len(tokens):
        child = node.children.get(tokens[pos])
        if child is None:
            break
        key = child.key
        n = common_prefix_len(key, tokens[pos:pos + len(key)])
        out.append(child.id)
        if n < len(key):
            break
        node, pos = child, pos + n
    return out


class TreeItems:
    """The rows of a CacheTree (or anything that reads like a RadixCache): a head line of
    figures, then one row per tree node nested under its parent; `decode` turns a node's
    edge into text (memoised by the caller)."""

    def __init__(self, decode, on_path: set[int], max_nodes: int = 300, edge_chars: int = 48,
                 open_depth: int = 1):
        self.decode, self.on_path = decode, on_path
        self.max_nodes, self.edge_chars, self.open_depth = max_nodes, edge_chars, open_depth
        self.count = 0

    def items(self, cache) -> list[Item]:
        s = cache.stats()
        out = [Item("head", f'<div class="sgl-meta">{s["nodes"]} nodes · {s["cached_tokens"]} '
                            f'tokens cached ({s["protected_tokens"]} locked, '
                            f'{s["evictable_tokens"]} evictable) · hit rate {s["hit_rate"]:.1%}'
                            f' · evicted {s["evicted_tokens"]}</div>')]
        kids = self._first_what_matters(_children(cache.root))
        for c in kids:
            self._node(c, "", 0, out)
        if not kids:
            out.append(Item("empty", "(empty)"))
        rest = s["nodes"] - self.count
        if rest > 0:
            out.append(Item("more", f'<div class="sgl-meta">… {rest} more nodes</div>'))
        return out

    def _node(self, node, parent: str, depth: int, out: list[Item]) -> None:
        if self.count >= self.max_nodes:
            return
        self.count += 1
        kids = self._first_what_matters(_children(node))
        on = node.id in self.on_path
        key = f"c{node.id}"
        label = f'<span data-node="{node.id}">{self._label(node)}</span>'
        cls = "sgl-onpath" if on else ""
        if not kids:
            out.append(Item(key, label, parent, cls=f"sgl-leaf {cls}".strip()))
            return
        out.append(Item(key, label, parent, fold=True, open=on or depth < self.open_depth,
                        cls=cls))
        for c in kids:
            self._node(c, key, depth + 1, out)

    def _first_what_matters(self, kids: list) -> list:
        """This program's path first, then nodes in use (a lock holds its ancestors too),
        then the rest: past max_nodes what is cut is what no one is using."""
        return sorted(kids, key=lambda n: (n.id not in self.on_path, n.lock_ref == 0))

    def _label(self, node) -> str:
        text = self.decode(node)
        short = text if len(text) <= self.edge_chars else text[: self.edge_chars - 1] + "…"
        lock = (f'<span class="sgl-locked">locked×{node.lock_ref}</span>' if node.lock_ref
                else '<span class="sgl-evictable">evictable</span>')
        return (f'<span class="sgl-edge" title="{html.escape(text)}">{html.escape(repr(short))}'
                f'</span> <span class="sgl-meta">{len(node.key)} tok · hits {node.hit_count}'
                f'</span> {lock}')


def _children(node) -> list:
    # The engine thread may add a child while we read: copy first, retry once.
    for _ in range(3):
        try:
            return list(node.children.values())
        except RuntimeError:
            continue
    return []


class CacheTreeGraph(KeyedView):
    """The tree itself: a node whose hits, lock or children changed is the only row sent
    (with its new children); the rest of the tree stays as the front end has it."""

    _css = _CSS

    def __init__(self, **kwargs):
        super().__init__(root_class="sgl-cache", **kwargs)


class CacheTreeView(W.VBox):
    nodes = Int(0).tag(sync=True)
    cached_tokens = Int(0).tag(sync=True)
    locked_tokens = Int(0).tag(sync=True)
    evictable_tokens = Int(0).tag(sync=True)
    hit_rate = Float(0.0).tag(sync=True)
    path = List(Int()).tag(sync=True)  # tree node ids on this program's path

    def __init__(self, max_nodes: int = 300, **kwargs):
        self.max_nodes = max_nodes
        self._decoded: dict[tuple, str] = {}
        # Classes given at construction go with the widget's opening, not as an update.
        self.tree = CacheTreeGraph(_dom_classes=["sgl-cache-view"])
        super().__init__(children=[self.tree], **kwargs)

    def update(self, cache, tokenizer, program_tokens: list[int] | None = None) -> None:
        """Set every trait from the tree (a Timeline's cache_tree) as it is now; call inside
        hold_sync. None: the backend has no local radix cache."""
        if cache is None:
            self.tree.show([Item("none", "<i>this backend has no local radix cache</i>")])
            return
        self.path = path_nodes(cache.root, program_tokens or [])
        view = TreeItems(lambda node: self._decode(tokenizer, node), set(self.path),
                         self.max_nodes)
        try:
            self.tree.show(view.items(cache))
        except RuntimeError:  # the tree changed under us; the next render catches up
            return
        s = cache.stats()
        self.nodes, self.cached_tokens = s["nodes"], s["cached_tokens"]
        self.locked_tokens, self.evictable_tokens = s["protected_tokens"], s["evictable_tokens"]
        self.hit_rate = round(s["hit_rate"], 4)

    def _decode(self, tokenizer, node) -> str:
        """The edge's text as its events carried it (the engine decoded it), else decoded
        here, else its token ids."""
        key, text = node.key, getattr(node, "text", None)
        if text is not None:
            return text
        if tokenizer is None:
            return str(list(key))
        text = self._decoded.get(key)
        if text is None:
            text = tokenizer.decode(list(key))
            if len(self._decoded) > 4096:
                self._decoded.clear()
            self._decoded[key] = text
        return text

    def widgets(self) -> list:
        return [self, self.tree]
