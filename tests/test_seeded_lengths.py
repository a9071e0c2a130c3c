"""A run that reuses a stored calibration starts admission from the output lengths of that
calibration's slice, as the run that measured it went on from them (kv_lengths_from_calibration)."""
from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest

from runner.engines.admission import KvBudget
from runner.engines.base import Request
from runner.engines.output_lengths import OutputLengths
from runner.run import run_job
from tests.test_adapt import simulate
from runner.spec import load_job
from tests.test_calibration_cache import calibration, harness


def test_seeds_set_the_pace_only_until_enough_of_the_runs_own_lengths_are_counted():
    """Seeds give the pace its lengths; the fit tests keep planning every row at max_tokens (a
    request runs to its cap, whatever the seeds say) until the run's own lengths are known."""
    lengths = OutputLengths(min_samples=4)
    lengths.seed([100, 100, 100, 100, 100])
    assert lengths.pace_spread() == (100, 100, 100, 100.0) and lengths.seeded == 5
    assert not lengths.known() and lengths.spread() is None
    assert lengths.survival(np.array([150]), np.array([256]), np.array([40]))[0, 0] == 1.0
    for ticket, n in enumerate([20, 20, 20]):
        lengths.finished(ticket, n)
    assert lengths.pace_spread().p90 == 100 and lengths.seeded == 5  # 3 of its own: not enough yet
    lengths.finished(3, 20)
    assert lengths.seeded == 0 and lengths.seeds_given == 5  # 4 of its own: the seeds are dropped
    assert lengths.pace_spread() == lengths.spread() == (20, 20, 20, 20.0) and lengths.recent() == [20] * 4
    assert lengths.survival(np.array([10]), np.array([256]), np.array([40]))[0, 0] == 0.0
    too_few = OutputLengths(min_samples=4)
    too_few.seed([100, 100])
    assert too_few.pace_spread() is None and too_few.seeds_given == 0  # fewer than a run's own would need


@pytest.mark.parametrize("own, kept", [(256, True), (240, True), (50, False), (400, False)])
def test_seeds_the_first_own_lengths_contradict_are_dropped_early(own, kept):
    """Seeds from another night: 4 of the run's own lengths outside their band drop them at once,
    long before the 16 a run needs to plan with its own (seeds far longer than the run's outputs
    would hold its pace back until then)."""
    lengths = OutputLengths(min_samples=16)
    lengths.seed([256] * 64)
    for ticket in range(3):
        lengths.finished(ticket, own)
    assert lengths.seeded == 64
    lengths.finished(3, own)
    assert (lengths.seeded == 64) == kept and (lengths.pace_spread() is not None) == kept


def test_stale_long_seeds_cost_few_steps():
    """Seeds of 1,000 tokens, outputs of 50 (max_tokens 1,024): dropped after 4 rows, the run takes
    about the steps it takes unseeded (71% more where the seeds held until 16 rows were done)."""
    steps = {}
    for seeded in (False, True):
        b = KvBudget(total_blocks=400, block_tokens=16, max_running=256)
        if seeded:
            b.lengths.seed([1000] * 64)
        steps[seeded] = simulate(b, 300, 150, lambda n: 50, max_tokens=1024)[2]
    assert steps[True] <= 1.1 * steps[False]


def test_seeded_admission_paces_from_its_first_row_and_finishes_sooner():
    """Every output 128 tokens under a cache that binds: without lengths the first rows go in as a
    convoy sized by their peaks, which finish together; seeded with a slice's lengths the pace
    applies from the first row. The same rows take fewer steps, and the cache never overflows."""
    runs, first_step = {}, {}
    for seeded in (False, True):
        b = KvBudget(total_blocks=400, block_tokens=16, max_running=256)
        if seeded:
            b.lengths.seed([128] * 16)
        b.submitted(b.admit(req := Request("r", "g", list(range(150)), 128, 0)))
        first_step[seeded] = 1 + sum(b.can_admit(req) and b.submitted(b.admit(req)) is None for _ in range(40))
        b = KvBudget(total_blocks=400, block_tokens=16, max_running=256)
        if seeded:
            b.lengths.seed([128] * 16)
        runs[seeded] = simulate(b, 300, 150, lambda n: 128)
        assert runs[seeded][0] <= 400
        assert b.describe()["output_lengths_seeded"] == (16 if seeded else 0)
    assert first_step[False] > first_step[True] == 5  # by peaks, against the first and the pace's burst of 4
    assert runs[True][2] < runs[False][2]


@pytest.mark.parametrize("seed", [20, 60, 128, 200])
def test_stale_seeds_never_let_the_cache_overflow(seed):
    """The seeds come from another night's documents: however short they say outputs are, the fit
    tests still plan each row at max_tokens until the run's own lengths are known, so every output
    running to 128 tokens never needs more blocks than the cache has."""
    b = KvBudget(total_blocks=400, block_tokens=16, max_running=256)
    b.lengths.seed([seed] * 64)
    most_blocks, _, _ = simulate(b, 300, 150, lambda n: 128)
    assert most_blocks <= 400


