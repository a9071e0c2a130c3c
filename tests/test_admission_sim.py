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


def waves_case(mixed_s: float) -> tuple[dict, dict]:
    # the 135M shape (outputs of varied length: the pace stays off, so blocks bind) with a step that
    # prefills costing mixed_s more than one that only decodes; runner against runner-nowave
    shape = SHAPES["135m"] | {"prefix": 1056, "private": 167, "mixed": mixed_s}
    return (run("runner", workload(512, 32, shape), shape), run("runner-nowave", workload(512, 32, shape), shape))


def test_waves_gather_prefills_where_a_prefilling_step_costs_more():
    """With a prefilling step 4 ms dearer (a ~9.5 ms step), the fit finds that cost from the
    simulated clock, admissions wait for waves, fewer steps prefill and the job takes less time."""
    waves, none = waves_case(0.004)
    assert waves["wave_holds"] > 0 and max(waves["waves_fitted"]) > 1
    assert abs(waves["wave_fit"]["mixed_step_extra_ms"] - 4.0) < 1.0
    assert waves["mixed_steps"] < 0.7 * none["mixed_steps"]
    assert waves["sim_s"] < 0.98 * none["sim_s"]
    assert waves["preemptions"] == none["preemptions"] == 0


def test_waves_hold_nothing_where_prefilling_costs_nothing():
    """Where a prefilling step costs no more (a CPU engine runs every step eagerly), the fit keeps
    a wave of 1 and the run is step for step the run without waves."""
    waves, none = waves_case(0.0)
    assert waves["waves_fitted"] and set(waves["waves_fitted"]) == {1} and waves["wave_holds"] == 0
    assert (waves["steps"], waves["sim_s"], waves["mixed_steps"]) == (none["steps"], none["sim_s"], none["mixed_steps"])


def test_vllms_usage_corrects_a_count_that_runs_high():
    """A runner that counts 76 tokens a row more than vLLM holds keeps fewer requests in flight;
    with kv_usage_feedback, checked once a simulated second against the simulated vLLM's usage, it
    gets back most of them, with no preemption. An exact count is left alone."""
    shape = SHAPES["135m"] | {"prefix": 1056, "private": 167}
    exact = run("runner-feedback", workload(1024, 64, shape), shape)
    high = run("runner-short76", workload(1024, 64, shape), shape)
    fixed = run("runner-short76-feedback", workload(1024, 64, shape), shape)
    assert exact["kv_usage_correction_max_blocks"] == 0
    assert exact["steps"] == run("runner", workload(1024, 64, shape), shape)["steps"]
    assert high["avg_running"] < 0.9 * exact["avg_running"]
    assert fixed["avg_running"] > high["avg_running"] + 0.5 * (exact["avg_running"] - high["avg_running"])
    assert fixed["steps"] < high["steps"] and fixed["preemptions"] == high["preemptions"] == 0


def test_requests_queued_in_vllm_give_no_correction():
    """With fewer slots than the cache holds (max_num_seqs 20-40), vLLM queues requests that hold no
    blocks yet: no sample is taken then, and an exact count gets no correction."""
    shape = SHAPES["135m"] | {"prefix": 1056, "private": 167}
    for slots in (20, 40):
        on = run("runner-feedback", workload(512, 32, shape), shape, max_num_seqs=slots)
        assert on["kv_usage_correction_max_blocks"] == 0


def test_windows_split_a_run_into_its_ramp_steady_state_and_tail():
    """The windows' means, weighted by their steps, give the run's own mean. On the 8B shape (every
    output as long) the start's requests, admitted by their peaks before any length is known, go in
    together and finish together (fewer run in the next window); once the pace spreads admissions
    out, the run holds more of the cache than at its start."""
    shape = small_8b()
    r = run("runner", workload(256, 8, shape), shape, windows=[260, 520, 1000])
    spans = [tuple(map(int, w["steps"].split("-"))) for w in r["windows"]]
    assert spans[0][0] == 0 and spans[-1][1] == r["steps"] and len(spans) == 4
    weighted = sum((hi - lo) * w["running"] for (lo, hi), w in zip(spans, r["windows"])) / r["steps"]
    assert abs(weighted - r["avg_running"]) < 0.2
    start, dip, paced = r["windows"][:3]
    assert dip["running"] < start["running"] and paced["kv_usage"] > start["kv_usage"]


def test_pacing_before_lengths_are_known_admits_fewer_at_the_start():
    """paceearly paces the first admissions too (every row taken to run to max_tokens), so fewer
    requests run in the first output's steps than when the start is admitted by peaks."""
    shape = small_8b()
    base = run("runner", workload(256, 8, shape), shape, windows=[200])
    early = run("runner-paceearly", workload(256, 8, shape), shape, windows=[200])
    assert early["windows"][0]["running"] < base["windows"][0]["running"]
    assert early["preemptions"] == base["preemptions"] == 0
