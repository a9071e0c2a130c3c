"""Adapting to the job: the KV admission budget and the speculative-decoding choice (pure logic + fake engine)."""
from __future__ import annotations

import json
import math
import random
import sqlite3
from typing import Optional

import numpy as np
import pytest

from runner.engines.speculation import choose, predict, speculative_config
from runner.engines.sequence import Phase
from runner.engines.admission import KvBudget
from runner.engines.output_lengths import OutputLengths
from runner.engines.feed import Feed
from runner.engines.base import EngineCounters, Request
from runner.engines.fake import FakeEngine
from runner.run import run_job
from runner.spec import load_job
from tests.conftest import SCHEMA


def req(prompt=100, cacheable=0, max_tokens=64):
    return Request("r", "g", list(range(prompt)), max_tokens, cacheable)


def test_budget_admits_while_blocks_fit_and_always_one():
    b = KvBudget(total_blocks=20, block_tokens=16, project=False)
    r = req(prompt=100, cacheable=64, max_tokens=60)  # (36 + 60) / 16 -> 6 blocks, +1 partial; prefix 4
    other_group = Request("o", "h", list(range(100)), 60, 64)
    assert b.need(r) == 7
    assert b.can_admit(r)
    t = b.admit(r)
    assert b.can_admit(r)  # 7 + 7 + one shared prefix of 4 = 18 <= 20
    assert not b.can_admit(other_group)  # its own prefix too: 7 + 7 + 4 + 4 > 20
    b.release(t, completion_tokens=30)
    assert b.used == 0 and b.can_admit(req(prompt=5000))  # an empty engine takes any request


def test_every_group_in_flight_holds_its_prefix_until_its_last_request():
    b = KvBudget(total_blocks=1000, block_tokens=16, project=False)
    g1 = [b.admit(Request(f"a{i}", "a", list(range(200)), 10, 160)) for i in range(3)]  # prefix 10 blocks
    g2 = b.admit(Request("b0", "b", list(range(400)), 10, 320))  # prefix 20 blocks
    assert b.reserved_blocks() == 30
    b.release(g1[0], 10)
    b.release(g1[1], 10)
    assert b.reserved_blocks() == 30  # one request of group a still runs: its prefix stays
    b.release(g1[2], 10)
    assert b.reserved_blocks() == 20
    b.release(g2, 10)
    assert b.reserved_blocks() == 0


def test_budget_learns_the_output_length():
    b = KvBudget(total_blocks=None, block_tokens=16, min_output_samples=10)
    assert b.output_estimate(200) == 200
    for n in range(10):
        b.release(b.admit(req()), completion_tokens=[40, 40, 40, 40, 40, 40, 40, 40, 90, 120][n])
    assert b.output_estimate(200) == 90 + 8  # the 90th percentile, so that long outputs fit too
    assert b.output_estimate(30) == 30
    assert b.can_admit(req(prompt=10**6))  # unknown cache size: no limit


def test_preemption_shrinks_the_budget_for_a_while():
    """A preemption takes 15% off the budget, never below 70% of the cache; steps without one give
    it back, 1% of the cache per 16 steps, up to the whole cache."""
    b = KvBudget(total_blocks=1000, block_tokens=16)
    for _ in range(10):
        b.admit(req(cacheable=32))
    b.on_preemption()
    assert b.budget == 850 and b.preemptions_seen == 1
    assert b.describe()["kv_budget_blocks"] == b.budget
    for _ in range(5):
        b.on_preemption()
    assert b.budget == 700
    for _ in range(15):
        b.tick()
    assert b.budget == 700  # not before 16 steps without a preemption
    b.tick()
    assert b.budget == 710
    for _ in range(16 * 40):
        b.tick()
    assert b.budget == 1000


