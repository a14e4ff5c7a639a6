"""Traces written by an earlier version still replay as they did: tests/data/traces holds
traces recorded with the real model by tests/support/write_traces.py (programs with gens,
a select, roles, fork/join, a regex, an error, a cancel, a held start; one at the "token"
level) and, beside each, what its replay showed then (tests/support/replay_summary.py)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
from support.replay_summary import plain, summary

from sgl_nb.runtime.events import (
    EVENT_TYPES,
    CacheEvict,
    CacheHit,
    CacheInsert,
    CacheNodeAdded,
    CacheNodeLocked,
    CacheNodesEvicted,
    CacheNodesHit,
    CacheNodeSplit,
    Failed,
    Forked,
    Hold,
    InstructionFinished,
    InstructionStarted,
    Joined,
    NodeFinished,
    NodeKind,
    NodeQueued,
    NodeStarted,
    Op,
    Paused,
    Preempted,
    ProgramFinished,
    ProgramStarted,
    Resumed,
    Retracted,
    Status,
    Token,
    VariableSet,
)
from sgl_nb.tracing import load
from sgl_nb.tracing.codec import event_data, event_from, event_name

TRACES = Path(__file__).parent / "data" / "traces"


@pytest.mark.parametrize("name", ["node", "token"])
def test_an_earlier_trace_replays_the_same(name):
    path = TRACES / f"{name}.jsonl"
    expected = json.loads(path.with_suffix(".expected.json").read_text())
    got = plain(json.loads(json.dumps(summary(load(path), path.name))))
    for part in expected:
        assert got[part] == expected[part], part
    assert got.keys() == expected.keys()


def test_the_traces_hold_every_kind_of_step():
    """What the comparison above covers (so that a re-recording cannot quietly drop it)."""
    s = json.loads((TRACES / "node.expected.json").read_text())
    kinds = {n["kind"] for n in s["nodes"].values()}
    assert kinds == {"Text", "Gen", "Select", "RoleBegin", "RoleEnd", "Fork", "Join"}
    assert {p["status"] for p in s["programs"].values()} == {"done", "error", "cancelled"}
    tokens = [t for n in s["nodes"].values() for t in n["tokens"]]
    assert any(t[3] for t in tokens) and all(t[5] for t in tokens)  # forced; alternatives
    events = load(TRACES / "node.jsonl").events
    assert {"paused", "resumed", "fork", "join", "cache_hit"} <= \
        {str(getattr(e.kind, "value", e.kind)) for e in events}


def _one_of_each() -> list:
    return [
        ProgramStarted(program=1, function="f", priority="normal", model="m", module="mod",
                       qualname="f", args="{}", options="{}"),
        ProgramFinished(program=1, status=Status.CANCELLED, error="E()", line=3),
        NodeQueued(program=1, node=2, node_kind=NodeKind.GEN, name="x", line=3, file="f.py",
                   label="Gen x", preds=(1,), stack=("f", "g"), stack_args=("a=1", ""),
                   ops=(Op.DECODE,)),
        NodeStarted(program=1, node=2, node_kind=NodeKind.GEN, name="x", line=3, file="f.py",
                    label="Gen x", preds=(1,), stack=("f",), stack_args=("a=1",),
                    params='{"max_tokens": 2}'),
        NodeFinished(program=1, node=2, status=Status.ERROR, text="ab", value="'ab'",
                     meta='{"finish_reason": "stop"}'),
        VariableSet(program=1, name="n", value="3"),
        InstructionStarted(program=1, node=2, request=7, op=Op.DECODE, index=1),
        InstructionFinished(program=1, node=2, request=7, op=Op.SCORE, index=1,
                            status=Status.ERROR, error="E()",
                            usage={"input_tokens": 4, "finish_reason": "error"}),
        Token(program=1, node=2, request=7, token=5, text="a", logprob=-0.5, forced=True,
              step=9, allowed=2, top=[[5, "a", -0.4, False], [6, "b", -1.0, True]]),
        CacheHit(request=7, cached_tokens=2, prompt_tokens=4),
        CacheInsert(request=7, tokens=3, total=5), CacheEvict(tokens=8),
        CacheNodeAdded(tree_node=3, parent=1, key=(5, 6), text="ab", hits=2, lock_ref=1),
        CacheNodeSplit(tree_node=3, cut=1, upper=4, text="a", rest_text="b"),
        CacheNodesHit(tree_nodes=(4, 3), queried=5, matched=2),
        CacheNodeLocked(tree_node=3, delta=-1),
        CacheNodesEvicted(tree_nodes=(3,), tokens=1, reset=True),
        Forked(program=1, node=3, n=2, children=(4, 5)),
        Joined(program=1, node=6, mode="concate_and_append", children=(4, 5)),
        Paused(program=1, node=2, at=Hold.DECODE, reason="step controller"),
        Resumed(program=1, request=7, reason="scheduler"),
        Preempted(program=1, request=7, reason="priority", priority="batch"),
        Retracted(program=1, request=7, reason="memory"), Failed(program=1, error="E()"),
    ]


def test_every_event_kind_round_trips_through_the_codec():
    events = _one_of_each()
    assert {type(e) for e in events} == set(EVENT_TYPES.values())
    for e in events:
        ids = (e.program, e.node, e.request)
        data = json.loads(json.dumps(event_data(e)))  # plain JSON values only
        back = event_from(event_name(e), ids, data, e.ts, e.seq)
        assert back == e, type(e).__name__
        # ... and of the same types (a kind comes back as its enum, not its name)
        assert [type(getattr(back, f.name)) for f in fields(e)] == \
            [type(getattr(e, f.name)) for f in fields(e)], type(e).__name__
