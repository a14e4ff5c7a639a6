"""Traces written by an earlier version still replay as they did: tests/data/traces holds
traces recorded with the real model by tests/support/write_traces.py (programs with gens,
a select, roles, fork/join, a regex, an error, a cancel, a held start; one at the "token"
level) and, beside each, what its replay showed then (tests/support/replay_summary.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.replay_summary import plain, summary

from sgl_nb.tracing import load

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