def simulate(budget: KvBudget, rows: int, prompt: int, output, steps: int = 20_000, shuffle: bool = True,
             held_while_waiting: Optional[list] = None, max_tokens: int = 128):
    """Admit greedily; every sent request makes one token a step and holds ceil(tokens/block) blocks,
    as vLLM allocates them. Returns (most blocks ever held, most requests at once, steps taken);
    `held_while_waiting` gets the blocks held at each step in which rows were still waiting."""
    running: dict[int, list[int]] = {}  # ticket -> [tokens now, tokens at the end]
    waiting = list(range(rows))
    if shuffle:
        random.Random(0).shuffle(waiting)  # lengths arrive in no order, as rows do
    most_blocks = most_running = 0
    for step in range(steps):
        while waiting and budget.can_admit(req(prompt=prompt, max_tokens=max_tokens)):
            n = waiting.pop()
            t = budget.admit(req(prompt=prompt, max_tokens=max_tokens))
            budget.submitted(t)
            running[t] = [prompt, prompt + output(n)]
        for t, toks in list(running.items()):
            toks[0] += 1
            if toks[0] >= toks[1]:
                budget.release(t, toks[1] - prompt)
                del running[t]
        budget.tick()
        held = sum(math.ceil(a / budget.block_tokens) for a, _ in running.values())
        most_blocks, most_running = max(most_blocks, held), max(most_running, len(running))
        if waiting and held_while_waiting is not None:
            held_while_waiting.append(held)
        if not waiting and not running:
            break
    return most_blocks, most_running, step + 1


@pytest.mark.parametrize("output", [lambda n: 40 + n % 60, lambda n: 128 if n % 4 == 0 else 50 + n % 30])
def test_projection_admits_more_than_the_sum_of_peaks_and_never_overflows(output):
    """Requests sent earlier finish earlier, so the cache never holds all of them at their peaks: the
    projection runs more requests at once than reserving every peak, and still never needs more
    blocks than the cache has (here, outputs one token a step, as the projection assumes)."""
    peaks = KvBudget(total_blocks=200, block_tokens=16, project=False)
    projected = KvBudget(total_blocks=200, block_tokens=16)
    blocks_peaks, running_peaks, _ = simulate(peaks, 400, 150, output)
    blocks_proj, running_proj, _ = simulate(projected, 400, 150, output)
    assert blocks_peaks <= 200 and blocks_proj <= 200
    assert running_proj > running_peaks
    assert projected.admitted_over_peaks > 0


def test_a_few_long_outputs_do_not_make_every_request_plan_for_max_tokens():
    """One output in 7 runs to max_tokens (a model that loops on some rows): the 90th percentile is
    max_tokens. The projection plans for the sum (expected blocks plus a margin), not for every
    request at the 90th percentile: the cache stays at least 84% used while rows wait (85% here,
    where every row is of one group; the percentile rule held 82%) and never overflows."""
    b = KvBudget(total_blocks=400, block_tokens=16, max_running=256)
    held: list[int] = []
    most_blocks, _, _ = simulate(b, 600, 150, lambda n: 128 if n % 7 == 0 else 40 + n % 40, held_while_waiting=held)
    assert b.output_estimate(128) == 128
    assert most_blocks <= 400
    assert sum(held) / len(held) >= 0.84 * 400


def test_pacing_breaks_up_waves_of_equally_long_outputs():
    """Every output 128 tokens: requests admitted together peak together, so without pacing the cache
    holds one wave at a time, sized by peaks. Paced, admissions spread out after the first wave:
    the same rows finish in fewer steps, and the cache still never overflows."""
    runs = {}
    for pace in (False, True):
        b = KvBudget(total_blocks=400, block_tokens=16, max_running=256, pace=pace)
        runs[pace] = simulate(b, 600, 150, lambda n: 128)
        assert runs[pace][0] <= 400
        assert (b.pace_waits > 0) == pace
    assert runs[True][2] < 0.95 * runs[False][2]


def test_pacing_leaves_outputs_of_varied_length_and_a_roomy_cache_alone():
    """Varied lengths do not travel in waves; a cache that holds max_num_seqs at their peaks does not bind."""
    varied = KvBudget(total_blocks=400, block_tokens=16, max_running=256)
    simulate(varied, 600, 150, lambda n: 20 + n % 108)
    roomy = KvBudget(total_blocks=100_000, block_tokens=16, max_running=64)
    simulate(roomy, 600, 150, lambda n: 128)
    assert varied.pace_waits == 0 and roomy.pace_waits == 0


