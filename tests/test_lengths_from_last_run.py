"""A nightly run starts admission from the output lengths its job's last run saw (same calibration
key), instead of admitting its first rows by their peaks: KvBudget with seeded lengths, and the
run storing and handing them on (fake engine, real SQLite)."""
from __future__ import annotations

import json
import sqlite3

from runner.engines.admission import KvBudget
from runner.engines.fake import FakeEngine
from runner.engines.output_lengths import OutputLengths
from runner.fingerprint import calibration_key
from runner.run import run_job
from runner.spec import load_job
from tests.conftest import SCHEMA
from tests.test_adapt import req, simulate


def test_seeded_lengths_are_known_at_once_and_this_runs_own_replace_them():
    lengths = OutputLengths(min_samples=16)
    lengths.seed([200] * 600)
    assert lengths.known() and lengths.seeded == 512 and lengths.spread().p50 == 200
    assert lengths.count == 0  # none of this run's own yet
    for ticket in range(300):
        lengths.finished(ticket, 20)
    assert lengths.spread().p90 == 20 and lengths.count == 300  # the window dropped every seeded one
    few = OutputLengths(min_samples=16)
    few.seed([50] * 15)
    assert not few.known()  # too few to plan with, as too few finished rows are


def test_seeded_uniform_lengths_pace_from_the_first_step_and_take_fewer_steps():
    """Every output as long (a model that runs to max_tokens, bounded fields): unseeded, the first
    rows go in by their peaks, together, and finish together; seeded, admissions are paced from the
    first one. Neither holds more blocks than the cache has."""
    def budget(seed):
        b = KvBudget(total_blocks=400, block_tokens=16, max_running=64)
        if seed:
            b.lengths.seed([128] * 64)
        return b

    plain, seeded = budget(False), budget(True)
    first = [sum(1 for _ in iter(lambda b=b: b.can_admit(req(prompt=100, max_tokens=128))
                                 and b.submitted(b.admit(req(prompt=100, max_tokens=128))) is None, False))
             for b in (plain, seeded)]
    assert first[1] < first[0] and seeded.pacing() and not plain.pacing()
    results = [simulate(budget(s), rows=300, prompt=100, output=lambda n: 128) for s in (False, True)]
    (plain_blocks, _, plain_steps), (seeded_blocks, _, seeded_steps) = results
    assert seeded_steps < plain_steps
    assert max(plain_blocks, seeded_blocks) <= 400


def _factory(engines):
    def make(job):
        engines.append(FakeEngine(SCHEMA))
        return engines[-1]
    return make


def _stored(db) -> list[tuple]:
    return sqlite3.connect(db).execute(
        "SELECT key_sha256, run_id, completion_tokens_json FROM output_lengths").fetchall()


def _seeded_stat(db) -> int:
    choice = json.loads(sqlite3.connect(db).execute(
        "SELECT engine_choice_json FROM run_stats ORDER BY run_id DESC LIMIT 1").fetchone()[0])
    return choice["engines"][-1]["output_lengths_seeded"]


def test_a_run_stores_its_lengths_under_its_key_and_the_next_run_starts_from_them(make_job):
    path = make_job(rows=20)
    job, engines = load_job(path), []
    run_job(job, engine_factory=_factory(engines))
    [(key, run_id, lengths_json)] = _stored(job.database_path)
    assert len(key) == 64 and run_id == 1
    assert json.loads(lengths_json) == engines[0].lengths and len(engines[0].lengths) == 20
    assert engines[0].seeded == [] and _seeded_stat(job.database_path) == 0  # the first run had none

    run_job(job, engine_factory=_factory(engines), restart=True)
    assert engines[1].seeded == engines[0].lengths and _seeded_stat(job.database_path) == 20
    [(again, run_id, _)] = _stored(job.database_path)
    assert again == key and run_id == 2  # replaced by the latest run's


def test_another_key_or_the_setting_off_starts_without_them(make_job):
    path = make_job(rows=12)
    engines = []
    run_job(load_job(path), engine_factory=_factory(engines))
    other = load_job(path, overrides=["sampling.max_tokens=32"])  # another length limit: another key
    run_job(other, engine_factory=_factory(engines), restart=True)
    assert engines[1].seeded == [] and len(_stored(other.database_path)) == 2
    off = load_job(path, overrides=["engine.kv_lengths_from_last_run=false"])
    run_job(off, engine_factory=_factory(engines), restart=True)
    assert engines[2].seeded == []


def test_the_setting_leaves_the_calibration_key_as_it_was(make_job):
    keys = [calibration_key(load_job(make_job(engine=engine)), ["a"])
            for engine in ({}, {"kv_lengths_from_last_run": True}, {"kv_lengths_from_last_run": False})]
    assert keys[0] == keys[1] == keys[2]