def auto_job(make_job, job=None, **engine):
    return load_job(make_job(rows=40, job=job, engine={"speculative": "auto",
                                                       "calibration": {"rows": 8, "max_draft_tokens": 4}} | engine))


def _runs_with(make_job, start_s=30.0, job=None, **engine):
    """A first run that calibrates (the fake engine's slice of 8 rows), then a second that reuses
    its choice; returns the second run's engines and calibration record. Engines cost 30 s to start
    by default: measuring drafts cannot pay, the choice is decided by cost."""
    job = auto_job(make_job, job=job, **engine)
    clock, started, factory = harness(start_s=start_s)
    run_job(job, engine_factory=factory, clock=lambda: clock.now)
    engines = []
    run_job(job, engine_factory=lambda j: engines.append(factory(j)) or engines[-1], restart=True,
            clock=lambda: clock.now)
    return job, engines, calibration(job.database_path)


def test_a_stored_choice_of_drafts_is_reused_with_its_lengths(make_job):
    """Engines that start at once: drafts are measured and chosen; the next run starts the drafting
    engine directly and hands it the plain slice's lengths (vLLM's admission ignores them with drafts)."""
    job, engines, again = _runs_with(make_job, start_s=0.0)
    assert again["chosen_draft_tokens"] == 4 and len(engines) == 1 and engines[0].k == 4
    assert len(engines[0].seeded) == 8 and again["output_lengths_seeded"] == 8


def test_replicas_each_pace_from_the_stored_lengths(make_job):
    """executor: ray (in-process cluster, fake replicas): the choice a local run stored is reused,
    and every replica gets its slice's lengths."""
    from runner.engines.fake import FakeEngine
    from runner.engines.ray import RayEngine
    from runner.engines.ray_cluster import LocalCluster

    job = auto_job(make_job)
    clock, started, factory = harness(start_s=30.0)
    run_job(job, engine_factory=factory, clock=lambda: clock.now)
    ray_job = auto_job(make_job, job={"executor": "ray", "ray": {"replicas": 2}})
    replicas: list[FakeEngine] = []
    replica = lambda j: replicas.append(factory(j)) or replicas[-1]  # noqa: E731
    s = run_job(ray_job, engine_factory=lambda j: RayEngine(j, replica, cluster=LocalCluster()), restart=True,
                clock=lambda: clock.now)
    stored = json.loads(sqlite3.connect(job.database_path).execute("SELECT record_json FROM calibrations").fetchone()[0])
    assert len(replicas) == 2 and all(r.seeded == stored["output_lengths"] for r in replicas)
    assert calibration(job.database_path)["output_lengths_seeded"] == 8 and s.stats["rows_total"] == 40


def test_the_slices_lengths_are_stored_and_the_next_run_starts_from_them(make_job):
    job, engines, again = _runs_with(make_job)
    [record] = sqlite3.connect(job.database_path).execute("SELECT record_json FROM calibrations").fetchone()
    stored = json.loads(record)["output_lengths"]
    assert len(stored) == 8 and all(n > 0 for n in stored)  # the 8-row slice's own
    assert len(engines) == 1 and engines[0].seeded == stored
    assert again["output_lengths_seeded"] == 8 and "reused_calibration_id" in again


def test_lengths_off_reuse_the_same_calibration_without_seeding(make_job):
    job, engines, again = _runs_with(make_job, kv_lengths_from_calibration=False)
    assert len(engines) == 1 and engines[0].seeded == [] and "output_lengths_seeded" not in again
    assert "reused_calibration_id" in again  # the setting is not part of the calibration key


@pytest.mark.parametrize("lengths", [["12"], [-1, 4], [True], [10 ** 9], "12", {"a": 1}])
def test_stored_lengths_that_are_not_token_counts_are_ignored(make_job, lengths):
    """A calibration record edited or damaged by hand: the run plans as without lengths, and completes."""
    job = auto_job(make_job)
    clock, started, factory = harness(start_s=30.0)
    run_job(job, engine_factory=factory, clock=lambda: clock.now)
    con = sqlite3.connect(job.database_path)
    record = json.loads(con.execute("SELECT record_json FROM calibrations").fetchone()[0])
    con.execute("UPDATE calibrations SET record_json = ?", (json.dumps(record | {"output_lengths": lengths}),))
    con.commit()
    con.close()
    engines = []
    s = run_job(job, engine_factory=lambda j: engines.append(factory(j)) or engines[-1], restart=True,
                clock=lambda: clock.now)
    assert engines[0].seeded == [] and s.stats["rows_total"] == 40
    assert "output_lengths_seeded" not in calibration(job.database_path)
