"""The radix tree as the events tell it: a fold of the tree's own events (CacheNodeAdded,
CacheNodeSplit, CacheNodesHit, CacheNodeLocked, CacheNodesEvicted) into nodes, their edges'
tokens and text, hit counts, locks, and the figures RadixCache.stats gives. A live view and
a replay fold the same events, so both draw the same tree. It reads like a RadixCache (a
`root` whose `children` are keyed by their first token, `stats()`), so one renderer serves
both. No threads, no I/O."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from sgl_nb.runtime.events import (
    CacheNodeAdded,
    CacheNodeLocked,
    CacheNodesEvicted,
    CacheNodesHit,
    CacheNodeSplit,
    Event,
)


@dataclass(eq=False)
class CacheNode:
    id: int
    key: tuple[int, ...] = ()  # the edge's token ids
    text: str | None = None  # the edge decoded (None: the events did not say)
    parent: CacheNode | None = None
    children: dict[int, CacheNode] = field(default_factory=dict)  # by the child's key[0]
    hit_count: int = 0
    lock_ref: int = 0  # locks on it and on its descendants, as RadixCache counts them


class CacheTree:
    """`apply` the tree's events in order; what was there before the first one is unknown
    (a live view folds RadixCache.snapshot first)."""

    def __init__(self) -> None:
        self.root = CacheNode(-1)
        self.by_id: dict[int, CacheNode] = {}
        self.queried_tokens = 0
        self.matched_tokens = 0
        self.evicted_tokens = 0
        self.changes = 0  # events applied: a view redraws when it moves

    def apply(self, e: Event) -> None:
        self.changes += 1
        match e:
            case CacheNodeAdded():
                self._add(e)
            case CacheNodeSplit():
                self._split(e)
            case CacheNodesHit():
                self.queried_tokens += e.queried
                self.matched_tokens += e.matched
                for nid in e.tree_nodes:
                    if (n := self.by_id.get(nid)) is not None:
                        n.hit_count += 1
            case CacheNodeLocked():
                n = self.by_id.get(e.tree_node)
                while n is not None and n is not self.root:
                    n.lock_ref += e.delta
                    n = n.parent
            case CacheNodesEvicted():
                self._evict(e)

    # A change the tree already shows (a view's snapshot taken after the event was
    # queued) is skipped: each fold below checks for it.

    def _add(self, e: CacheNodeAdded) -> None:
        parent = self.root if e.parent is None else self.by_id.get(e.parent)
        if e.tree_node in self.by_id or parent is None or not e.key:
            return
        n = CacheNode(e.tree_node, tuple(e.key), e.text, parent, hit_count=e.hits,
                      lock_ref=e.lock_ref)
        parent.children[n.key[0]] = n
        self.by_id[n.id] = n

    def _split(self, e: CacheNodeSplit) -> None:
        child = self.by_id.get(e.tree_node)
        if child is None or e.upper in self.by_id or not 0 < e.cut < len(child.key):
            return
        parent = child.parent
        upper = CacheNode(e.upper, child.key[:e.cut], e.text, parent,
                          hit_count=child.hit_count, lock_ref=child.lock_ref)
        upper.children[child.key[e.cut]] = child
        parent.children[child.key[0]] = upper  # the same slot: siblings keep their order
        child.key, child.text, child.parent = child.key[e.cut:], e.rest_text, upper
        self.by_id[upper.id] = upper

    def _evict(self, e: CacheNodesEvicted) -> None:
        for nid in e.tree_nodes:
            n = self.by_id.pop(nid, None)
            if n is not None and n.parent is not None:
                n.parent.children.pop(n.key[0], None)
                n.parent = None
        self.evicted_tokens += e.tokens
        if e.reset:
            self.queried_tokens = self.matched_tokens = self.evicted_tokens = 0

    # ---- reading -----------------------------------------------------------------------

    def nodes(self) -> Iterator[CacheNode]:
        """Every node but the root, parents before their children."""
        stack = list(reversed(self.root.children.values()))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children.values()))

    def stats(self) -> dict:
        """RadixCache.stats' figures, as the events tell them."""
        cached = protected = nodes = 0
        for n in self.nodes():
            nodes += 1
            cached += len(n.key)
            protected += len(n.key) if n.lock_ref > 0 else 0
        q, m = self.queried_tokens, self.matched_tokens
        return {"queried_tokens": q, "matched_tokens": m, "hit_rate": m / q if q else 0.0,
                "nodes": nodes, "cached_tokens": cached, "evictable_tokens": cached - protected,
                "protected_tokens": protected, "evicted_tokens": self.evicted_tokens}

    def shape(self) -> list[tuple]:
        """(id, parent id, key, hits, locks) of every node, parents first: what two folds
        must agree on to draw the same tree."""
        return [(n.id, n.parent.id, n.key, n.hit_count, n.lock_ref) for n in self.nodes()]

    def format_tree(self, decode: Callable[[list[int]], str] | None = None, max_depth: int = 8,
                    max_tokens: int = 16) -> str:
        """Readable multi-line tree, as RadixCache.format_tree draws it. Edges show text
        (decoded with `decode` when given, else as the events carried it), or token ids
        when neither is known; edges longer than max_tokens are elided."""
        s = self.stats()
        lines = [f"root  nodes={s['nodes']} cached={s['cached_tokens']} "
                 f"evictable={s['evictable_tokens']} protected={s['protected_tokens']} "
                 f"hit_rate={s['hit_rate']:.1%}"]
        stack = _child_rows(self.root, "", 1)
        while stack:
            node, indent, last, depth = stack.pop()
            lines.append(f"{indent}{'└── ' if last else '├── '}"
                         f"{_edge_label(node, decode, max_tokens)}")
            indent += "    " if last else "│   "
            if depth >= max_depth and node.children:
                lines.append(f"{indent}… {_count(node) - 1} more nodes")
            else:
                stack.extend(_child_rows(node, indent, depth + 1))
        return "\n".join(lines)


