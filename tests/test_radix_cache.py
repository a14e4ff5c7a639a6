import random

import pytest
import torch

from sgl_nb.runtime.kv_pool import KVPool
from sgl_nb.runtime.radix_cache import RadixCache, TreeNode


class RecordingPool:
    """Stands in for KVPool where a test wants to see what was freed, in order."""

    def __init__(self) -> None:
        self.freed: list[list[int]] = []

    def free(self, slots: torch.Tensor) -> None:
        self.freed.append(slots.tolist())


def slots(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def path_key(cache: RadixCache, node: TreeNode) -> tuple[int, ...]:
    parts = []
    while node is not cache.root:
        parts.append(node.key)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


# ----- match / insert -----


def test_match_on_empty_tree():
    cache = RadixCache(None)
    value, node = cache.match_prefix([1, 2, 3])
    assert value.dtype == torch.int64 and value.numel() == 0
    assert node is cache.root
    value, node = cache.match_prefix([])
    assert value.numel() == 0 and node is cache.root
    assert cache.total_size() == 0 and cache.stats()["nodes"] == 0


def test_exact_and_longer_match():
    cache = RadixCache(None)
    assert cache.insert([1, 2, 3], slots(10, 11, 12)) == 0
    value, node = cache.match_prefix([1, 2, 3])
    assert value.tolist() == [10, 11, 12] and node.key == (1, 2, 3)
    value, node2 = cache.match_prefix([1, 2, 3, 4, 5])
    assert value.tolist() == [10, 11, 12] and node2 is node
    value, node3 = cache.match_prefix(torch.tensor([1, 2, 3]))  # tensors work as keys too
    assert node3 is node
    value, node4 = cache.match_prefix([7])
    assert value.numel() == 0 and node4 is cache.root


def test_match_inside_an_edge_splits_the_node():
    cache = RadixCache(None)
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    (leaf,) = cache.root.children.values()
    value, node = cache.match_prefix([1, 2, 9])
    assert value.tolist() == [10, 11]
    assert node.key == (1, 2) and node.value.tolist() == [10, 11]
    assert list(node.children.values()) == [leaf]  # the old node keeps the lower half
    assert leaf.key == (3, 4) and leaf.value.tolist() == [12, 13] and leaf.parent is node
    assert cache.total_size() == 4 and cache.stats()["nodes"] == 2
    # a key that ends inside an edge splits too, so the node ends exactly at the match
    value, mid = cache.match_prefix([1, 2, 3])
    assert value.tolist() == [10, 11, 12] and mid.key == (3,) and mid.parent is node
    value, end = cache.match_prefix([1, 2, 3, 4])
    assert value.tolist() == [10, 11, 12, 13] and end is leaf and leaf.key == (4,)


def test_insert_returns_the_already_cached_length():
    cache = RadixCache(None)
    assert cache.insert([1, 2, 3], slots(10, 11, 12)) == 0
    assert cache.insert([1, 2, 3, 4, 5], slots(20, 21, 22, 23, 24)) == 3
    assert cache.match_prefix([1, 2, 3, 4, 5])[0].tolist() == [10, 11, 12, 23, 24]
    assert cache.insert([1, 2], slots(30, 31)) == 2  # fully cached: nothing taken
    assert cache.insert([1, 2, 7], slots(40, 41, 42)) == 2  # diverges inside an edge
    assert cache.match_prefix([1, 2, 7])[0].tolist() == [10, 11, 42]
    assert cache.total_size() == 6
    with pytest.raises(ValueError):
        cache.insert([1, 2], slots(1))


def test_insert_copies_the_slots_it_keeps():
    cache = RadixCache(None)
    value = slots(10, 11, 12)
    cache.insert([1, 2, 3], value)
    value[:] = 0  # the caller reuses its buffer
    assert cache.match_prefix([1, 2, 3])[0].tolist() == [10, 11, 12]


def test_disabled_cache_stores_nothing():
    cache = RadixCache(RecordingPool(), disable=True)
    assert cache.insert([1, 2, 3], slots(10, 11, 12)) == 3  # the caller keeps all of value
    value, node = cache.match_prefix([1, 2, 3])
    assert value.numel() == 0 and node is cache.root
    assert cache.total_size() == 0 and cache.evict(10) == 0


# ----- locks and eviction -----


def test_locks_protect_from_eviction():
    pool = RecordingPool()
    cache = RadixCache(pool)
    cache.insert([1, 2, 3], slots(10, 11, 12))
    cache.insert([1, 2, 4], slots(10, 11, 14))
    cache.insert([5, 6], slots(15, 16))
    _, locked = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(locked)
    # the lock covers the leaf and its ancestor (1, 2): 3 tokens
    assert cache.protected_size() == 3 and cache.evictable_size() == 3
    assert cache.evict(100) == 3
    assert sorted(pool.freed) == [[14], [15, 16]]
    assert cache.match_prefix([1, 2, 3])[0].tolist() == [10, 11, 12]
    cache.dec_lock_ref(locked)
    assert cache.protected_size() == 0 and cache.evictable_size() == 3
    assert cache.evict(100) == 3
    assert cache.total_size() == 0


def test_lock_counts_nest_and_guard_misuse():
    cache = RadixCache(RecordingPool())
    cache.insert([1, 2, 3], slots(10, 11, 12))
    _, a = cache.match_prefix([1, 2, 3])
    _, b = cache.match_prefix([1])  # splits: b is the new parent of a
    cache.inc_lock_ref(a)
    cache.inc_lock_ref(b)
    assert b.lock_ref == 2 and a.lock_ref == 1
    cache.dec_lock_ref(a)
    assert cache.protected_size() == 1 and cache.evictable_size() == 2
    assert cache.evict(10) == 2  # a goes, b stays locked
    with pytest.raises(ValueError, match="evicted"):
        cache.inc_lock_ref(a)
    cache.dec_lock_ref(b)
    with pytest.raises(ValueError):
        cache.dec_lock_ref(b)
    cache.inc_lock_ref(cache.root)  # the root holds no tokens: locking it is a no-op
    cache.dec_lock_ref(cache.root)


def test_eviction_is_least_recently_used_first():
    pool = RecordingPool()
    cache = RadixCache(pool)
    cache.insert([1], slots(11))
    cache.insert([2], slots(12))
    cache.insert([3], slots(13))
    cache.match_prefix([1])  # 1 is now the most recently used
    assert cache.evict(1) == 1
    assert cache.evict(1) == 1
    assert pool.freed == [[12], [13]]
    cache.insert([4], slots(14))
    assert cache.evict(1) == 1
    assert pool.freed[-1] == [11]


def test_parent_becomes_evictable_after_its_children():
    pool = RecordingPool()
    cache = RadixCache(pool)
    cache.insert([1, 2, 3], slots(10, 11, 12))
    cache.insert([1, 2, 4], slots(10, 11, 14))
    cache.insert([9], slots(19))
    cache.match_prefix([9])  # keep 9 the newest, so the (1, 2) branch goes first
    # two leaves give 2 tokens < 3, so their parent (1, 2) joins the candidates and goes too
    assert cache.evict(3) == 4
    assert sorted(pool.freed[:2]) == [[12], [14]] and pool.freed[2] == [10, 11]
    assert cache.match_prefix([1, 2])[0].numel() == 0
    assert cache.total_size() == 1
    assert cache.stats()["evicted_tokens"] == 4


def test_evict_frees_whole_leaves_and_stops_when_empty():
    pool = RecordingPool()
    cache = RadixCache(pool)
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    assert cache.evict(1) == 4  # a node is evicted whole
    assert cache.evict(5) == 0 and cache.evict(0) == 0


def test_reset_frees_unlocked_and_keeps_locked():
    pool = KVPool(num_layers=1, num_slots=10, num_kv_heads=1, head_dim=2)
    cache = RadixCache(pool)
    cache.insert([1, 2], pool.alloc(2))
    cache.insert([3, 4, 5], pool.alloc(3))
    _, node = cache.match_prefix([3, 4, 5])
    cache.inc_lock_ref(node)
    cache.match_prefix([1])
    cache.reset()
    assert pool.available() == 7
    assert cache.total_size() == 3 and cache.protected_size() == 3
    assert cache.stats()["queried_tokens"] == 0 and cache.stats()["evicted_tokens"] == 0
    cache.dec_lock_ref(node)
    cache.reset()
    assert pool.available() == 10 and cache.total_size() == 0


# ----- statistics and views -----


def test_stats_and_hit_rate():
    cache = RadixCache(None)
    assert cache.stats()["hit_rate"] == 0.0
    cache.insert([1, 2, 3, 4], slots(10, 11, 12, 13))
    cache.match_prefix([1, 2, 3, 4])  # 4 of 4
    cache.match_prefix([1, 2, 7, 8])  # 2 of 4, splits (1, 2 | 3, 4)
    cache.match_prefix([5, 6])  # 0 of 2
    s = cache.stats()
    assert s["queried_tokens"] == 10 and s["matched_tokens"] == 6
    assert s["hit_rate"] == pytest.approx(0.6)
    assert s["nodes"] == 2 and s["cached_tokens"] == 4
    assert s["evictable_tokens"] == 4 and s["protected_tokens"] == 0
    assert s["evicted_tokens"] == 0
    upper = cache.root.children[1]
    assert upper.hit_count == 2 and upper.children[3].hit_count == 1


def test_nodes_and_format_tree():
    cache = RadixCache(None)
    cache.insert([1, 2, 3], slots(10, 11, 12))
    cache.insert([1, 2, 4], slots(10, 11, 14))
    cache.insert(list(range(100, 140)), torch.arange(20, 60))
    keys = [n.key for n in cache.nodes()]
    assert keys[0] == (1, 2) and set(keys) == {(1, 2), (3,), (4,), tuple(range(100, 140))}
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(node)
    text = cache.format_tree()
    assert text.splitlines()[0].startswith("root")
    assert "[1 2]" in text and "lock=1" in text and "…" in text  # long edges are elided
    assert len(text.splitlines()) == 5

    class Tok:
        def decode(self, ids: list[int]) -> str:
            return "".join(chr(ord("a") + i % 26) for i in ids)

    assert "'bc'" in cache.format_tree(Tok())
    shallow = cache.format_tree(max_depth=1)
    assert "2 more nodes" in shallow


# ----- randomized comparison with a naive model -----


class Harness:
    """A RadixCache over a real KVPool next to a naive model: a dict from every cached prefix
    to the slot of its last token. Checks after every step that both agree and that no slot is
    leaked or owned twice."""

    def __init__(self, seed: int, num_slots: int = 48) -> None:
        self.rng = random.Random(seed)
        self.pool = KVPool(num_layers=1, num_slots=num_slots, num_kv_heads=1, head_dim=1)
        self.cache = RadixCache(self.pool)
        self.model: dict[tuple[int, ...], int] = {}
        self.locks: list[tuple[TreeNode, tuple[int, ...]]] = []
        self.requests: list[tuple[tuple[int, ...], torch.Tensor]] = []  # slots the test holds
        self.keys: list[tuple[int, ...]] = [()]

    def random_key(self) -> tuple[int, ...]:
        base = self.rng.choice(self.keys)
        base = base[: self.rng.randint(0, len(base))]
        extra = tuple(self.rng.randrange(3) for _ in range(self.rng.randint(0, 6)))
        key = (base + extra) or (self.rng.randrange(3),)
        self.keys.append(key)
        return key

    # -- the model --

    def cached_len(self, key: tuple[int, ...]) -> int:
        n = 0
        while n < len(key) and key[: n + 1] in self.model:
            n += 1
        return n

    def tree_contents(self) -> dict[tuple[int, ...], int]:
        out = {}
        for node in self.cache.nodes():
            prefix = path_key(self.cache, node.parent)
            for tok, slot in zip(node.key, node.value.tolist(), strict=True):
                prefix += (tok,)
                out[prefix] = slot
        return out

    # -- operations --

    def alloc(self, n: int) -> torch.Tensor | None:
        if self.pool.available() < n:
            self.evict(n - self.pool.available())
        return self.pool.alloc(n)

    def evict(self, n: int) -> None:
        before = dict(self.model)
        evictable = self.cache.evictable_size()
        freed = self.cache.evict(n)
        after = self.tree_contents()
        assert all(before.get(p) == s for p, s in after.items())  # only removals
        assert len(before) - len(after) == freed
        assert freed >= min(n, evictable)
        if freed < n:
            assert self.cache.evictable_size() == 0
        self.model = after

    def match(self) -> None:
        key = self.random_key()
        value, node = self.cache.match_prefix(key)
        m = self.cached_len(key)
        assert len(value) == m
        assert value.tolist() == [self.model[key[: i + 1]] for i in range(m)]
        assert path_key(self.cache, node) == key[:m]

    def insert_fresh(self) -> None:
        key = self.random_key()
        value = self.alloc(len(key))
        if value is None:
            return
        self.finish(key, value)

    def insert_after_match(self) -> None:
        key = self.random_key()
        prefix, node = self.cache.match_prefix(key)
        self.cache.inc_lock_ref(node)  # keep the matched prefix while we allocate
        new = self.alloc(len(key) - len(prefix))
        if new is not None:
            n = self.cache.insert(key, torch.cat([prefix, new]))
            assert n == len(prefix)
            self.record(key, torch.cat([prefix, new]), n)
        self.cache.dec_lock_ref(node)

    def start_request(self) -> None:
        key = self.random_key()
        value = self.alloc(len(key))
        if value is not None:
            self.requests.append((key, value))

    def finish_request(self) -> None:
        if self.requests:
            self.finish(*self.requests.pop(self.rng.randrange(len(self.requests))))

    def finish(self, key: tuple[int, ...], value: torch.Tensor) -> None:
        expected = self.cached_len(key)
        n = self.cache.insert(key, value)
        assert n == expected
        self.pool.free(value[:n])  # our own duplicates of what was already cached
        self.record(key, value, n)

    def record(self, key: tuple[int, ...], value: torch.Tensor, n: int) -> None:
        for i in range(n, len(key)):
            self.model[key[: i + 1]] = int(value[i])

    def lock(self) -> None:
        key = self.random_key()
        _, node = self.cache.match_prefix(key)
        if node is not self.cache.root:
            self.cache.inc_lock_ref(node)
            self.locks.append((node, key[: self.cached_len(key)]))

    def unlock(self) -> None:
        if self.locks:
            node, _ = self.locks.pop(self.rng.randrange(len(self.locks)))
            self.cache.dec_lock_ref(node)

    def step(self) -> None:
        ops = [
            self.match,
            self.insert_fresh,
            self.insert_after_match,
            self.start_request,
            self.finish_request,
            self.lock,
            self.unlock,
            self.random_evict,
        ]
        weights = [4, 3, 3, 2, 2, 1, 1, 1]
        self.rng.choices(ops, weights)[0]()
        self.check()

    def random_evict(self) -> None:
        self.evict(self.rng.randint(1, 20))

    # -- invariants --

    def check(self) -> None:
        cache, pool = self.cache, self.pool
        contents = self.tree_contents()
        assert contents == self.model
        held = [s for _, v in self.requests for s in v.tolist()]
        assert pool.available() + cache.total_size() + len(held) == pool.capacity
        owned = list(contents.values()) + held
        assert len(set(owned)) == len(owned) and 0 not in owned
        everything_free = pool.alloc(pool.available())  # the pool's free set, by asking it
        assert not set(everything_free.tolist()) & set(owned)
        pool.free(everything_free)
        self.check_locks()

    def check_locks(self) -> None:
        direct: dict[int, int] = {}
        for node, prefix in self.locks:
            assert path_key(self.cache, node) == prefix  # splits keep held nodes in place
            direct[node.id] = direct.get(node.id, 0) + 1
        evictable = protected = 0
        for node in self.cache.nodes():
            assert len(node.key) == len(node.value) > 0
            assert node.parent.children[node.key[0]] is node
            below = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref == direct.get(node.id, 0) + below
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert (evictable, protected) == (self.cache.evictable_size(), self.cache.protected_size())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_match_naive_model(seed):
    h = Harness(seed)
    for _ in range(1500):
        h.step()
    for node, _ in h.locks:
        h.cache.dec_lock_ref(node)
    h.locks.clear()
    while h.requests:
        h.finish_request()
        h.check()
    h.cache.reset()
    assert h.cache.total_size() == 0 and h.pool.available() == h.pool.capacity
    stats = h.cache.stats()
    assert stats["nodes"] == 0 and stats["queried_tokens"] == 0
