"""runner verify: greedy outputs with and without drafts compared, stored, and respected by runs."""
from __future__ import annotations

import json
import sqlite3

import pytest
from click.testing import CliRunner

from runner.cli import cli
from runner.engines.fake import FakeEngine
from runner.run import run_job
from runner.spec import load_job
from runner.verify import compare, verify_job
from tests.conftest import SCHEMA

CHANGED = {"r001", "r004"}  # rows whose output drafts change, in these tests


def drifting_factory(started: list):
    """Engines whose answers change for two rows when they draft (as numerics can make them)."""
    def factory(j):
        drafting = j.engine.speculative is not None
        started.append(drafting)

        def respond(r):
            summary = "changed" if drafting and r.row_id in CHANGED else f"fake {r.row_id}"
            return json.dumps({"summary": summary, "sentiment": "neutral"})

        return FakeEngine(SCHEMA, respond=respond)
    return factory


def test_compare_counts_identical_outputs_and_fields():
    a = {"x": ("ok", '{"s": 1, "t": 2}', ""), "y": ("ok", '{"s": 1, "t": 2}', ""), "z": ("truncated", None, "{")}
    b = {"x": ("ok", '{"s": 1, "t": 2}', ""), "y": ("ok", '{"s": 9, "t": 2}', ""), "z": ("truncated", None, "{")}
    agreement, fields, diffs = compare(a, b, ["s", "t"])
    assert agreement == 2 / 3 and fields == {"s": round(2 / 3, 4), "t": 1.0}
    assert diffs == [{"row_id": "y", "without": '{"s": 1, "t": 2}', "with": '{"s": 9, "t": 2}'}]


def test_verify_stores_agreement_and_the_rows_that_differ(make_job):
    job = load_job(make_job(rows=10))  # the test config's ngram k=3
    started = []
    [v] = verify_job(job, rows=10, engine_factory=drifting_factory(started))
    assert started == [False, True]  # the same rows without drafts, then with them
    assert v.rows == 10 and v.agreement == 0.8 and v.field_agreement == {"summary": 0.8, "sentiment": 1.0}
    assert sorted(d["row_id"] for d in v.differences) == sorted(CHANGED)
    assert v.setting["method"] == "ngram" and "num_speculative_tokens" not in v.setting and v.draft_tokens == 3
    con = sqlite3.connect(job.database_path)
    assert con.execute("SELECT rows, agreement FROM verifications").fetchall() == [(10, 0.8)]
    assert con.execute("SELECT count(*) FROM results").fetchone()[0] == 0  # nothing stored as results


def test_a_run_drops_a_setting_that_failed_verification_unless_told_not_to(make_job):
    job = load_job(make_job(rows=10))
    verify_job(job, rows=10, engine_factory=drifting_factory([]))
    started, notes = [], []
    run_job(job, engine_factory=drifting_factory(started), notify=notes.append)
    assert started == [False] and "80.0% of greedy outputs unchanged" in notes[0]
    con = sqlite3.connect(job.database_path)
    assert "runner verify found ngram" in json.loads(con.execute("SELECT engine_choice_json FROM run_stats").fetchone()[0])["notes"][0]
    started.clear()
    run_job(job, engine_factory=drifting_factory(started), restart=True, verify_gate=False)
    assert started == [True]


def test_auto_leaves_out_a_candidate_that_failed_verification(make_job):
    auto = {"speculative": "auto", "calibration": {"rows": 3, "candidates": [{"method": "ngram", "max_draft_tokens": 3,
                                                                          "options": {"prompt_lookup_max": 3}}]}}
    job = load_job(make_job(rows=12, engine=auto))
    [v] = verify_job(job, rows=10, engine_factory=drifting_factory([]))
    assert v.agreement == 0.8
    started = []
    run_job(job, engine_factory=drifting_factory(started), recalibrate=True)
    cal = json.loads(sqlite3.connect(job.database_path).execute(
        "SELECT engine_choice_json FROM run_stats").fetchone()[0])["speculative_calibration"]
    assert started == [False] and cal["skipped"] == "no candidate passed verification"
    assert cal["excluded"][0].startswith("ngram (verified: 80.0%")