def test_pacing_follows_a_change_of_output_length():
    """Rows of one kind (128 tokens) then of another (32): the pace is set by recent outputs, so
    after the change it admits as fast as the shorter outputs allow, not at the old rate."""
    steps = {}
    for pace in (False, True):
        b = KvBudget(total_blocks=400, block_tokens=16, max_running=256, pace=pace)
        steps[pace] = simulate(b, 3000, 150, lambda n: 128 if n >= 2400 else 32, shuffle=False)[2]
    assert steps[True] <= 1.05 * steps[False]


def test_pacing_leaves_no_debt_when_a_request_does_not_fit_at_all():
    """A group whose prefix alone exceeds the room waits for the fit tests; meanwhile the pace's
    bucket does not drain, and a small request that fits goes in."""
    b = KvBudget(total_blocks=400, block_tokens=16, max_running=256, min_output_samples=4)
    for _ in range(4):  # four equal outputs: uniform
        t = b.admit(req(prompt=100, max_tokens=64))
        b.submitted(t)
        b.release(t, 64)
    t = b.admit(req(prompt=100, max_tokens=64))
    b.submitted(t)
    huge = Request("h", "big", list(range(8000)), 64, 7680)  # a 480-block prefix
    for _ in range(300):
        assert not b.can_admit(huge)
        b.tick()
    assert b._bucket is None or b._bucket >= -1
    assert b.can_admit(req(prompt=100, max_tokens=64))


def test_pacing_with_the_feed_finishes_every_group_and_takes_fewer_steps():
    """The Feed and KvBudget as the engine drives them: groups of 16 behind their leaders, one token
    a step for sent requests, a step only while something is in flight. Every row finishes within
    a bound (no stall), and pacing takes fewer steps than waves."""
    steps = {pace: feed_replay(pace, groups=24, per_group=16, output=96) for pace in (False, True)}
    assert steps[True] < steps[False]


def feed_replay(pace: bool, groups: int, per_group: int, output: int, max_steps: int = 20_000) -> int:
    budget = KvBudget(total_blocks=600, block_tokens=16, max_running=256, pace=pace)
    feed = Feed(budget, max_in_flight=1024, per_step=64, warm_prefix=True, clock=lambda: 0.0)
    feed.add([Request(f"g{g}r{i}", f"g{g}", list(range(400)), 128, 320)
              for g in range(groups) for i in range(per_group)])
    made: dict[str, int] = {}
    for step in range(max_steps):
        for a in feed.to_send():
            feed.sent(a.request.row_id, a)
            made[a.request.row_id] = 0
        assert feed.in_flight, "nothing in flight and nothing sent: admission stalled"
        for rid in list(feed.in_flight):
            made[rid] += 1
            feed.progressed(rid)
            if made[rid] >= output:
                feed.finished(rid, output)
        budget.tick()
        if feed.idle():
            return step + 1
    raise AssertionError(f"not done in {max_steps} steps")


def phase(k, tok_s, drafts=0, per_pos=()):
    return Phase(k, rows=10, output_tokens=int(tok_s * 10), generation_s=10.0,
                 counters=EngineCounters(spec_drafts=drafts, spec_accepted_per_pos=list(per_pos)))


def test_high_acceptance_small_batch_chooses_speculation():
    # 90%, 80%, ... acceptance; drafting 6 doubled throughput: every length is predicted, the best kept.
    spec = phase(6, 200.0, drafts=100, per_pos=[90, 80, 70, 60, 50, 40])
    plain = phase(0, 100.0)
    ratios = predict(spec, plain)
    assert ratios[6] == pytest.approx(2.0) and ratios[0] == 1.0
    k, record = choose(spec, plain)
    assert k == max(ratios, key=ratios.get) and k >= 2
    assert record["chosen_draft_tokens"] == k and len(record["phases"]) == 2


def test_speculation_that_costs_throughput_is_turned_off():
    # Low acceptance, and six drafts took 60% off: no draft length is predicted to pay.
    spec = phase(6, 40.0, drafts=100, per_pos=[30, 10, 3, 1, 0, 0])
    k, record = choose(spec, phase(0, 100.0))
    assert k == 0 and record["relative_throughput"]["6"] == pytest.approx(0.4)
    assert all(r < 1 for key, r in record["relative_throughput"].items() if key != "0")


