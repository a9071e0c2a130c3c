"""Calibration is paid once: stored choices, their key, and the cost rule of a first run (fake engine, fake clock)."""
from __future__ import annotations

import json
import sqlite3
import types

import pytest
import yaml

from runner import summary
from runner.engines.fake import FakeEngine
from runner.calibration_run import calibrate_job
from runner.run import run_job
from runner.spec import load_job
from tests.conftest import SCHEMA


class Timed(FakeEngine):
    """A fake engine on a fake clock: starting costs `start_s`, each row `row_s` (less with drafts)."""

    def __init__(self, clock, k, start_s, row_s, kv_blocks):
        super().__init__(SCHEMA)
        clock.now += start_s
        self.clock, self.k, self.row_s = clock, k, row_s
        self.info.kv_total_blocks = kv_blocks

    def generate(self, requests):
        for c in super().generate(requests):
            self.clock.now += self.row_s * (0.5 if self.k else 1.0)  # drafts double the speed
            yield c

    def counters(self):
        c = super().counters()
        if self.k:
            c.spec_drafts = 10 * len(self.seen)
            c.spec_accepted_per_pos = [int(p * 10 * len(self.seen)) for p in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4)[:self.k]]
        return c


def harness(start_s=0.0, row_s=0.05, kv_blocks=100):
    clock = types.SimpleNamespace(now=0.0)
    started = []

    def factory(j):
        k = j.engine.speculative.num_speculative_tokens if j.engine.speculative else 0
        started.append(k)
        factory.in_process.append(j.engine.in_process)  # each engine's: in the runner's process or not
        return Timed(clock, k, start_s, row_s, kv_blocks)

    factory.in_process = []
    return clock, started, factory


def auto_job(make_job, rows=40, **engine):
    return load_job(make_job(rows=rows, engine={"speculative": "auto",
                                                "calibration": {"rows": 8, "max_draft_tokens": 4}} | engine))


def calibration(db) -> dict:
    return json.loads(sqlite3.connect(db).execute(
        "SELECT engine_choice_json FROM run_stats ORDER BY run_id DESC LIMIT 1").fetchone()[0])["speculative_calibration"]


def test_a_measured_choice_is_stored_and_the_next_run_starts_one_engine(make_job):
    job = auto_job(make_job)
    clock, started, factory = harness()
    run_job(job, engine_factory=factory, clock=lambda: clock.now)
    first = calibration(job.database_path)
    assert started == [0, 4] and first["chosen_draft_tokens"] == 4  # drafts double the speed: kept
    assert "calibration_id" in first and "phases" in first

    started.clear()
    s = run_job(job, engine_factory=factory, restart=True, clock=lambda: clock.now)
    again = calibration(job.database_path)
    assert started == [4]  # the stored choice, started directly
    assert again["reused_calibration_id"] == first["calibration_id"] and "phases" not in again
    assert s.stats["rows_total"] == 40


@pytest.mark.parametrize("change", ["max_tokens", "schema", "engine", "prompts"])
def test_a_changed_key_measures_again(make_job, tmp_path, change):
    job = auto_job(make_job)
    clock, started, factory = harness()
    run_job(job, engine_factory=factory, clock=lambda: clock.now)
    path = job.path
    spec = yaml.safe_load(path.read_text())
    if change == "max_tokens":
        spec["sampling"]["max_tokens"] = 32
    elif change == "schema":
        (tmp_path / "schemas" / "out.json").write_text(json.dumps(SCHEMA | {"title": "changed"}))
    elif change == "engine":
        cfg = tmp_path / "configs" / "engine.yaml"
        cfg.write_text(yaml.safe_dump(yaml.safe_load(cfg.read_text()) | {"max_num_seqs": 4}))
    else:
        spec["prompts"] = {"user_template": "Review: {text}"}
    path.write_text(yaml.safe_dump(spec))
    started.clear()
    run_job(load_job(path), engine_factory=factory, restart=True, clock=lambda: clock.now)
    assert started[:2] == [0, 4] and "reused_calibration_id" not in calibration(job.database_path)
    assert sqlite3.connect(job.database_path).execute("SELECT count(DISTINCT key_sha256) FROM calibrations").fetchone()[0] == 2