def test_verify_command_prints_the_verdict_and_differences(make_job):
    from runner.fingerprint import calibration_key, verification_keys

    path = make_job(rows=6)
    out = CliRunner().invoke(cli, ["verify", "--engine", "fake", "--rows", "4", str(path)])
    assert out.exit_code == 0, out.output
    assert "100.0% of 4 rows unchanged; passes" in out.output and "field summary" in out.output
    # the fake engine's verdict is keyed apart: it never binds (or frees) a vLLM run's drafts
    job = load_job(path)
    (stored,) = sqlite3.connect(job.database_path).execute("SELECT key_sha256 FROM verifications").fetchone()
    assert stored == verification_keys(calibration_key(job, [], "fake"))[0]
    assert stored != verification_keys(calibration_key(job, []))[0]
    out = CliRunner().invoke(cli, ["verify", "--engine", "fake", str(make_job(rows=3, engine={"speculative": None}))])
    assert "Nothing to verify" in out.output


def test_a_baseline_separates_the_engines_own_variation_from_the_drafts(make_job):
    """Where two runs without drafts already differ (bf16 on a GPU varies with the batch), verify
    --baseline measures that, and a setting that changes no more rows than that passes."""
    runs = []

    def noisy_factory(j):
        drafting, nth = j.engine.speculative is not None, len(runs)
        runs.append(drafting)

        def respond(r):  # the second plain run differs on r002 and r003; drafts change r001 and r004
            changed = (drafting and r.row_id in CHANGED) or (nth == 1 and r.row_id in {"r002", "r003"})
            return json.dumps({"summary": "changed" if changed else f"fake {r.row_id}", "sentiment": "neutral"})

        return FakeEngine(SCHEMA, respond=respond)

    job = load_job(make_job(rows=10))
    out = CliRunner().invoke(cli, ["verify", "--engine", "fake", "--rows", "10", "--baseline", str(job.path)])
    [v] = verify_job(job, rows=10, engine_factory=noisy_factory, baseline=True)
    assert runs == [False, False, True] and v.baseline_agreement == 0.8 and v.agreement == 0.8
    assert (v.rows_changed_by_drafts_only, v.rows_changed_by_engine_only) == (2, 2)
    assert sqlite3.connect(job.database_path).execute(
        "SELECT agreement, baseline_agreement FROM verifications ORDER BY id DESC").fetchone() == (0.8, 0.8)
    started, notes = [], []
    run_job(job, engine_factory=drifting_factory(started), notify=notes.append)
    assert started == [True] and not notes  # as often unchanged as the baseline: the drafts stay
    assert out.exit_code == 0 and "without drafts, twice: 100.0% of rows unchanged" in out.output


def test_a_looping_output_is_retried_once_with_the_retry_penalty(make_job):
    """sampling.retry_repetition_penalty: a row cut off at max_tokens runs once more, as a retry
    (the engine gives it the penalty); rows that came out ok are not touched."""
    seen = []

    def factory(j):
        def respond(r):
            seen.append((r.row_id, r.attempt))
            return '{"summary": "loop loop loop' if r.row_id == "r002" and r.attempt == 1 else \
                json.dumps({"summary": "fine", "sentiment": "neutral"})

        return FakeEngine(SCHEMA, respond=respond,
                          finish_reason=lambda r: "length" if r.row_id == "r002" and r.attempt == 1 else "stop")

    job = load_job(make_job(rows=6, engine={"speculative": None}, job={"sampling": {"retry_repetition_penalty": 1.2}}))
    run_job(job, engine_factory=factory)
    assert sorted(seen) == sorted([(f"r{i:03d}", 1) for i in range(6)] + [("r002", 2)])
    row = sqlite3.connect(job.database_path).execute(
        "SELECT status, attempts, first_status FROM results WHERE row_id = 'r002'").fetchone()
    assert row == ("ok", 2, "truncated")