def test_short_drafts_win_when_acceptance_falls_fast():
    # The first draft token is accepted often, later ones rarely: fewer drafts cost less to verify.
    spec = phase(6, 105.0, drafts=100, per_pos=[80, 20, 5, 1, 0, 0])
    k, _ = choose(spec, phase(0, 100.0), min_draft_tokens=1)
    assert k in (1, 2)


def test_speculative_config_keeps_the_method():
    base = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert speculative_config(base, 0) is None
    assert speculative_config(base, 3) == base | {"num_speculative_tokens": 3}


def test_auto_speculation_calibrates_on_the_jobs_own_rows(make_job):
    job = load_job(make_job(rows=20, engine={"speculative": "auto", "calibration": {"rows": 4, "max_draft_tokens": 5}}))
    started = []

    def factory(j):
        started.append(j.engine.speculative)
        return FakeEngine(SCHEMA)

    s = run_job(job, engine_factory=factory)
    assert started[0] is None and started[1].num_speculative_tokens == 5  # the plain engine sizes the batch
    assert s.stats["rows_total"] == 20
    con = sqlite3.connect(job.database_path)
    assert con.execute("SELECT count(DISTINCT row_id) FROM results").fetchone()[0] == 20
    choice = json.loads(con.execute("SELECT engine_choice_json FROM run_stats").fetchone()[0])
    cal = choice["speculative_calibration"]
    assert [p["rows"] for p in cal["phases"]][:2] == [4, 4]
    # The fake engine makes no drafts: the choice is whichever slice measured faster, no more.
    faster = cal["relative_throughput"]["5"] > 1
    assert cal["chosen_draft_tokens"] == (5 if faster else 0) and len(choice["engines"]) == len(started)


def test_a_predicted_draft_length_is_measured_and_dropped_when_it_loses(make_job):
    """k=6 is measured slower than no drafts, but its acceptance predicts that k=2 would win; the
    runner measures k=2 before trusting it, finds it slower still, and runs the job without drafts."""
    import types

    job = load_job(make_job(rows=40, engine={"speculative": "auto", "calibration": {"rows": 10, "max_draft_tokens": 6}}))
    cost = {None: 0.02, 6: 0.03, 2: 0.08}  # seconds a row, on a fake clock: the test cannot be timing-flaky
    clock = types.SimpleNamespace(now=0.0)
    started = []

    class Drafting(FakeEngine):
        def generate(self, requests):
            for c in super().generate(requests):
                clock.now += cost[self.k]
                yield c

        def counters(self):
            c = super().counters()
            if self.k:  # acceptance that falls fast with the draft position
                c.spec_drafts = 100 * len(self.seen)
                c.spec_accepted_per_pos = [int(p * 100 * len(self.seen)) for p in (0.9, 0.8, 0.5, 0.2, 0.1, 0.05)[:self.k]]
            return c

    engines = []

    def factory(j):
        k = j.engine.speculative.num_speculative_tokens if j.engine.speculative else None
        started.append(k)
        e = Drafting(SCHEMA)
        e.k = k
        engines.append(e)
        return e

    s = run_job(job, engine_factory=factory, clock=lambda: clock.now)
    assert started == [None, 6, 2, None]
    # Every measured engine ran one throwaway request first; the main-pass engine did not need one.
    assert [len(e.warmed) for e in engines] == [1, 1, 1, 0]
    choice = json.loads(sqlite3.connect(job.database_path).execute("SELECT engine_choice_json FROM run_stats").fetchone()[0])
    cal = choice["speculative_calibration"]
    assert cal["chosen_draft_tokens"] == 0
    assert [p["draft_tokens_setting"] for p in cal["phases"]] == [0, 6, 2]
    assert cal["relative_throughput"]["2"] > 1  # predicted to win...
    assert cal["phases"][2]["output_tokens_per_s"] < cal["phases"][0]["output_tokens_per_s"]  # ...measured to lose
    assert s.stats["rows_total"] == 40