def test_a_different_kv_cache_measures_again(make_job):
    job = auto_job(make_job)
    clock, started, factory = harness(kv_blocks=100)
    run_job(job, engine_factory=factory, clock=lambda: clock.now)
    clock, started, factory = harness(kv_blocks=60)  # same settings, a smaller card
    run_job(job, engine_factory=factory, restart=True, clock=lambda: clock.now)
    cal = calibration(job.database_path)
    # The stored choice (4 drafts) started first, then the plain engine to measure from.
    assert started[:3] == [4, 0, 4] and "100 to 60 blocks" in cal["remeasured_because"]
    shown = summary.speculation(json.dumps({"speculative_calibration": cal}))  # what run and stats print
    assert "stored as calibration #2; measured again: the engine's KV cache changed from 100 to 60" in shown


def test_a_first_run_skips_calibration_that_cannot_pay(make_job):
    """Engines cost 30 s to start; 40 rows at 0.05 s leave ~1.6 s of generation to win on."""
    job = auto_job(make_job)
    clock, started, factory = harness(start_s=30.0)
    s = run_job(job, engine_factory=factory, clock=lambda: clock.now)
    cal = calibration(job.database_path)
    assert started == [0] and cal["chosen_draft_tokens"] == 0
    assert cal["cost_rule"]["measure"] is False and cal["cost_rule"]["cost_s"] == pytest.approx(60.0)
    assert cal["cost_rule"]["rows_left"] == 32 and "engine starts" in cal["skipped"]
    assert s.stats["rows_total"] == 40
    # The decision is stored with the pace the slice measured (0.05 s a row), not as a measured choice.
    stored = sqlite3.connect(job.database_path).execute(
        "SELECT chosen_draft_tokens, speculative_json, record_json FROM calibrations").fetchall()
    assert len(stored) == 1 and stored[0][:2] == (0, None)
    record = json.loads(stored[0][2])
    assert record["decided_by"] == "cost_rule" and record["cost_rule"]["per_row_s"] == pytest.approx(0.05)


def test_a_later_run_applies_the_stored_cost_rule_without_a_slice(make_job):
    job = auto_job(make_job)
    clock, started, factory = harness(start_s=30.0)
    run_job(job, engine_factory=factory, clock=lambda: clock.now)
    first = calibration(job.database_path)
    engines = []
    s = run_job(job, engine_factory=lambda j: engines.append(factory(j)) or engines[-1], restart=True,
                clock=lambda: clock.now)
    again = calibration(job.database_path)
    assert started == [0, 0] and len(engines) == 1  # one engine this run, without drafts
    assert engines[0].warmed == [] and "phases" not in again  # no throwaway request, no slice
    assert again["reused_calibration_id"] == first["calibration_id"] and again["chosen_draft_tokens"] == 0
    # Rows counted as the first run counted them (after its 8-row slice), at the stored pace: still
    # not worth two engine starts.
    assert again["cost_rule"]["rows_left"] == 32 and again["cost_rule"]["win_s"] == pytest.approx(0.8)
    assert "engine starts" in again["skipped"] and s.stats["rows_total"] == 40
    assert sqlite3.connect(job.database_path).execute("SELECT count(*) FROM calibrations").fetchone()[0] == 1
    # What `runner run`, `runner stats` and the report say: not measured, and why.
    line = summary.speculation(json.dumps({"speculative_calibration": again}))
    assert line.startswith("off (measuring drafts would cost about 60 s of engine starts") and "calibration #1" in line
    first_line = summary.speculation(json.dumps({"speculative_calibration": first}))
    assert "measured in" not in first_line and "cost about 60 s" in first_line


def test_a_job_at_the_break_even_point_decides_once(make_job):
    """2,405 rows at 0.05 s a row: after the first run's 8-row slice the rule sees 2,397 rows and
    does not measure; later runs count rows the same way and reuse that decision."""
    clock, started, factory = harness(start_s=30.0)
    job = auto_job(make_job, rows=2405)
    for _ in range(3):
        run_job(job, engine_factory=factory, restart=True, clock=lambda: clock.now)
    assert started == [0, 0, 0]
    assert sqlite3.connect(job.database_path).execute("SELECT count(*) FROM calibrations").fetchone()[0] == 1
    assert "phases" not in calibration(job.database_path)


