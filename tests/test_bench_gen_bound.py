"""bench/gen_bound.py: a runner run's steps repriced at the fixed cost a step, against sorted's."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gen_bound import bounds

ROOT = Path(__file__).resolve().parents[1]


def runner_run(rnd, gen_s, steps, held, tokens=1000, local=True):
    engine = {"max_admitted": held, "loop": {"steps": steps}}
    return {"case": "c", "config": "runner", "round": rnd, "generation_s": gen_s, "completion_tokens": tokens,
            "engines": [{"kv_total_blocks": 1}, engine if local else {"replicas": [engine]}]}


def sorted_run(rnd, gen_s, steps):
    return {"case": "c", "config": "sorted", "round": rnd, "generation_s": gen_s, "engine_steps": steps}


def test_the_per_request_part_is_kept_and_the_steps_repriced():
    # 10 s over 100 steps at 50 ms fixed: 5 s per-request part. Sorted: 80 steps, 12 s.
    # At 80 steps: 5 + 4 = 9 s (12 / 9); at 1000 tokens / 20 held = 50 steps: 5 + 2.5 s (12 / 7.5).
    runs = [runner_run(1, 10.0, 100, 20), sorted_run(1, 12.0, 80), sorted_run(2, 11.0, 80)]
    (row,) = bounds(runs, "c", fixed_ms=50.0)  # round 2 has no runner run: no row
    assert row["per_request_part_s"] == 5.0 and row["full_steps"] == 50
    assert row["measured_vs_sorted"] == 1.2
    assert row["at_sorted_steps_vs_sorted"] == round(12 / 9, 3)
    assert row["at_full_steps_vs_sorted"] == 1.6


def test_a_ray_run_reads_its_replica_and_steps_round_up():
    runs = [runner_run(1, 10.0, 100, 30, tokens=1000, local=False), sorted_run(1, 10.0, 100)]
    (row,) = bounds(runs, "c", fixed_ms=0.0)
    assert row["full_steps"] == 34  # 1000 / 30, a part step is a step
    assert row["at_sorted_steps_vs_sorted"] == row["at_full_steps_vs_sorted"] == 1.0  # no fixed part: steps cost nothing


@pytest.mark.parametrize("runs", [[], [sorted_run(1, 1.0, 1)]])
def test_the_script_fails_with_an_error_line_when_no_round_pairs(tmp_path, runs):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"runs": runs}))
    done = subprocess.run([sys.executable, "bench/gen_bound.py", str(path), "--fixed-ms", "6"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode != 0 and done.stderr.strip().splitlines()[-1].startswith(f"Error: {path}: no round")


def test_the_script_writes_the_medians(tmp_path):
    path, out = tmp_path / "r.json", tmp_path / "out.json"
    path.write_text(json.dumps({"machine": "m", "commit": "c1", "runs": [runner_run(1, 10.0, 100, 20),
                                                                         sorted_run(1, 12.0, 80)]}))
    done = subprocess.run([sys.executable, "bench/gen_bound.py", str(path), "--case", "c", "--fixed-ms", "50",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["commit"] == "c1" and doc["medians"]["at_full_steps_vs_sorted"] == 1.6
    assert doc["fixed_ms_from"] == "--fixed-ms" and len(doc["rounds"]) == 1