@pytest.mark.parametrize("batch, measured", [(300, False), (256, True), (None, True)])
def test_speculation_is_measured_only_for_small_batches(make_job, batch, measured):
    """An engine that runs more than calibration.max_batch (256) requests at once is compute-bound:
    the plain engine that sized the batch runs the whole job. An unknown batch size is measured."""
    job = load_job(make_job(rows=30, engine={"speculative": "auto", "calibration": {"rows": 4, "max_draft_tokens": 3}}))
    started = []

    def factory(j):
        started.append(j.engine.speculative)
        e = FakeEngine(SCHEMA)
        e.batch = batch
        return e

    s = run_job(job, engine_factory=factory)
    con = sqlite3.connect(job.database_path)
    assert con.execute("SELECT count(*), count(DISTINCT row_id) FROM results").fetchone() == (30, 30)
    cal = json.loads(con.execute("SELECT engine_choice_json FROM run_stats").fetchone()[0])["speculative_calibration"]
    assert cal.get("expected_batch") == batch
    if measured:
        assert len(started) >= 2 and "phases" in cal and "skipped" not in cal
    else:
        assert started == [None] and cal["chosen_draft_tokens"] == 0 and "300 requests" in cal["skipped"]
    assert s.stats["rows_total"] == 30
    from runner.summary import speculation
    shown = speculation(con.execute("SELECT engine_choice_json FROM run_stats").fetchone()[0])
    # "measured" only where drafts were: the start of the one engine is not a measurement
    assert ("measured in" in shown) == measured and shown.endswith("stored as calibration #1)"), shown


def test_budget_capacity_counts_the_prefix_reserve():
    b = KvBudget(total_blocks=100, block_tokens=16)
    r = req(prompt=320, cacheable=160, max_tokens=64)  # 10 prefix blocks; needs ceil((160+64)/16)+1 = 15
    assert b.need(r) == 15
    assert b.capacity(r) == (100 - 2 * 10) // 15
    assert KvBudget(None, 16).capacity(r) is None


def test_a_job_that_fits_in_the_first_slice_starts_one_engine(make_job):
    job = load_job(make_job(rows=5, engine={"speculative": "auto", "calibration": {"rows": 8}}))
    started = []

    def factory(j):
        started.append(j.engine.speculative)
        return FakeEngine(SCHEMA)

    s = run_job(job, engine_factory=factory)
    cal = json.loads(sqlite3.connect(job.database_path).execute(
        "SELECT engine_choice_json FROM run_stats").fetchone()[0])["speculative_calibration"]
    assert started == [None] and s.stats["rows_total"] == 5
    assert cal["chosen_draft_tokens"] == 0 and "first slice" in cal["skipped"]


def test_admissions_refused_for_room_do_not_pile_up_into_a_wave():
    """Paced, with the cache full: the pace keeps accruing while the fit tests refuse. When room
    frees at once (a wave finishes), the requests that go in together are one pace's worth, not
    everything the bucket would have saved meanwhile: a burst admitted together peaks together."""
    b = KvBudget(total_blocks=400, block_tokens=16, max_running=256, min_output_samples=4)
    for _ in range(4):  # four equal outputs: uniform, so the pace applies
        t = b.admit(req(prompt=150, max_tokens=128))
        b.submitted(t)
        b.release(t, 128)
    running = []
    while b.can_admit(req(prompt=150, max_tokens=128)):
        running.append(b.admit(req(prompt=150, max_tokens=128)))
        b.submitted(running[-1])
        for _ in range(8):
            b.tick()
    refused_for_room = 0
    for _ in range(200):  # the pace would have refilled its whole bucket many times over
        b.tick()
        if not b.can_admit(req(prompt=150, max_tokens=128)) and b._bucket is not None and b._bucket >= 1:
            refused_for_room += 1
    assert refused_for_room > 0
    for t in running:  # the whole wave finishes
        b.release(t, 128)
    together = 0
    while b.can_admit(req(prompt=150, max_tokens=128)):
        b.submitted(b.admit(req(prompt=150, max_tokens=128)))
        together += 1
    assert together == 1