def test_a_job_grown_past_the_stored_cost_rule_measures(make_job):
    """40 rows could not pay for two 30 s engine starts; 4,000 rows at the same pace can (100 s)."""
    clock, started, factory = harness(start_s=30.0)
    run_job(auto_job(make_job, rows=40), engine_factory=factory, clock=lambda: clock.now)
    started.clear()
    factory.in_process.clear()
    run_job(auto_job(make_job, rows=4000), engine_factory=factory, clock=lambda: clock.now)
    cal = calibration(auto_job(make_job, rows=4000).database_path)
    # The stored "no drafts" started as configured (in the runner's process); measuring starts again
    # in an engine-core process of its own, as every engine after it.
    assert started == [0, 0, 4] and factory.in_process == [True, False, False]
    assert cal["cost_rule"]["measure"] is True and cal["chosen_draft_tokens"] == 4
    assert "reused_calibration_id" not in cal and cal["calibration_id"] == 2
    assert cal["remeasured_because"].startswith("calibration #1 decided by cost at 0.0500 s")
    started.clear()  # the measured choice is what later runs reuse
    run_job(auto_job(make_job, rows=4000), engine_factory=factory, restart=True, clock=lambda: clock.now)
    assert started == [4] and calibration(auto_job(make_job, rows=4000).database_path)["reused_calibration_id"] == 2


def test_a_stored_choice_runs_its_one_engine_where_the_config_says_unless_it_drafts(make_job):
    """A reused "no drafts" needs no second engine: in the runner's process as configured (an engine
    core of its own costs ~20 s a run on the CPU)."""
    clock, started, factory = harness(start_s=30.0)
    run_job(auto_job(make_job, rows=40), engine_factory=factory, clock=lambda: clock.now)  # by cost: none
    assert factory.in_process == [False]  # a first run: every engine in its own process
    factory.in_process.clear()
    run_job(auto_job(make_job, rows=40), engine_factory=factory, restart=True, clock=lambda: clock.now)
    cal = calibration(auto_job(make_job, rows=40).database_path)
    assert factory.in_process == [True] and cal["reused_calibration_id"] == 1
    assert summary.speculation(json.dumps({"speculative_calibration": cal})).endswith("by the cost rule of calibration #1, reused)")


def test_a_stored_choice_with_drafts_keeps_an_engine_core_process_of_its_own(make_job):
    job = auto_job(make_job)
    clock, started, factory = harness()
    run_job(job, engine_factory=factory, clock=lambda: clock.now)
    assert started == [0, 4] and calibration(job.database_path)["chosen_draft_tokens"] == 4
    started.clear()
    factory.in_process.clear()
    run_job(job, engine_factory=factory, restart=True, clock=lambda: clock.now)
    assert started == [4] and factory.in_process == [False]  # vLLM could start no engine after it here


def test_a_large_job_pays_for_calibration(make_job):
    """The same engine start against 400 rows of 0.5 s: drafts could save far more than 60 s."""
    job = auto_job(make_job, rows=400)
    clock, started, factory = harness(start_s=30.0, row_s=0.5)
    run_job(job, engine_factory=factory, clock=lambda: clock.now)
    cal = calibration(job.database_path)
    assert started == [0, 4] and cal["cost_rule"]["measure"] is True and cal["chosen_draft_tokens"] == 4


def test_recalibrate_measures_whatever_it_costs(make_job):
    job = auto_job(make_job)
    clock, started, factory = harness(start_s=30.0)
    run_job(job, engine_factory=factory, recalibrate=True, clock=lambda: clock.now)
    assert started == [0, 4] and "calibration_id" in calibration(job.database_path)