def snapshot_events(cache) -> list[Event]:
    """The events that build a RadixCache's tree as it is now (its `snapshot`), for a view
    that starts listening after the tree has grown; [] for None (no local cache)."""
    if cache is None:
        return []
    for _ in range(3):  # the engine thread may change the tree while it is read
        try:
            return cache.snapshot()
        except RuntimeError:
            continue
    return []


def tree_now(cache) -> CacheTree:
    """A RadixCache's tree folded from its snapshot: what a one-off view prints."""
    tree = CacheTree()
    for e in snapshot_events(cache):
        tree.apply(e)
    return tree


def _count(node: CacheNode) -> int:
    stack, n = [node], 0
    while stack:
        n += 1
        stack.extend(stack.pop().children.values())
    return n


def _child_rows(node: CacheNode, indent: str, depth: int) -> list[tuple]:
    """format_tree's stack entries for node's children, reversed so they pop in order."""
    kids = list(node.children.values())
    return [(c, indent, i == len(kids) - 1, depth) for i, c in enumerate(kids)][::-1]


def _edge_label(node: CacheNode, decode, max_tokens: int) -> str:
    toks = list(node.key)
    half = max(1, max_tokens // 2)
    parts = [toks] if len(toks) <= max_tokens else [toks[:half], toks[-half:]]
    if decode is not None:
        text = "…".join(repr(decode(p)) for p in parts)
    elif node.text is not None:
        text = repr(node.text) if len(toks) <= max_tokens else _elide(node.text, max_tokens)
    else:
        text = "[" + " … ".join(" ".join(map(str, p)) for p in parts) + "]"
    lock = f" lock={node.lock_ref}" if node.lock_ref else ""
    return f"{text}  #{node.id} len={len(toks)}{lock} hits={node.hit_count}"


def _elide(text: str, max_tokens: int) -> str:
    """A long edge's text, its middle cut (the token boundaries are not known here)."""
    half = max(1, max_tokens * 2)  # about four characters a token
    if len(text) <= 2 * half:
        return repr(text)
    return f"{text[:half]!r}…{text[-half:]!r}"
