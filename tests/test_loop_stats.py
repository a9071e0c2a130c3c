"""The driver-loop sums an engine stores with its adaptation (runner/engines/loop_stats.py)."""
from runner.engines.loop_stats import LoopStats


def test_summary_gives_per_step_means_and_kv_usage_beside_the_runners_count():
    stats = LoopStats()
    for in_flight, held in ((4, 0), (8, 2), (6, 1)):
        stats.stepped(in_flight, held)
    stats.sent(9)
    stats.sent(3)
    stats.add("step_wait_s", 0.25)
    stats.add("step_wait_s", 0.5)
    stats.kv_sample(0.5, 0.25)
    stats.kv_sample(0.9, 0.75)
    out = stats.summary(counted=True)
    assert out["steps"] == 3 and out["max_in_flight_seen"] == 9 and out["step_wait_s"] == 0.75
    assert out["mean_in_flight"] == 6.0 and out["mean_held"] == 1.0
    assert out["mean_kv_usage"] == 0.7 and out["kv_usage_max"] == 0.9 and out["mean_kv_counted"] == 0.5
    assert "kv_usage_sum" not in out and "kv_counted_sum" not in out


def test_no_count_and_no_samples_are_none_not_zero():
    stats = LoopStats()
    stats.kv_sample(0.4, None)
    assert stats.summary(counted=False)["mean_kv_counted"] is None
    empty = LoopStats().summary(counted=True)
    assert empty["mean_kv_usage"] is None and empty["mean_kv_counted"] is None and empty["mean_in_flight"] == 0.0