def test_the_baseline_excuses_only_what_the_engine_itself_changes():
    """Sign test on the rows only one of the two changed (runner/engines/speculation.py)."""
    from runner.engines.speculation import Baseline, drafts_change_more, passes

    # An engine that repeats itself (float32 on the CPU): every change is the drafts', 0.99 holds.
    assert not passes(0.96, 0.99, Baseline(1.0, drafts_only=3, engine_only=0))
    assert not passes(0.985, 0.99, Baseline(0.995, drafts_only=2, engine_only=1))
    assert passes(0.995, 0.99, None) and not passes(0.96, 0.99, None)
    # A noisy engine (bf16 on a GPU): as many rows changed by either alone passes, clearly more fails.
    assert passes(0.58, 0.99, Baseline(0.68, drafts_only=14, engine_only=10))
    assert not passes(0.58, 0.99, Baseline(0.68, drafts_only=20, engine_only=7))
    # The exact one-sided tail at FALSE_FAIL (2.5%): 5 of 5 is 1/32 (passes), 6 of 6 is 1/64 (fails).
    assert not drafts_change_more(5, 0) and drafts_change_more(6, 0)
    assert not drafts_change_more(0, 0)
    # Stored before the row counts were: judged against the baseline's share alone.
    assert passes(0.70, 0.99, Baseline(0.68)) and not passes(0.60, 0.99, Baseline(0.68))


def test_a_run_drops_drafts_that_change_clearly_more_rows_than_the_engine(make_job):
    """The engine alone changes one row of 12 between two runs; the drafts change 9: verify stores
    the row counts, and the next run leaves the drafts out and says why."""
    runs = []

    def factory(j):
        drafting, nth = j.engine.speculative is not None, len(runs)
        runs.append(drafting)

        def respond(r):
            changed = (drafting and r.row_id < "r009") or (nth == 1 and r.row_id == "r011")
            return json.dumps({"summary": "changed" if changed else f"fake {r.row_id}", "sentiment": "neutral"})

        return FakeEngine(SCHEMA, respond=respond)

    job = load_job(make_job(rows=12))
    [v] = verify_job(job, rows=12, engine_factory=factory, baseline=True)
    assert (v.rows_changed_by_drafts_only, v.rows_changed_by_engine_only) == (9, 1)
    assert sqlite3.connect(job.database_path).execute(
        "SELECT rows_changed_by_drafts_only, rows_changed_by_engine_only FROM verifications").fetchone() == (9, 1)
    started, notes = [], []
    run_job(job, engine_factory=drifting_factory(started), notify=notes.append)
    assert started == [False] and "more than the engine changes on its own (91.7% without drafts" in notes[0]


def _with_verify(job, **settings):
    """The job with other `engine.verify` settings (as --set engine.verify.X=... gives it)."""
    verify = job.engine.verify.model_copy(update=settings)
    return job.model_copy(update={"engine": job.engine.model_copy(update={"verify": verify})})


def test_verify_settings_change_only_the_threshold_a_run_applies_to_a_stored_verification(make_job):
    """min_agreement is applied when a verification is read: a stricter one still drops the drafts
    that failed (it dropped every stored verification when it was part of the key), a looser one
    that lets 80% pass keeps them; verify.rows says only how many rows verify compares."""
    job = load_job(make_job(rows=10))
    verify_job(job, rows=10, engine_factory=drifting_factory([]))
    started, notes = [], []
    run_job(_with_verify(job, min_agreement=0.999, rows=4), engine_factory=drifting_factory(started),
            notify=notes.append)
    assert started == [False] and "80.0% of greedy outputs unchanged" in notes[0]
    started.clear()
    run_job(_with_verify(job, min_agreement=0.75), engine_factory=drifting_factory(started), restart=True)
    assert started == [True]