def test_calibrate_job_stores_a_choice_and_no_results(make_job):
    job = auto_job(make_job)
    clock, started, factory = harness(start_s=30.0)
    record = calibrate_job(job, engine_factory=factory, clock=lambda: clock.now)
    assert started == [0, 4] and record["chosen_draft_tokens"] == 4 and record["calibration_id"] == 1
    con = sqlite3.connect(job.database_path)
    assert con.execute("SELECT count(*) FROM results").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 0
    started.clear()
    run_job(job, engine_factory=factory, clock=lambda: clock.now)
    assert started == [4] and calibration(job.database_path)["reused_calibration_id"] == 1


def test_the_fake_engines_choices_never_pass_for_vllms(make_job):
    """`--engine fake` (a test seam) on a job's real database: what it measured is keyed apart, so a
    vLLM run measures for itself, and fake runs still reuse their own."""
    from click.testing import CliRunner

    from runner.cli import cli

    job = auto_job(make_job)
    result = CliRunner().invoke(cli, ["calibrate", "--engine", "fake", str(job.path)])
    assert result.exit_code == 0, result.output
    con = sqlite3.connect(job.database_path)
    assert [json.loads(k).get("backend") for (k,) in con.execute("SELECT key_json FROM calibrations")] == ["fake"]
    con.close()
    clock, started, factory = harness()
    run_job(job, engine_factory=factory, clock=lambda: clock.now)  # as vLLM: nothing stored for it
    assert started == [0, 4] and "calibration_id" in calibration(job.database_path)
    started.clear()
    run_job(job, engine_factory=factory, restart=True, backend="fake", clock=lambda: clock.now)
    assert calibration(job.database_path)["reused_calibration_id"] == 1  # the CLI's, under the fake key
    assert len(started) == 1  # the stored choice, started directly


def test_a_vllm_setting_from_the_environment_measures_again_and_unset_reuses(make_job, monkeypatch):
    """VLLM_USE_BREAKABLE_CUDAGRAPH and its kind change the engine's speed outside its arguments:
    a choice measured without one is not reused with it. Unset, the key is the one stored before
    the environment counted, so that earlier choices stay reused."""
    from runner.fingerprint import ENGINE_ENVIRONMENT, calibration_key

    for name in ENGINE_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    job = auto_job(make_job)
    plain_key = calibration_key(job, ["a"])
    assert "environment" not in plain_key["engine"]
    clock, started, factory = harness()
    run_job(job, engine_factory=factory, clock=lambda: clock.now)
    first = calibration(job.database_path)["calibration_id"]

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # not an engine setting: not in the key
    assert calibration_key(job, ["a"])["engine"]["environment"] == {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}
    started.clear()
    run_job(job, engine_factory=factory, restart=True, clock=lambda: clock.now)
    assert started[:2] == [0, 4] and "reused_calibration_id" not in calibration(job.database_path)

    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH")
    assert calibration_key(job, ["a"]) == plain_key
    started.clear()
    run_job(job, engine_factory=factory, restart=True, clock=lambda: clock.now)
    assert started == [4] and calibration(job.database_path)["reused_calibration_id"] == first


def test_a_ray_jobs_replica_environment_counts_in_its_calibration_key(make_job, monkeypatch):
    from runner.fingerprint import ENGINE_ENVIRONMENT, engine_environment

    for name in ENGINE_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    local = load_job(make_job())
    ray = load_job(make_job(job={"executor": "ray", "ray": {"env": {"TORCH_COMPILE_DISABLE": "0",
                                                                    "VLLM_USE_V2_MODEL_RUNNER": "1"}}}))
    assert engine_environment(local) == {"TORCH_COMPILE_DISABLE": "1"}
    assert engine_environment(ray) == {"TORCH_COMPILE_DISABLE": "0", "VLLM_USE_V2_MODEL_RUNNER": "1"}
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert engine_environment(ray)["VLLM_USE_FLASHINFER_SAMPLER"] == "1"  # a local cluster inherits it
    monkeypatch.setenv("RAY_ADDRESS", "local")  # a local cluster all the same
    assert engine_environment(ray)["VLLM_USE_FLASHINFER_SAMPLER"] == "1"
    monkeypatch.setenv("RAY_ADDRESS", "ray://cluster:10001")  # replicas elsewhere get ray.env only
    assert engine_environment(ray) == {"TORCH_COMPILE_DISABLE": "0", "VLLM_USE_V2_MODEL_RUNNER": "1"}


