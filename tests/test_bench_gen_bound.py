"""bench/gen_bound.py: a runner run's steps repriced at the fixed cost a step, against sorted's."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gen_bound import bounds

ROOT = Path(__file__).resolve().parents[1]


def runner_run(rnd, gen_s, steps, held, tokens=1000, rows=10, replicas=None, engines=1, drafts=0):
    engine = {"max_admitted": held, "loop": {"steps": steps}}
    if replicas:
        engine = {"replicas": [engine] * replicas}
    return {"case": "c", "config": "runner", "round": rnd, "generation_s": gen_s, "completion_tokens": tokens,
            "rows": rows, "calibration": {"chosen_draft_tokens": drafts}, "engines": [engine] * engines}


def sorted_run(rnd, gen_s, steps):
    return {"case": "c", "config": "sorted", "round": rnd, "generation_s": gen_s, "engine_steps": steps}


def test_the_per_request_part_is_kept_and_the_steps_repriced():
    # 10 s over 100 steps at 50 ms fixed: 5 s per-request part. Sorted: 80 steps, 12 s.
    # At 80 steps: 5 + 4 = 9 s (12 / 9); at 1000 tokens / 20 held = 50 steps: 5 + 2.5 s (12 / 7.5);
    # plus 1000 / 10 rows = 100 steps of ramp and tail: 5 + 7.5 s (12 / 12.5).
    runs = [runner_run(1, 10.0, 100, 20), sorted_run(1, 12.0, 80), sorted_run(2, 11.0, 80)]
    (row,) = bounds(runs, "c", fixed_ms=50.0)  # round 2 has no runner run: no row
    assert row["per_request_part_s"] == 5.0 and row["full_steps"] == 50 and row["ramp_and_tail_steps"] == 100
    assert row["measured_vs_sorted"] == 1.2
    assert row["at_sorted_steps_vs_sorted"] == round(12 / 9, 3)
    assert row["at_full_steps_vs_sorted"] == 1.6
    assert row["with_ramp_and_tail_vs_sorted"] == 0.96


def test_each_runner_run_is_set_against_the_sorted_run_of_its_own_round():
    runs = [sorted_run(1, 10.0, 100), sorted_run(2, 20.0, 100), runner_run(2, 10.0, 100, 10),
            runner_run(1, 10.0, 100, 10)]
    rows = bounds(runs, "c", fixed_ms=0.0)
    assert [(r["round"], r["measured_vs_sorted"]) for r in rows] == [(1, 1.0), (2, 2.0)]


def test_one_replica_of_ray_is_read_and_steps_round_up():
    runs = [runner_run(1, 10.0, 100, 30, tokens=1000, replicas=1), sorted_run(1, 10.0, 100)]
    (row,) = bounds(runs, "c", fixed_ms=0.0)
    assert row["full_steps"] == 34  # 1000 / 30, a part step is a step
    assert row["at_sorted_steps_vs_sorted"] == row["at_full_steps_vs_sorted"] == 1.0  # no fixed part: steps cost nothing


@pytest.mark.parametrize("run, why", [
    (runner_run(1, 10.0, 100, 10, engines=2), "2 engines"),
    (runner_run(1, 10.0, 100, 10, replicas=2), "2 replicas"),
    (runner_run(1, 10.0, 100, 10, drafts=3), "drafts"),
])
def test_runs_whose_steps_do_not_add_up_are_refused(run, why):
    with pytest.raises(SystemExit, match=f"Error: runner round 1: .*{why}"):
        bounds([run, sorted_run(1, 10.0, 100)], "c", fixed_ms=1.0)


def test_two_runs_of_one_configuration_in_a_round_are_refused():
    with pytest.raises(SystemExit, match="two sorted runs of c in round 1"):
        bounds([sorted_run(1, 10.0, 100), sorted_run(1, 11.0, 100)], "c", fixed_ms=1.0)


@pytest.mark.parametrize("runs", [[], [sorted_run(1, 1.0, 1)]])
def test_the_script_fails_with_an_error_line_when_no_round_pairs(tmp_path, runs):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"runs": runs}))
    done = subprocess.run([sys.executable, "bench/gen_bound.py", str(path), "--fixed-ms", "6"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode != 0 and done.stderr.strip().splitlines()[-1].startswith(f"Error: {path}: no round")


def test_the_script_takes_the_step_cost_fit_and_writes_the_medians(tmp_path):
    path, cost, out = tmp_path / "r.json", tmp_path / "cost.json", tmp_path / "out.json"
    # Rounds: measured 1.2x and 2.0x, 1.0x: the median is 1.2, not the mean or the first.
    path.write_text(json.dumps({"machine": "m", "commit": "c1", "runs": [
        runner_run(1, 10.0, 100, 20), sorted_run(1, 12.0, 80), runner_run(2, 10.0, 100, 20), sorted_run(2, 20.0, 80),
        runner_run(3, 10.0, 100, 20), sorted_run(3, 10.0, 80)]}))
    cost.write_text(json.dumps({"machine": "gpu", "fits": {"json": {"fixed_ms": 50.0}, "text": {"fixed_ms": 1.0}}}))
    done = subprocess.run([sys.executable, "bench/gen_bound.py", str(path), "--case", "c", "--step-cost", str(cost),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["commit"] == "c1" and doc["fixed_ms"] == 50.0 and doc["fixed_ms_machine"] == "gpu"
    assert doc["medians"]["measured_vs_sorted"] == 1.2 and doc["medians"]["at_full_steps_vs_sorted"] == 1.6
    assert len(doc["rounds"]) == 3
