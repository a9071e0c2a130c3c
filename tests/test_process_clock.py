"""A run's stored wall time is the user's: from the process's start to its end, whatever the runner
did before generating (reading the input, measuring the grammar backend)."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import pytest

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


def stored_stats(db) -> tuple[float, dict]:
    """The newest run's wall_s and engine_choice_json."""
    con = sqlite3.connect(db)
    wall, choice = con.execute("SELECT wall_s, engine_choice_json FROM run_stats ORDER BY run_id DESC").fetchone()
    return wall, json.loads(choice)


def test_runner_run_stores_the_wall_from_the_process_start(make_job, tmp_path):
    # The second before the runner's entry point stands for Python's start and the runner's work
    # before generating; the stored wall must count it, as `time runner run` does.
    job = make_job(rows=4)
    code = f"import time; time.sleep({SLEEP_S}); import runner.cli; runner.cli.main()"
    proc = subprocess.run([sys.executable, "-c", code, "run", "--engine", "fake", "--quiet", str(job)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wall, choice = stored_stats(tmp_path / "out" / "results.sqlite")
    assert SLEEP_S - 0.05 <= choice["before_run_s"] < SLEEP_S + 20 and choice["wall_from"] == "process"
    assert wall >= choice["before_run_s"] and choice["lock_wait_s"] < 1


def test_a_second_command_in_one_process_counts_from_its_own_start(make_job, tmp_path, monkeypatch):
    # Tests call the entry point in-process: only the process's first command counts from its start.
    import runner.cli as cli_module
    import runner.process_clock as pc

    monkeypatch.setattr(pc, "_start", {})
    monkeypatch.setattr(pc, "process_age_s", lambda: 3600.0)  # as if the process had run an hour
    monkeypatch.setattr(cli_module.os, "_exit", lambda code: sys.exit(code))  # a completed run's exit, caught
    job = make_job(rows=4)
    for restart in ([], ["--restart"]):
        monkeypatch.setattr(cli_module, "_finished_run", {})
        monkeypatch.setattr(sys, "argv", ["runner", "run", "--engine", "fake", "--quiet", *restart, str(job)])
        with pytest.raises(SystemExit):
            cli_module.main()
        wall, choice = stored_stats(tmp_path / "out" / "results.sqlite")
        if not restart:
            assert choice["before_run_s"] >= 3600 and choice["wall_from"] == "process"
        else:
            assert choice["before_run_s"] < 60 and choice["wall_from"] == "command"


def test_the_library_counts_from_the_call_unless_told(make_job, tmp_path):
    job = load_job(make_job(rows=4))
    t = [100.0]

    def clock():
        t[0] += 0.5
        return t[0]

    run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema), clock=clock)
    wall, choice = stored_stats(job.database_path)
    assert choice["before_run_s"] == 0.0 and choice["wall_from"] == "call" and wall > 0
    run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema), clock=clock, restart=True,
            started=(t[0] - 60, "process"))
    wall2, choice = stored_stats(job.database_path)
    assert choice["before_run_s"] >= 60 and wall2 > choice["before_run_s"] and choice["wall_from"] == "process"
    # a start after the run's own (a caller's clock gone wrong) counts from the run
    run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema), clock=clock, restart=True,
            started=(t[0] + 1000, "process"))
    wall3, choice = stored_stats(job.database_path)
    assert choice["before_run_s"] == 0.0 and 0 < wall3 < 1000


def test_waiting_for_another_run_of_the_job_is_not_this_runs_wall(make_job, monkeypatch):
    import runner.run as run_module

    job = load_job(make_job(rows=4))
    t = [0.0]

    class SlowLock:  # the other run holds the job for 500 s of the clock, then lets go
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            t[0] += 500
            return self

        def __exit__(self, *exc):
            return False

    def clock():
        t[0] += 0.5
        return t[0]

    monkeypatch.setattr(run_module, "JobLock", SlowLock)
    run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema), clock=clock, wait=True,
            started=(t[0], "process"))
    wall, choice = stored_stats(job.database_path)
    assert 500 <= choice["lock_wait_s"] < 501 and wall < 100 and choice["before_run_s"] < 100
