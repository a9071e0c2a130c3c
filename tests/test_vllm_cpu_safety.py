"""Crash safety and isolation on real vLLM (CPU): a SIGKILL mid-run, a broken model, no network."""
from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys

import pytest

from tests.test_crash_safety import kill_when, runner_cmd, stored

pytestmark = pytest.mark.vllm


def test_sigkill_mid_run_then_rerun_finishes_each_row_once(make_job, tmp_path):
    job = make_job(rows=12, job={"output": {"database": "out/results.sqlite", "commit_every_rows": 2}})
    db = tmp_path / "out" / "results.sqlite"
    proc = subprocess.Popen(runner_cmd("run", "--quiet", job), stderr=subprocess.DEVNULL)
    kill_when(proc, db, at_least=2, timeout_s=300)
    assert proc.returncode == -signal.SIGKILL
    before = stored(db)
    assert 2 <= len(before) < 12
    done = subprocess.run(runner_cmd("run", "--quiet", job), stderr=subprocess.DEVNULL, timeout=300)
    assert done.returncode == 0
    after = stored(db)
    assert sorted(after) == [f"r{i:03d}" for i in range(12)]
    assert all(after[k] == v for k, v in before.items())  # rows finished before the kill are unchanged
    con = sqlite3.connect(db)
    assert [s for (s,) in con.execute("SELECT status FROM runs ORDER BY id")] == ["interrupted", "completed"]
    # the killed run ended at its last stored row, not when the rerun found it
    assert con.execute("SELECT ended_at_utc FROM runs WHERE id = 1").fetchone() == \
        con.execute("SELECT max(created_at_utc) FROM results WHERE run_id = 1").fetchone()


def test_sigterm_during_generation_is_an_interruption_not_an_engine_failure(make_job, tmp_path):
    job = make_job(rows=12, job={"output": {"database": "out/results.sqlite", "commit_every_rows": 2}})
    db = tmp_path / "out" / "results.sqlite"
    proc = subprocess.Popen(runner_cmd("run", "--quiet", job), stderr=subprocess.PIPE, text=True)
    kill_when(proc, db, at_least=2, timeout_s=300, sig=signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("Error: stopped by signal SIGTERM")
    con = sqlite3.connect(db)
    assert con.execute("SELECT status FROM runs").fetchall() == [("interrupted",)]
    stored_rows = con.execute("SELECT count(*) FROM results").fetchone()[0]
    assert stored_rows >= 2
    # its stats cover the rows it stored, with generation time up to the signal and no plan bound
    total, docs_per_s, bound = con.execute("SELECT rows_total, documents_per_s, plan_prefix_share FROM run_stats").fetchone()
    assert total == stored_rows and docs_per_s > 0 and bound is None


def test_engine_that_fails_to_start_exits_5_and_records_the_failed_run(make_job, tmp_path, model_dir):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        shutil.copy(model_dir / name, broken / name)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)  # not a safetensors file
    job = make_job(rows=3, engine={"model": str(broken)})
    result = subprocess.run(runner_cmd("run", job), capture_output=True, text=True, timeout=300)
    assert result.returncode == 5
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: vLLM failed to start with model") and str(broken) in last
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT status FROM runs").fetchall() == [("failed",)]
    assert con.execute("SELECT count(*) FROM results").fetchone()[0] == 0


def test_runs_with_networking_cut_off(make_job, tmp_path):
    """The whole run in a network namespace of its own, with only loopback: it must not need the network."""
    if shutil.which("unshare") is None:
        pytest.fail("util-linux's unshare is needed for this test")
    job = make_job(rows=4)
    probe = [sys.executable, "-c", "import socket; s = socket.socket(); s.settimeout(3); print(s.connect_ex(('8.8.8.8', 53)))"]
    isolated = subprocess.run(["unshare", "--net", "--", *probe], capture_output=True, text=True, timeout=60)
    assert isolated.returncode == 0, isolated.stderr  # the namespace works here...
    assert isolated.stdout.strip() != "0"  # ...and reaches nothing outside
    # Only loopback, and up: vLLM's CPU workers talk to each other over 127.0.0.1.
    command = "ip link set lo up && exec " + " ".join(runner_cmd("run", job))
    result = subprocess.run(["unshare", "--net", "--", "sh", "-c", command], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT count(*) FROM results").fetchone()[0] == 4
    settings = json.loads(con.execute("SELECT engine_settings_json FROM runs").fetchone()[0])
    assert settings["enable_prefix_caching"] is True


def test_real_cron_run_is_silent_and_a_changed_job_redoes_its_rows(make_job, tmp_path):
    """Under cron's environment a successful --quiet run writes nothing to stdout or stderr (vLLM's
    and torch's output goes to the job's log); a changed max_tokens redoes the stored rows."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from tests.conftest import SYSTEM_A

    docs = tmp_path / "data" / "docs.parquet"
    docs.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(4)], "text": [f"The blender {i} broke." for i in range(4)],
                             "system_prompt": [SYSTEM_A] * 4, "n": pa.array([1, 2, None, 4], pa.int64())}), docs)
    job = make_job(docs=docs, job={"input": {"extra_columns": ["n"]}, "prompts": {"user_template": "#{n:02d}: {text}"},
                                   "output": {"max_failed_fraction": 1.0}})  # the 135M model truncates some
    cron = {"PATH": "/usr/bin:/bin", "HOME": os.environ["HOME"], "RUNNER_CACHE": os.environ.get("RUNNER_CACHE", "")}
    cron = {k: v for k, v in cron.items() if v}
    first = subprocess.run(runner_cmd("run", "--quiet", job), env=cron, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=300)
    assert (first.returncode, first.stdout, first.stderr) == (0, "", "")
    log = (tmp_path / "out" / "results.sqlite.t.log").read_text()
    assert "vllm" in log.lower()  # vLLM's own output went here
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    statuses = dict(con.execute("SELECT row_id, status FROM results").fetchall())
    assert statuses["r2"] == "failed" and sum(s != "failed" for s in statuses.values()) == 3
    per_s, gen_s = con.execute("SELECT documents_per_s, generation_s FROM run_stats").fetchone()
    assert per_s == pytest.approx(3 / gen_s, rel=0.01)  # the 3 rows vLLM generated: the failed one is not speed
    spec = yaml.safe_load(job.read_text())
    spec["sampling"]["max_tokens"] = 48
    job.write_text(yaml.safe_dump(spec))
    second = subprocess.run(runner_cmd("run", "--quiet", job), env=cron, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=300)
    assert (second.returncode, second.stdout, second.stderr) == (0, "", "")
    assert con.execute("SELECT rows_total, rows_redone FROM run_stats ORDER BY run_id").fetchall() == [(4, 0), (4, 4)]
    assert con.execute("SELECT count(*) FROM results_history").fetchone()[0] == 4
    assert con.execute("SELECT count(DISTINCT fingerprint) FROM results").fetchone()[0] == 1