def test_blocks_held_counts_what_sent_requests_hold_now():
    """Unshared prompt plus the tokens made so far (one a step since the request was sent), in
    whole blocks, plus each group's prefix once; admitted requests not sent yet hold nothing."""
    b = KvBudget(total_blocks=1000, block_tokens=16)
    a1 = b.admit(req(prompt=100, cacheable=64))  # group "g", 36 unshared tokens
    a2 = b.admit(req(prompt=100, cacheable=64))
    b.admit(req(prompt=100, cacheable=64))  # admitted, not sent
    b.submitted(a1)
    for _ in range(10):
        b.tick()
    b.submitted(a2)
    for _ in range(3):
        b.tick()
    assert b.blocks_held() == math.ceil((36 + 13) / 16) + math.ceil((36 + 3) / 16) + 64 // 16
    for _ in range(100):  # past max_tokens (64): a request holds no more than its longest output
        b.tick()
    assert b.blocks_held() == 2 * math.ceil((36 + 64) / 16) + 64 // 16
    b.max_running = 1  # vLLM runs one; the other sent request waits in its queue, holding nothing
    assert b.blocks_held() == math.ceil((36 + 64) / 16) + 64 // 16


def test_a_groups_head_is_counted_once_with_the_row_that_computes_it():
    """The group's first row finds nothing in the cache (cacheable 0) and computes the head its
    followers then share: its own blocks beyond the head plus the head once, never the head twice
    (counted twice, the budget refused rows while vLLM had room: on the H200, vLLM used 71% of the
    cache where the runner counted 84-90%)."""
    b = KvBudget(total_blocks=1000, block_tokens=16)
    leader = Request("a", "g", list(range(100)), 64, 0, shared_tokens=70)  # head: 4 whole blocks
    follower = Request("b", "g", list(range(100)), 64, 64, shared_tokens=70)
    assert b.need(leader) == b.need(follower) == math.ceil((36 + 64) / 16) + 1
    for r in (leader, follower):
        b.submitted(b.admit(r))
    b.tick()
    assert b.reserved_blocks() == 4
    assert b.blocks_held() == 2 * math.ceil((36 + 1) / 16) + 4


def test_without_prefix_caching_every_row_holds_its_whole_prompt():
    """With vLLM's prefix cache off nothing is shared: a row's head is its own (a budget that
    counted it shared undercounted every row, and preempted on every check)."""
    follower = Request("b", "g", list(range(100)), 64, 64, shared_tokens=70)
    shared, unshared = KvBudget(1000, 16), KvBudget(1000, 16, shared_prefixes=False)
    assert shared.unshared(follower) == 36 and unshared.unshared(follower) == 100
    assert unshared.need(follower) == math.ceil((100 + 64) / 16) + 1
    unshared.admit(follower)
    assert unshared.reserved_blocks() == 0


def test_a_head_longer_than_the_prompt_leaves_the_last_token_unshared():
    b = KvBudget(1000, 16)
    odd = Request("x", "g", list(range(40)), 8, 0, shared_tokens=500)  # inconsistent counts
    assert b.unshared(odd) >= 1 and b.need(odd) >= 1


def test_survival_follows_the_recent_lengths_then_max_tokens():
    """P(still running x steps ahead), given how far a request ran: from the recent cohort's
    lengths; one past the longest of them, or any before enough are known, runs to max_tokens."""
    lengths = OutputLengths(min_samples=4)
    ahead = np.array([0, 10, 20, 30])
    age, cap = np.array([0, 25, 45]), np.array([100, 100, 100])
    assert (lengths.survival(age, cap, ahead) == (age[:, None] + ahead < cap[:, None])).all()  # none known
    for ticket, n in enumerate([10, 20, 30, 40]):
        lengths.finished(ticket, n)
    alive = lengths.survival(age, cap, ahead)
    assert alive[0].tolist() == [1.0, 0.75, 0.5, 0.25]  # fresh: 4, 3, 2, 1 of 4 are longer
    assert alive[1].tolist() == [1.0, 0.5, 0.0, 0.0]  # ran 25: only the 30 and 40 are longer
    assert alive[2].tolist() == [1.0, 1.0, 1.0, 1.0]  # past the longest (40): up to max_tokens
    assert lengths.support_end(age, cap).tolist() == [40, 40, 100]


