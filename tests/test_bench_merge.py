"""bench/merge.py: one lease's per-GPU results files become one file with the issue's keys."""
import json

from bench.merge import merge


def bench_file(path, case, walls: dict[str, list[float]]):
    """A bench.py results file: process seconds per configuration, one entry per round."""
    runs = [{"case": case, "config": cfg, "round": i + 1, "process_s": w, "documents_per_s": 1000 / w}
            for cfg, ws in walls.items() for i, w in enumerate(ws)]
    path.write_text(json.dumps({"machine": "m", "date": "d", "commit": "c", "runs": runs}))
    return path


def test_streams_merge_into_the_keys_with_warm_and_extra_rounds(tmp_path):
    tight = bench_file(tmp_path / "a.json", "invoices/tight/135m",
                       {"plain": [300.0, 80.0, 70.0], "sorted": [80.0, 70.0, 60.0], "runner": [60.0, 50.0, 50.0]})
    big = bench_file(tmp_path / "b.json", "invoices/tight/8b", {"sorted": [90.0, 80.0, 80.0], "runner": [90.0, 64.0, 80.0]})
    extra = bench_file(tmp_path / "c.json", "invoices/tight/135m", {"sorted": [40.0], "runner": [80.0]})
    doc = merge([tight, big], [extra], warm_from=2)
    # Per-round ratios plain/runner: 5.0, 1.6, 1.4 -> median 1.6; warm rounds 1.6 and 1.4.
    assert doc["tight_wall_speedup"] == 1.6 and doc["tight_wall_speedup_range"] == [1.4, 5.0, 3]
    assert doc["warm_rounds_only"]["tight_wall_speedup"] == [1.5, 1.4, 1.6, 2]
    assert doc["tight_wall_speedup_8b_vs_sorted"] == 1.0 and "tight_wall_speedup_8b" not in doc  # no plain
    # The extra round is round 4: in the raw runs and with_extra_rounds, not in the main medians.
    assert doc["tight_wall_speedup_vs_sorted"] == 1.3333
    assert doc["with_extra_rounds"]["tight_wall_speedup_vs_sorted"] == [1.2667, 0.5, 1.4, 4]  # 0.5, 1.2, 1.33, 1.4
    assert sorted({r["round"] for r in doc["runs"]}) == [1, 2, 3, 4] and len(doc["runs"]) == 17
