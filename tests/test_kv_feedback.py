"""runner/engines/kv_feedback.py: the budget's count of blocks checked against vLLM's own usage."""
from __future__ import annotations

from runner.engines.admission import KvBudget
from runner.engines.base import Request
from runner.engines.kv_feedback import MAX_SHARE, MIN_SAMPLES, UsageFeedback


def usage_for(blocks: float, total: int) -> float:
    return blocks / total  # of the blocks vLLM can allocate (its pool less its null block), as the budget counts


def test_the_smallest_recent_excess_becomes_the_correction():
    f = UsageFeedback(1001)
    for counted, actual in [(800, 600), (800, 650)][:MIN_SAMPLES - 1]:
        f.observe(counted, usage_for(actual, 1001))
    assert f.blocks == 0  # too few samples to trust
    f.observe(800, usage_for(700, 1001))
    assert f.blocks == 100  # the smallest of 200, 150, 100
    f.observe(800, usage_for(900, 1001))  # the count below the usage: no correction, not a negative one
    assert f.blocks == 0
    assert f.describe()["kv_usage_correction_max_blocks"] == 100


def test_the_correction_is_capped_and_a_preemption_halves_the_cap():
    f = UsageFeedback(1001)
    for _ in range(MIN_SAMPLES):
        f.observe(1000, 0.0)
    assert f.blocks == int(MAX_SHARE * 1001)
    f.preempted()
    assert f.blocks == 0
    for _ in range(MIN_SAMPLES - 1):
        f.observe(1000, 0.0)
    assert f.blocks == 0  # samples from before the preemption are gone
    f.observe(1000, 0.0)
    assert f.blocks == int(MAX_SHARE * 1001) // 2


def test_a_preemption_without_a_correction_leaves_the_cap():
    """A preemption that the correction did not cause (none was in force) does not shrink what a
    later correction may be."""
    f = UsageFeedback(1001)
    f.preempted()
    for _ in range(MIN_SAMPLES):
        f.observe(900, usage_for(400, 1001))
    assert f.blocks == int(MAX_SHARE * 1001)


def test_the_budget_keeps_the_feedback_only_where_it_means_something():
    """Off by default; on only with a known cache and the projection (which keeps the count:
    speculation turns it off); no sample while requests wait in vLLM's queue."""
    assert not KvBudget(total_blocks=100, block_tokens=16).feedback.enabled
    assert KvBudget(total_blocks=100, block_tokens=16, usage_feedback=True).feedback.enabled
    assert not KvBudget(total_blocks=100, block_tokens=16, project=False, usage_feedback=True).feedback.enabled
    assert not KvBudget(total_blocks=None, block_tokens=16, usage_feedback=True).feedback.enabled
    b = KvBudget(total_blocks=100, block_tokens=16, usage_feedback=True)
    b.submitted(b.admit(Request("r0", "g", list(range(320)), 16, 0)))
    b.observe_usage(0.0, waiting=3)
    assert b.feedback.samples == 0
    b.observe_usage(0.0)
    assert b.feedback.samples == 1


def test_switched_off_it_reports_the_gap_and_corrects_nothing():
    f = UsageFeedback(1001, enabled=False)
    for _ in range(5):
        f.observe(800, usage_for(600, 1001))
    assert f.blocks == 0 and f.describe()["kv_count_minus_usage_blocks"] == 200.0


def budget_with_two_sent(feedback: bool) -> tuple[KvBudget, Request]:
    b = KvBudget(total_blocks=60, block_tokens=16, project=False)
    b.project = True  # the count is kept (blocks_held); the projection then joins the sum of peaks
    b.feedback = UsageFeedback(60, enabled=feedback)
    for i in range(2):  # 160 prompt tokens and 161 output: 22 blocks at the peak by the sum, 10 held now
        b.submitted(b.admit(Request(f"r{i}", "g", list(range(160)), 161, 0)))
    return b, Request("r2", "g", list(range(160)), 161, 0)


def test_a_count_above_vllms_usage_lets_in_a_request_the_count_kept_out():
    """Two requests count 20 blocks held now while vLLM reports 5: the excess (15) goes to the room,
    and a third request that did not fit (66 of 60 blocks by the sum of peaks, 63 projected) now does; with the
    feedback off it does not."""
    for feedback, admitted in ((True, True), (False, False)):
        b, third = budget_with_two_sent(feedback)
        assert b.blocks_held() == 20 and not b.can_admit(third)
        for _ in range(MIN_SAMPLES):
            b.observe_usage(usage_for(5, 60))
        assert b.feedback.blocks == (15 if feedback else 0)
        assert b.can_admit(third) is admitted