@pytest.mark.parametrize("stored_under", ["whole calibration key", "key with the prompt set"])
def test_a_verification_stored_under_an_earlier_key_still_binds(make_job, stored_under):
    """Databases written before verifications left out the verify settings (the whole key), then
    before they left out the prompt set."""
    from runner.fingerprint import calibration_key, digest, verification_keys
    from runner.readers import LocalReader

    job = load_job(make_job(rows=10))
    verify_job(job, rows=10, engine_factory=drifting_factory([]))
    key = calibration_key(job, LocalReader(job.input_path, job.spec.input).scan().system_prompt_keys)
    earlier = digest(key) if stored_under == "whole calibration key" else verification_keys(key)[1]
    con = sqlite3.connect(job.database_path)
    con.execute("UPDATE verifications SET key_sha256 = ?", (earlier,))
    con.commit()
    con.close()
    started, notes = [], []
    run_job(job, engine_factory=drifting_factory(started), notify=notes.append)
    assert started == [False] and "80.0% of greedy outputs unchanged" in notes[0]


def test_a_failed_verification_binds_a_run_over_part_of_the_input(make_job):
    """--limit 3 takes rows of one system prompt out of two: another prompt set in the calibration
    key, the same job's verdict (the drafts once ran there)."""
    path = make_job(rows=10)
    verify_job(load_job(path), rows=10, engine_factory=drifting_factory([]))
    started, notes = [], []
    run_job(load_job(path, ("input.limit=3",)), engine_factory=drifting_factory(started), notify=notes.append)
    assert started == [False] and "80.0% of greedy outputs unchanged" in notes[0]


def test_another_jobs_verification_does_not_bind(make_job):
    """The same model, engine, schema and sampling in one database: each job's verdict is its own."""
    job = load_job(make_job(rows=10))
    verify_job(job, rows=10, engine_factory=drifting_factory([]))
    other = load_job(make_job(rows=10, job={"name": "other"}))
    assert other.database_path == job.database_path
    started = []
    run_job(other, engine_factory=drifting_factory(started))
    assert started == [True]


def test_a_failed_verification_binds_a_smoke_run_with_other_engine_settings(make_job):
    """`runner run --limit 20 --set engine.max_num_seqs=8`, as the help suggests: scheduling
    settings are not in a verification's key."""
    path = make_job(rows=10)
    verify_job(load_job(path), rows=10, engine_factory=drifting_factory([]))
    started, notes = [], []
    run_job(load_job(path, ("input.limit=4", "engine.max_num_seqs=4", "engine.kv_pacing=false")),
            engine_factory=drifting_factory(started), notify=notes.append)
    assert started == [False] and "80.0% of greedy outputs unchanged" in notes[0]
    started.clear()
    run_job(load_job(path, ("engine.max_model_len=512", "sampling.max_tokens=32")), engine_factory=drifting_factory(started),
            restart=True)
    assert started == [False]  # the length and the sampling neither
    started.clear()
    run_job(load_job(path, ("engine.dtype=float32",)), engine_factory=drifting_factory(started), restart=True)
    assert started == [True]  # the weights' type is what the model computes with: another key


def steady_factory(started: list):
    """Engines whose drafts change nothing (a verification of them passes)."""
    def factory(j):
        started.append(j.engine.speculative is not None)
        return FakeEngine(SCHEMA, respond=lambda r: json.dumps({"summary": f"fake {r.row_id}", "sentiment": "neutral"}))
    return factory


@pytest.mark.parametrize("again, lifted", [
    ((), True),                              # the same settings, as many rows: lifted
    (("engine.max_num_seqs=1",), False),     # one request at a time: drafts that change batches may not
    (("engine.verify.rows=4",), False),      # fewer rows than the failure
])
def test_a_later_pass_lifts_a_failure_only_with_the_same_settings_and_as_many_rows(make_job, again, lifted):
    path = make_job(rows=10)
    verify_job(load_job(path), rows=10, engine_factory=drifting_factory([]))
    rows = 4 if "engine.verify.rows=4" in again else 10
    [v] = verify_job(load_job(path, tuple(s for s in again if "verify.rows" not in s)), rows=rows,
                     engine_factory=steady_factory([]))
    assert v.agreement == 1.0
    started = []
    run_job(load_job(path), engine_factory=drifting_factory(started))
    assert started == [lifted]