def test_a_large_max_tokens_does_not_inflate_the_projection():
    """Outputs of 40-99 tokens: a max_tokens of 4096 may not change the plan much from one of 256
    (the projection's steps ahead end where the recent lengths do)."""
    peaks = {}
    for max_tokens in (256, 4096):
        b = KvBudget(total_blocks=2000, block_tokens=16, max_running=256, min_output_samples=4)
        for n in range(32):
            t = b.admit(Request(f"w{n}", "g", list(range(150)), max_tokens, 0))
            b.release(t, 40 + n * 59 // 31)
        for n in range(40):
            b.submitted(b.admit(Request(f"r{n}", f"g{n % 4}", list(range(150)), max_tokens, 0)))
            b.tick()
        peaks[max_tokens] = b.projected_peak(Request("q", "g0", list(range(150)), max_tokens, 0))
    assert peaks[4096] <= 1.02 * peaks[256]


def test_rows_of_one_group_get_a_larger_margin_than_rows_of_many():
    """Rows of one group tend to run about as long as each other: their deviations partly add up,
    so the same requests in one group project a higher peak than spread over many groups."""
    peaks = {}
    for groups in (1, 20):
        b = KvBudget(total_blocks=2000, block_tokens=16, max_running=256, min_output_samples=4)
        for n in range(32):
            b.release(b.admit(Request(f"w{n}", "g", list(range(150)), 256, 0)), 40 + n * 5)
        for n in range(40):
            b.submitted(b.admit(Request(f"r{n}", f"g{n % groups}", list(range(150)), 256, 0)))
        peaks[groups] = b.projected_peak(Request("q", "g0", list(range(150)), 256, 0))
    assert peaks[1] > peaks[20]


def test_requests_carry_their_groups_shared_head(make_job):
    """The builder gives every row its group's head (template and system prompt), the first row
    of a group too, whose cacheable tokens are 0."""
    from runner.plan import plan_stream
    from runner.prompting import builder_for
    from runner.readers import make_reader
    from runner.requests import RequestBuilder
    job = load_job(make_job(rows=12))
    docs = make_reader(job).documents(job.system_source)
    rb = RequestBuilder(job, builder_for(job))
    built = [r for _, chunk in rb.stream(plan_stream(docs, job.spec.plan_window_rows)) for r in chunk]
    assert len(built) == 12
    by_group: dict[str, list[Request]] = {}
    for r in built:
        by_group.setdefault(r.group_key, []).append(r)
    assert len(by_group) > 1
    for rows in by_group.values():
        head = rows[0].shared_tokens
        assert head > 0 and all(r.shared_tokens == head for r in rows)
        assert rows[0].cacheable_tokens == 0
        assert all(r.prompt_token_ids[:head] == rows[0].prompt_token_ids[:head] for r in rows)


def test_describe_reports_the_spread_of_finished_outputs():
    """Output lengths of the finished cohort as 10th, 50th and 90th percentiles, in whole tokens."""
    b = KvBudget(total_blocks=1000, block_tokens=16)
    assert b.describe()["output_tokens_p10_p50_p90"] is None
    for n in range(1, 101):  # 1..100 tokens, finished in admission order
        t = b.admit(req())
        b.submitted(t)
        b.release(t, n)
    assert b.describe()["output_tokens_p10_p50_p90"] == [10, 50, 90]


def test_the_projection_counts_whole_blocks_as_vllm_allocates_them():
    """Three requests of 160 prompt and 160 output tokens hold 20 blocks each at their ends (the
    last token made has no KV): all three fit 60 blocks. Counted as tokens / block + 1, the third
    was refused (63 projected); with 59 blocks it still is."""
    for total, third in ((60, True), (59, False)):
        b = KvBudget(total_blocks=total, block_tokens=16)
        for i in range(2):
            b.submitted(b.admit(req(prompt=160, max_tokens=160)))
        assert b.can_admit(req(prompt=160, max_tokens=160)) is third
