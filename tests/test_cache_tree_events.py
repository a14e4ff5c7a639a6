"""The radix tree rebuilt from its events (tracing/cache_tree.py): the fold of what
RadixCache publishes is the tree itself, a trace replays to the same tree as the live run,
and nothing is built for a bus nobody listens to."""

from __future__ import annotations

import json
import random

import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.waits import until

import sgl_nb as sgl
from sgl_nb.notebook.widgets import CacheTreeView
from sgl_nb.runtime.events import TREE_EVENTS, EventBus
from sgl_nb.runtime.radix_cache import RadixCache
from sgl_nb.tracing import load
from sgl_nb.tracing.cache_tree import CacheTree, tree_now
from sgl_nb.tracing.codec import event_data, event_from, event_name
from sgl_nb.tracing.timeline import Timeline
from sgl_nb.tui.replay import ReplaySession


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i) for i in ids)


class Letters:
    """A tokenizer for format_tree: token i is the i-th letter."""

    def decode(self, ids: list[int]) -> str:
        return decode(ids)


def shape_of(cache: RadixCache) -> list[tuple]:
    """CacheTree.shape's rows, read from the tree itself."""
    return [(n.id, n.parent.id if n.parent is not cache.root else -1, n.key, n.hit_count,
             n.lock_ref) for n in cache.nodes()]


def through_a_trace(e):
    """The event as a replay rebuilds it from a trace's JSON."""
    data = json.loads(json.dumps(event_data(e)))
    return event_from(event_name(e), (e.program, e.node, e.request), data, e.ts, e.seq)


def churn(cache: RadixCache, steps: int, seed: int) -> None:
    """Inserts, lookups (which split edges), locks taken and released, evictions, resets."""
    rng, held, next_slot = random.Random(seed), [], 0
    for _ in range(steps):
        key = [rng.randrange(4) for _ in range(rng.randrange(1, 10))]
        r = rng.random()
        if r < 0.4:
            cache.insert(key, torch.arange(next_slot, next_slot + len(key)))
            next_slot += len(key)
        elif r < 0.7:
            _, node = cache.match_prefix(key)
            if node is not cache.root and rng.random() < 0.5:
                cache.inc_lock_ref(node)
                held.append(node)
        elif r < 0.8 and held:
            cache.dec_lock_ref(held.pop(rng.randrange(len(held))))
        elif r < 0.97:
            cache.evict(rng.randrange(1, 8))
        else:
            cache.reset()


def listened_cache() -> tuple[RadixCache, list]:
    bus, seen = EventBus(), []
    bus.subscribe(seen.append)
    cache = RadixCache(None)
    cache.events, cache.decode = bus, decode
    return cache, seen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fold_of_the_tree_events_is_the_tree(seed):
    cache, seen = listened_cache()
    churn(cache, 400, seed)
    tree = CacheTree()
    for e in seen:
        tree.apply(through_a_trace(e))
    assert tree.shape() == shape_of(cache) and len(tree.shape()) > 0
    assert tree.stats() == cache.stats()
    assert {n.id: n.text for n in tree.nodes()} == {n.id: decode(list(n.key))
                                                   for n in cache.nodes()}
    assert tree.format_tree(decode) == cache.format_tree(Letters())


def test_a_late_listener_starts_from_the_snapshot():
    cache, _ = listened_cache()
    churn(cache, 200, 7)
    tree = CacheTree()
    late = []
    cache.events.subscribe(late.append)
    for e in cache.snapshot() + late:  # what a view folds: the tree so far, then its events
        tree.apply(e)
    churn(cache, 200, 8)
    for e in late:
        tree.apply(e)
    assert tree.shape() == shape_of(cache) and tree.stats() == cache.stats()
    assert tree_now(cache).format_tree(decode) == cache.format_tree(Letters())  # %sgl_cache --text


def test_nothing_is_built_without_a_listener():
    calls = []
    cache = RadixCache(None)
    cache.events, cache.decode = EventBus(), lambda ids: calls.append(ids) or ""
    churn(cache, 200, 3)
    assert calls == [] and cache.stats()["nodes"] > 0
    cache.events.subscribe(lambda e: None)
    cache.insert([9, 9, 9], torch.arange(1000, 1003))
    assert calls == [[9, 9, 9]]


@sgl.function
def ask(s, q):
    s += "You answer in one short line.\nQ: " + q + "\nA:"
    s += sgl.gen("a", max_tokens=4, ignore_eos=True)


@pytest.mark.slow
def test_a_replayed_trace_draws_the_live_cache_tree(default_backend, tmp_path):
    rt = default_backend
    rt.flush_cache()  # the trace starts from an empty tree (what it holds is locked: none)
    path = tmp_path / "trace.jsonl"
    q = rt.events.subscribe()
    live = Timeline(rt.engine.cache.snapshot())
    sgl.enable_tracing(file=path, exporter=InMemorySpanExporter(), runtime=rt)
    try:
        states = [ask.run(q="What is a radix tree?"), ask.run(q="What is a radix sort?")]
        batch = ask.run_batch([{"q": "Why cache prompts?"}, {"q": "Why cache pages?"}])
        # every request's locks released: the tree is at rest
        until(lambda: rt.engine.cache.protected_size() == 0, "the requests' locks released")
    finally:
        sgl.disable_tracing()
        rt.events.unsubscribe(q)
    assert all(st.error() is None for st in [*states, *batch])
    while not q.empty():
        live.apply(q.get())
    replay = load(path)
    assert any(isinstance(e, TREE_EVENTS) for e in replay.events)
    assert live.cache_tree.shape() == shape_of(rt.engine.cache)
    assert replay.cache_tree.shape() == live.cache_tree.shape()
    assert replay.cache_tree.stats() == live.cache_tree.stats()
    assert any(hits > 0 for *_, hits, _ in live.cache_tree.shape())  # the shared prompt
    assert replay.cache_tree.format_tree() == live.cache_tree.format_tree()
    # the widget's cache tab draws the same rows from either
    views = [CacheTreeView(max_nodes=100_000) for _ in range(2)]
    for view, tl in zip(views, (live, replay)):
        view.update(tl.cache_tree, None)
    assert views[0].tree.html() == views[1].tree.html()
    assert "radix" in views[1].tree.html() and views[1].nodes == len(replay.cache_tree.shape())
    # the TUI's cache pane: the replay's tree at its end is the live one
    session = ReplaySession(replay, path.name)
    before = session.cache_tree()
    assert session.continue_() == "end" and session.cache_tree() == live.cache_tree.format_tree()
    assert before != session.cache_tree()  # at the start, the tree as it was then


@pytest.mark.slow
def test_a_trace_started_after_the_tree_grew_holds_the_tree_so_far(default_backend, tmp_path):
    rt = default_backend
    rt.flush_cache()
    assert ask.run(q="What is a radix tree?").error() is None  # before tracing
    until(lambda: rt.engine.cache.protected_size() == 0, "the requests' locks released")
    path = tmp_path / "late.jsonl"
    sgl.enable_tracing(file=path, runtime=rt)
    try:
        assert ask.run(q="What is a radix sort?").error() is None
        until(lambda: rt.engine.cache.protected_size() == 0, "the requests' locks released")
    finally:
        sgl.disable_tracing()
    replay = load(path)
    assert len(replay.cache_tree.shape()) > 2  # the first prompt's branch and the second's
    assert replay.cache_tree.shape() == shape_of(rt.engine.cache)