def test_a_pass_made_with_a_runs_own_settings_lifts_an_older_failure_for_that_run(make_job):
    """The job's config changed since its drafts failed: verified again and passing as it now runs,
    the drafts run; a run with the old settings is still bound by the old failure."""
    path = make_job(rows=10)
    verify_job(load_job(path), rows=10, engine_factory=drifting_factory([]))
    changed = ("engine.max_num_seqs=4", "sampling.max_tokens=32")
    verify_job(load_job(path, changed), rows=10, engine_factory=steady_factory([]))
    started = []
    run_job(load_job(path, changed), engine_factory=drifting_factory(started))
    assert started == [True]
    started.clear()
    run_job(load_job(path), engine_factory=drifting_factory(started), restart=True)
    assert started == [False]


def test_which_failure_binds():
    """binding_failure on stored rows (newest first): only a later pass lifts, with enough rows
    (as many as the failure, or verify.rows) and the failure's settings or the run's."""
    from runner.engines.speculation import binding_failure

    def v(i, agreement, rows, settings):
        return {"id": i, "agreement": agreement, "rows": rows, "settings_sha256": settings, "baseline_agreement": None}

    fail = v(1, 0.8, 64, "a")
    assert binding_failure([v(2, 1.0, 64, "a"), fail], 0.99, "a", 64) is None
    assert binding_failure([fail, v(0, 1.0, 64, "a")], 0.99, "a", 64) == fail      # a pass before it
    assert binding_failure([v(2, 1.0, 8, "a"), fail], 0.99, "a", 64) == fail       # too few rows
    assert binding_failure([v(2, 1.0, 64, "b"), fail], 0.99, "a", 64) == fail      # other settings than both
    assert binding_failure([v(2, 1.0, 64, "b"), fail], 0.99, "b", 64) is None      # the run's own settings
    assert binding_failure([v(2, 1.0, 64, "a"), v(1, 0.8, 200, "a")], 0.99, "a", 64) is None  # verify.rows is enough
    assert binding_failure([v(2, 1.0, 64, "b"), v(1, 0.8, 64, None)], 0.99, "c", 64) is None  # settings not recorded
    older = v(0, 0.7, 64, "b")  # lifted by nothing (the run's settings are neither): binds beneath a lifted one
    assert binding_failure([v(2, 1.0, 64, "a"), fail, older], 0.99, "c", 64) == older


def test_verify_shows_differing_outputs_with_their_control_characters_escaped(make_job, monkeypatch):
    """A model's output (JSON strings may hold an ESC) reached the terminal as it was."""
    import runner.engines

    def factory(j, kind="vllm"):  # with drafts, text that is not JSON: shown as the model wrote it
        drafting = j.engine.speculative is not None
        plain = json.dumps({"summary": "plain", "sentiment": "neutral"})
        return FakeEngine(SCHEMA, respond=lambda r: '{"summary": "\x1b]0;owned\x07\nx\\x0a\u202e' if drafting else plain)

    monkeypatch.setattr(runner.engines, "build_engine", factory)
    out = CliRunner().invoke(cli, ["verify", "--engine", "fake", "--rows", "2", str(make_job(rows=3))])
    assert out.exit_code == 0, out.output
    assert "\x1b" not in out.output and "\x07" not in out.output
    # a newline and the text "\x0a" read apart; a bidirectional override is shown, not obeyed
    assert '    with drafts:    {"summary": "\\x1b]0;owned\\x07\\x0ax\\\\x0a\\u202e\n' in out.output
    assert '    without drafts: {"summary": "plain", "sentiment": "neutral"}' in out.output
