"""A run's stored wall time is the user's: from the process's start to its end, whatever the runner
did before generating (reading the input, measuring the grammar backend)."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

from runner.engines.fake import FakeEngine
from runner.process_clock import process_age_s
from runner.run import run_job
from runner.spec import load_job

SLEEP_S = 1.0


def test_a_process_age_counts_from_its_start():
    code = f"import time; time.sleep({SLEEP_S}); from runner.process_clock import process_age_s; print(process_age_s())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert SLEEP_S - 0.05 <= float(out.stdout) < SLEEP_S + 30


def test_the_start_is_read_past_a_command_name_with_spaces_and_parentheses(tmp_path):
    tck = os.sysconf("SC_CLK_TCK")
    rest = ["S"] + ["0"] * 18 + [str(5 * tck)] + ["0"] * 30  # starttime: field 22, 5 s after boot
    (tmp_path / "stat").write_bytes(b"4242 (my ) prog) " + " ".join(rest).encode())
    (tmp_path / "uptime").write_text("12.50 3.00\n")
    assert abs(process_age_s(str(tmp_path / "stat"), str(tmp_path / "uptime")) - 7.5) < 1e-6


def test_an_unreadable_proc_gives_no_age(tmp_path):
    assert process_age_s(str(tmp_path / "none"), str(tmp_path / "none")) == 0.0


def stored_stats(db) -> tuple[float, float]:
    con = sqlite3.connect(db)
    wall, choice = con.execute("SELECT wall_s, engine_choice_json FROM run_stats").fetchone()
    return wall, json.loads(choice)["before_run_s"]


def test_runner_run_stores_the_wall_from_the_process_start(make_job, tmp_path):
    # The second before the runner's entry point stands for Python's start and the runner's work
    # before generating; the stored wall must count it, as `time runner run` does.
    job = make_job(rows=4)
    code = f"import time; time.sleep({SLEEP_S}); import runner.cli; runner.cli.main()"
    proc = subprocess.run([sys.executable, "-c", code, "run", "--engine", "fake", "--quiet", str(job)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wall, before = stored_stats(tmp_path / "out" / "results.sqlite")
    assert before >= SLEEP_S - 0.05
    assert wall >= before


def test_the_library_counts_from_the_call_unless_told(make_job, tmp_path):
    job = load_job(make_job(rows=4))
    t = [100.0]

    def clock():
        t[0] += 0.5
        return t[0]

    run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema), clock=clock)
    wall, before = stored_stats(job.database_path)
    assert before == 0.0 and wall > 0
    run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema), clock=clock, restart=True, started_at=t[0] - 60)
    con = sqlite3.connect(job.database_path)
    wall2, choice = con.execute("SELECT wall_s, engine_choice_json FROM run_stats ORDER BY run_id DESC").fetchone()
    before2 = json.loads(choice)["before_run_s"]
    assert before2 >= 60 and wall2 > before2
