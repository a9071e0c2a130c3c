"""bench/admission_sim.py: the simulator that replays the runner's admission against a model of
vLLM's scheduler (it found the shared-head double count's effect before a GPU lease could)."""
from __future__ import annotations

from bench.admission_sim import SHAPES, run, workload


def small_8b() -> dict:
    # the 8B shape with the invoices prompt split measured on the H200, on a quarter of the cache
    return SHAPES["8b"] | {"prefix": 1056, "private": 167, "blocks": 768}


def test_counting_a_groups_head_twice_runs_fewer_requests_at_once():
    """The runner before the shared-head fix (runner-noshared: a group's first row counts the
    head as its own) refuses rows for blocks that are free: fewer requests in flight, more steps."""
    shape = small_8b()
    fixed = run("runner", workload(128, 8, shape), shape)
    before = run("runner-noshared", workload(128, 8, shape), shape)
    assert fixed["preemptions"] == before["preemptions"] == 0
    assert fixed["avg_running"] > before["avg_running"] and fixed["steps"] < before["steps"]


def test_long_rows_and_groups_leave_a_seeds_other_lengths_alone():
    """Rows or whole groups that run to max_tokens are drawn apart from the base lengths, so one
    seed's other rows keep their lengths whatever share runs long."""
    shape = SHAPES["135m"] | {"max_tokens": 256}
    base = [r.out_len for r in workload(256, 16, shape, seed=3)]
    rows = [r.out_len for r in workload(256, 16, shape, seed=3, long_rows=0.2)]
    groups = workload(256, 16, shape, seed=3, long_groups=0.25)
    assert all(b == r for b, r in zip(base, rows) if r != 256) and rows.count(256) > 20
    looping = {r.group for r in groups if r.out_len == 256}
    assert looping and all(r.out_len == 256 for r in groups if r.group in looping)
    assert all(r.out_len == b for r, b in zip(groups, base) if r.group not in looping)