def test_admission_waves_on_or_off_keep_the_stored_calibration(make_job):
    """Waves only pace when requests go in: the calibration key (and so a stored choice) is the same
    with them on or off, and with the setting left out, as in jobs written before it existed."""
    from runner.fingerprint import calibration_key

    keys = [calibration_key(load_job(make_job(engine=engine)), ["a"])
            for engine in ({}, {"admission_waves": True}, {"admission_waves": False})]
    assert keys[0] == keys[1] == keys[2]
    other = calibration_key(load_job(make_job(engine={"kv_pacing": False})), ["a"])
    assert other != keys[0]  # other engine settings still count


def test_the_usage_feedback_counts_in_the_calibration_key_only_when_on(make_job):
    """kv_usage_feedback changes how many requests run at once, as kv_pacing does, so a choice
    measured without it is not reused with it; at its default (off) the key is the one jobs stored
    before the setting existed."""
    from runner.fingerprint import calibration_key

    default, off, on = (calibration_key(load_job(make_job(engine=engine)), ["a"])
                        for engine in ({}, {"kv_usage_feedback": False}, {"kv_usage_feedback": True}))
    assert default == off and "kv_usage_feedback" not in default["engine"]
    assert on != default and on["engine"]["kv_usage_feedback"] is True


def test_cuda_graph_sizes_count_in_the_calibration_key_only_where_vllm_gets_them(make_job):
    """The graph sizes change each step's cost, so a choice measured with vLLM's own list is not
    reused with fewer sizes; unset, or where vLLM gets none (enforce_eager, an engine with drafts),
    the key is the one jobs stored before the setting existed, and so are the verifications under it."""
    from runner.fingerprint import calibration_key

    def key(**engine):
        return calibration_key(load_job(make_job(engine={"enforce_eager": False, "speculative": None} | engine)), ["a"])

    default, eager = key(), key(cuda_graph_sizes=[1, 2, 4], enforce_eager=True)
    drafts = key(cuda_graph_sizes=[1, 2, 4], speculative={"method": "ngram", "num_speculative_tokens": 2})
    assert "cuda_graph_sizes" not in default["engine"] and "cuda_graph_sizes" not in eager["engine"]
    assert "cuda_graph_sizes" not in drafts["engine"]
    sized = key(cuda_graph_sizes=[64, 1, 2, 4, 2048])  # max_num_seqs 8: up to 16
    assert sized["engine"]["cuda_graph_sizes"] == [1, 2, 4] and sized != default


def test_only_the_last_engine_of_a_calibrating_run_is_let_go(make_job):
    # The engines calibration starts before it must be gone before the next one starts.
    job = auto_job(make_job)
    clock, started, factory = harness()
    released = []

    def watched(j):
        e = factory(j)
        e.close = lambda: released.append(("close", e.k))
        e.let_go = lambda: released.append(("let_go", e.k))
        return e

    run_job(job, engine_factory=watched, clock=lambda: clock.now, exits_after=True)
    assert started == [0, 4] and released == [("close", 0), ("let_go", 4)]


