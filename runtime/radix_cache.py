"""Radix prefix cache: a tree over token ids whose values are KV slot ids (page size 1).

Ownership of KV slots (the contract callers rely on):
- A slot stored in the tree is owned by the tree. Only `evict` and `reset` give tree slots
  back, through `pool.free`; nothing else in this file frees anything.
- `match_prefix` hands out tree slots for reading; the caller must lock the returned node
  (`inc_lock_ref`) for as long as it uses them, or they may be evicted under it.
- `insert(key, value)` returns `n`; the tree takes over `value[n:]`, and `value[:n]` stays
  with the caller (those tokens were already cached under other slots). A caller that got
  its first `m` slots from `match_prefix` frees `value[m:n]`, the duplicates it allocated.

Invariants (kept by the methods named after them):
1. Every node but the root has a non-empty key, len(node.value) == len(node.key), and
   node.parent.children[node.key[0]] is node (so siblings differ in their first token).
2. A slot id appears at most once in the tree (insert only stores slots it did not have).
3. node.lock_ref == locks taken on node itself + sum of lock_ref over its children; so a
   parent's lock_ref >= any child's, and an unlocked node has an unlocked subtree.
4. evictable_size == tokens in nodes with lock_ref == 0, protected_size == tokens in nodes
   with lock_ref > 0 (the root, empty, counts in neither).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from sgl_nb.runtime.events import (
    CacheNodeAdded,
    CacheNodeLocked,
    CacheNodesEvicted,
    CacheNodesHit,
    CacheNodeSplit,
    Event,
    EventBus,
)

_node_ids = itertools.count()


def _empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(eq=False)
class TreeNode:
    key: tuple[int, ...] = ()
    value: torch.Tensor = field(default_factory=_empty_slots)  # slot ids, one per key token
    parent: TreeNode | None = None  # None for the root and for evicted nodes
    children: dict[int, TreeNode] = field(default_factory=dict)  # keyed by the child's key[0]
    lock_ref: int = 0
    last_access: int = 0  # value of RadixCache's logical clock when last matched or inserted
    hit_count: int = 0
    id: int = field(default_factory=lambda: next(_node_ids))

    def is_leaf(self) -> bool:
        return not self.children


class SlotFreer(Protocol):
    """What the cache needs from the KV pool (KVPool satisfies it)."""

    def free(self, slots: torch.Tensor) -> None: ...


class RadixCache:
    """Prefix cache over token ids. `pool` gets evicted slots back through `pool.free`; with
    pool=None evicted slots are simply dropped (tree-only unit tests). With disable=True the
    tree stays empty: match finds nothing and insert takes nothing (returns len(key))."""

    def __init__(self, pool: SlotFreer | None, disable: bool = False) -> None:
        self.pool = pool
        self.disable = disable
        self.root = TreeNode()
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0  # excluding the root
        self._clock = 0  # logical time: bumped once per match/insert, stored in last_access
        # Where its changes go (the engine's bus) and how an edge becomes text for them;
        # payloads are built only while the bus has listeners.
        self.events: EventBus | None = None
        self.decode: Callable[[list[int]], str] | None = None
        self._reset_stats()

    # ----- sizes and statistics -----

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def stats(self) -> dict[str, Any]:
        q, m = self._queried_tokens, self._matched_tokens
        return {
            "queried_tokens": q,
            "matched_tokens": m,
            "hit_rate": m / q if q else 0.0,
            "nodes": self._num_nodes,
            "cached_tokens": self.total_size(),
            "evictable_tokens": self._evictable,
            "protected_tokens": self._protected,
            "evicted_tokens": self._evicted_tokens,
        }

    def reset(self) -> None:
        """Free every unlocked node and zero the statistics. Locked nodes stay: their holders
        still read those slots."""
        freed, gone = self._evict(self._evictable)
        self._reset_stats()
        if (bus := self._bus()) is not None:
            bus.emit(CacheNodesEvicted, tree_nodes=tuple(gone), tokens=freed, reset=True)

    def _reset_stats(self) -> None:
        self._queried_tokens = 0
        self._matched_tokens = 0
        self._evicted_tokens = 0

    # ----- match / insert -----

    def match_prefix(
        self, key: Sequence[int], count: bool = True
    ) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of `key`: its slot ids (int64, maybe empty) and the node that
        ends exactly there (an edge the match stops inside is split). The slots belong to the
        tree: lock the node before relying on them."""
        key = _as_tokens(key)
        if count:  # count=False: the engine re-reading its own insert, not a lookup
            self._queried_tokens += len(key)
        if self.disable or not key:
            return _empty_slots(), self.root
        now = self._tick()
        node, pos, values, path = self.root, 0, [], []
        while pos < len(key) and (child := node.children.get(key[pos])) is not None:
            n = common_prefix_len(child.key, key[pos : pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)  # next lookup then misses: the loop ends here
            child.last_access = now
            child.hit_count += count
            values.append(child.value)
            path.append(child)
            node, pos = child, pos + n
        if count:
            self._matched_tokens += pos
            if (bus := self._bus()) is not None:
                bus.emit(CacheNodesHit, tree_nodes=tuple(n.id for n in path),
                         queried=len(key), matched=pos)
        return (torch.cat(values) if values else _empty_slots()), node

    def cached_len(self, key: Sequence[int]) -> int:
        """How many leading tokens of key the tree holds; changes nothing (no split, no LRU
        touch, no hit counted): the scheduler ranks waiting requests with it."""
        key = _as_tokens(key)
        if self.disable:
            return 0
        node, pos = self.root, 0
        while pos < len(key) and (child := node.children.get(key[pos])) is not None:
            n = common_prefix_len(child.key, key[pos : pos + len(child.key)])
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        """Cache key -> value (one slot per token). Returns n, the length of the prefix of key
        that was already cached: the tree now owns value[n:], the caller still owns value[:n]
        (and frees whichever of those it allocated itself). Never frees anything."""
        key = _as_tokens(key)
        if len(value) != len(key):
            raise ValueError(f"key has {len(key)} tokens but value has {len(value)} slots")
        if self.disable:
            return len(key)  # nothing taken over: the caller keeps (and frees) all of value
        now = self._tick()
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                self._add_leaf(node, key[pos:], value[pos:], now)
                return pos
            n = common_prefix_len(child.key, key[pos : pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        return pos

    # ----- locks -----

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect node and its ancestors from eviction (one lock; undo with dec_lock_ref)."""
        self._check_live(node)
        self._publish_lock(node, 1)
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Release one lock taken with inc_lock_ref on the same node."""
        self._check_live(node)
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError(f"dec_lock_ref on unlocked node #{node.id}")
        self._publish_lock(node, -1)
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node = node.parent

    # ----- eviction -----

    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves until >= num_tokens slots are freed or nothing
        is evictable; whole leaves go, so it may free more. Returns the slots freed."""
        freed, gone = self._evict(num_tokens)
        if gone and (bus := self._bus()) is not None:
            bus.emit(CacheNodesEvicted, tree_nodes=tuple(gone), tokens=freed)
        return freed

    def _evict(self, num_tokens: int) -> tuple[int, list[int]]:
        """evict's work: the slots freed and the ids of the nodes that went."""
        gone: list[int] = []
        if num_tokens <= 0:
            return 0, gone
        # Only leaves can go (their slots are the ends of cached sequences); a parent whose last
        # child went joins the heap, so a long idle branch is eaten from its tip upwards.
        heap = [(n.last_access, n.id, n) for n in self.nodes() if n.is_leaf() and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += self._delete_leaf(leaf)
            gone.append(leaf.id)
            if parent is not self.root and parent.is_leaf() and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        self._evicted_tokens += freed
        return freed, gone

    # ----- views -----

    def nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before their children."""
        stack = list(reversed(self.root.children.values()))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children.values()))

    def snapshot(self) -> list[Event]:
        """The tree as it is now, as the events that would build it (parents first): what
        a view that starts listening folds before the changes that follow. Read on the
        caller's thread; RuntimeError if the engine changed the tree meanwhile."""
        out = []
        for n in self.nodes():
            parent = n.parent.id if n.parent is not None and n.parent is not self.root else None
            out.append(CacheNodeAdded(tree_node=n.id, parent=parent, key=n.key,
                                      text=self._text(n.key), hits=n.hit_count,
                                      lock_ref=n.lock_ref))
        # and its figures so far, so a view's hit rate and evictions are the cache's own
        out.append(CacheNodesHit(queried=self._queried_tokens, matched=self._matched_tokens))
        out.append(CacheNodesEvicted(tokens=self._evicted_tokens))
        return out

    def format_tree(self, tokenizer: Any = None, max_depth: int = 8, max_tokens: int = 16) -> str:
        """Readable multi-line tree. With a tokenizer (anything with .decode(list[int])) edges
        show text, otherwise token ids; edges longer than max_tokens are elided."""
        s = self.stats()
        lines = [
            f"root  nodes={s['nodes']} cached={s['cached_tokens']} "
            f"evictable={s['evictable_tokens']} protected={s['protected_tokens']} "
            f"hit_rate={s['hit_rate']:.1%}"
        ]
        stack = _child_rows(self.root, "", 1)
        while stack:
            node, indent, last, depth = stack.pop()
            label = _edge_label(node, tokenizer, max_tokens)
            lines.append(f"{indent}{'└── ' if last else '├── '}{label}")
            indent += "    " if last else "│   "
            if depth >= max_depth and node.children:
                lines.append(f"{indent}… {sum(1 for _ in _subtree(node)) - 1} more nodes")
            else:
                stack.extend(_child_rows(node, indent, depth + 1))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"RadixCache({self.stats()})"

    # ----- internals -----

    def _bus(self) -> EventBus | None:
        """The bus when someone listens (else building a payload is wasted)."""
        bus = self.events
        return bus if bus is not None and bus.active else None

    def _text(self, key: tuple[int, ...]) -> str | None:
        return self.decode(list(key)) if self.decode is not None else None

    def _publish_lock(self, node: TreeNode, delta: int) -> None:
        if node is not self.root and (bus := self._bus()) is not None:
            bus.emit(CacheNodeLocked, tree_node=node.id, delta=delta)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _check_live(self, node: TreeNode) -> None:
        if node is not self.root and node.parent is None:
            raise ValueError(f"node #{node.id} was evicted; lock it before it can be")

    def _add_leaf(
        self, parent: TreeNode, key: tuple[int, ...], value: torch.Tensor, now: int
    ) -> None:
        # clone: the caller's tensor may be a view of a larger buffer it reuses.
        slots = value.to(device="cpu", dtype=torch.int64).clone()
        leaf = TreeNode(key=key, value=slots, parent=parent, last_access=now)
        parent.children[key[0]] = leaf
        self._evictable += len(key)  # a new node has no locks, whatever its ancestors hold
        self._num_nodes += 1
        if (bus := self._bus()) is not None:
            bus.emit(CacheNodeAdded, tree_node=leaf.id,
                     parent=None if parent is self.root else parent.id, key=key,
                     text=self._text(key))

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child's edge after n tokens; returns the new upper node. The child object keeps
        the lower part, so nodes callers hold (and lock) still end where they did."""
        upper = TreeNode(
            key=child.key[:n],
            value=child.value[:n],
            parent=child.parent,
            lock_ref=child.lock_ref,  # its only child is `child`, and it has no own locks
            last_access=child.last_access,
            hit_count=child.hit_count,
        )
        upper.children[child.key[n]] = child
        child.parent.children[child.key[0]] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        self._num_nodes += 1  # sizes are unchanged: both halves share the lock state
        if (bus := self._bus()) is not None:
            bus.emit(CacheNodeSplit, tree_node=child.id, cut=n, upper=upper.id,
                     text=self._text(upper.key), rest_text=self._text(child.key))
        return upper

    def _delete_leaf(self, leaf: TreeNode) -> int:
        del leaf.parent.children[leaf.key[0]]
        leaf.parent = None  # marks it evicted (see _check_live)
        self._evictable -= len(leaf.key)
        self._num_nodes -= 1
        if self.pool is not None:
            self.pool.free(leaf.value)
        return len(leaf.key)


def _as_tokens(key: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    if isinstance(key, torch.Tensor):
        return tuple(key.tolist())
    return tuple(key)


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """How many items a and b (sequences of one type) share from the start. Slices compare
    at C speed: the usual case (all of the shorter) is one compare, else the range halves."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _subtree(node: TreeNode) -> Iterator[TreeNode]:
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


def _child_rows(node: TreeNode, indent: str, depth: int) -> list[tuple[TreeNode, str, bool, int]]:
    """format_tree's stack entries for node's children, reversed so they pop in order."""
    kids = list(node.children.values())
    return [(c, indent, i == len(kids) - 1, depth) for i, c in enumerate(kids)][::-1]


def _edge_label(node: TreeNode, tokenizer: Any, max_tokens: int) -> str:
    toks = list(node.key)
    half = max(1, max_tokens // 2)
    parts = [toks] if len(toks) <= max_tokens else [toks[:half], toks[-half:]]
    if tokenizer is not None:
        text = "…".join(repr(tokenizer.decode(p)) for p in parts)
    else:
        text = "[" + " … ".join(" ".join(map(str, p)) for p in parts) + "]"
    lock = f" lock={node.lock_ref}" if node.lock_ref else ""
    return f"{text}  #{node.id} len={len(toks)}{lock} hits={node.hit_count}"