def _docs_by_prompt(path, counts: list[int]):
    """A Parquet input of blocks of rows, block i under system prompt i."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.conftest import SYSTEM_A, SYSTEM_B

    prompts = [p for p, n in zip((SYSTEM_A, SYSTEM_B, "You read kettle reviews."), counts) for _ in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": [f"r{i:03d}" for i in range(len(prompts))],
                             "text": [f"Document {i}: the kettle {i} leaks." for i in range(len(prompts))],
                             "system_prompt": prompts}), path)
    return path


def test_a_run_over_part_of_the_input_keys_its_choice_by_the_whole_inputs_prompts(make_job, tmp_path):
    """--limit 20 reads rows of one system prompt out of two: its choice is the whole run's (a smoke
    run after a night measures nothing), and the whole input gaining a prompt past the limit is a
    new key, as it is for a whole run."""
    docs = tmp_path / "data" / "split.parquet"
    path = make_job(engine={"speculative": "auto", "calibration": {"rows": 8, "max_draft_tokens": 4}},
                    docs=_docs_by_prompt(docs, [30, 10]))
    clock, started, factory = harness()
    run_job(load_job(path), engine_factory=factory, clock=lambda: clock.now)
    assert started == [0, 4]
    started.clear()
    s = run_job(load_job(path, ("input.limit=20",)), engine_factory=factory, restart=True, clock=lambda: clock.now)
    assert started == [4] and s.stats["rows_total"] == 20
    assert calibration(load_job(path).database_path)["reused_calibration_id"] == 1
    _docs_by_prompt(docs, [30, 10, 5])  # new rows, after the limit, under a new prompt
    started.clear()
    run_job(load_job(path, ("input.limit=20",)), engine_factory=factory, restart=True, clock=lambda: clock.now)
    assert started == [0, 4] and calibration(load_job(path).database_path)["calibration_id"] == 2


def test_a_whole_run_reuses_the_choice_a_run_over_part_of_the_input_measured(make_job, tmp_path):
    """Measuring reads slices of the rows either way: the key, not the rows read, decides reuse."""
    path = make_job(engine={"speculative": "auto", "calibration": {"rows": 8, "max_draft_tokens": 4}},
                    docs=_docs_by_prompt(tmp_path / "data" / "split.parquet", [30, 10]))
    clock, started, factory = harness()
    run_job(load_job(path, ("input.limit=20",)), engine_factory=factory, clock=lambda: clock.now)
    assert started == [0, 4]
    started.clear()
    run_job(load_job(path), engine_factory=factory, clock=lambda: clock.now)
    assert started == [4] and calibration(load_job(path).database_path)["reused_calibration_id"] == 1


def test_a_stored_choice_of_drafts_that_verification_failed_since_is_measured_again(make_job):
    """runner verify after the choice: its verdict binds the stored drafts as it binds candidates;
    --no-verify keeps them."""
    from runner.engines.speculation import setting_key
    from runner.fingerprint import verification_keys
    from runner.store import Store

    job = auto_job(make_job)
    clock, started, factory = harness()
    run_job(job, engine_factory=factory, clock=lambda: clock.now)
    assert started == [0, 4]
    speculative, key = sqlite3.connect(job.database_path).execute(
        "SELECT speculative_json, key_json FROM calibrations").fetchone()
    store = Store(job.database_path)
    store.save_verification(key_sha256=verification_keys(json.loads(key))[0], setting=setting_key(json.loads(speculative)),
                            job_name=job.name, rows=10, agreement=0.8, field_agreement={}, differences=[])
    store.close()
    started.clear()
    run_job(job, engine_factory=factory, restart=True, clock=lambda: clock.now)
    cal = calibration(job.database_path)
    assert started == [0] and cal["chosen_draft_tokens"] == 0 and cal["skipped"] == "no candidate passed verification"
    assert cal["remeasured_because"].startswith("runner verify found calibration #1's ngram drafts left 80.0%")
    assert summary.speculation(json.dumps({"speculative_calibration": cal})).endswith(
        "stored as calibration #2; measured again: runner verify found calibration #1's ngram drafts left "
        "80.0% of greedy outputs unchanged (engine.verify.min_agreement 99%))")
    started.clear()  # "none passed" is stored: one engine, no slice, until a candidate passes
    factory.in_process.clear()
    run_job(job, engine_factory=factory, restart=True, clock=lambda: clock.now)
    assert started == [0] and factory.in_process == [True] and calibration(job.database_path)["reused_calibration_id"] == 2
    started.clear()  # --no-verify lets the candidate pass: measured again, drafts chosen
    run_job(job, engine_factory=factory, restart=True, verify_gate=False, clock=lambda: clock.now)
    cal = calibration(job.database_path)
    assert started == [0, 4] and cal["chosen_draft_tokens"] == 4 and "--no-verify checks none" in cal["remeasured_because"]
