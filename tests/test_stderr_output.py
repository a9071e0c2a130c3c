"""The runner's own stderr (progress bar, notes) is best effort: where it cannot be written the
run goes on; and an error after the bar starts a line of its own (cron logs are searched for it)."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

from click.testing import CliRunner

from runner.cli import cli
from runner.errors import StoreError


def test_a_run_whose_stderr_cannot_be_written_completes(make_job, tmp_path):
    """stderr on a full disk (/dev/full): the bar's first write failed and the run was recorded
    failed, no row stored, exit 1 with nothing said."""
    job = make_job(rows=30)
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "runner.cli", "run", "--engine", "fake", str(job)],
                              stdout=subprocess.PIPE, stderr=full, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stdout
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT status FROM runs").fetchall() == [("completed",)]
    assert con.execute("SELECT count(*) FROM results WHERE status = 'ok'").fetchone() == (30,)


def test_an_error_while_storing_starts_a_line_of_its_own(make_job, monkeypatch):
    """The last rows' commit failing (a full disk) left the progress bar open: `Error:` was appended
    to the bar's line, where a search for lines starting with it missed it."""
    from runner.collect import ResultCollector

    def full(self):
        raise StoreError("out/results.sqlite: database or disk is full")

    monkeypatch.setattr(ResultCollector, "flush", full)
    out = CliRunner().invoke(cli, ["run", "--engine", "fake", str(make_job(rows=5))])
    assert out.exit_code == 6, out.output
    assert "\nError: out/results.sqlite: database or disk is full\n" in out.output, repr(out.output)


def test_a_database_path_with_url_characters_is_the_file_named(make_job, tmp_path):
    """`#`, `?` or `%` in the database's path: the run wrote to out/team (cut at `#`) and then
    failed with a traceback, or wrote out/v while its lock and log were in out/v?1/."""
    for folder in ("team#2", "v?1", "a%20b"):
        job = make_job(rows=6, job={"output": {"database": f"out/{folder}/r.sqlite"}})
        out = CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", str(job)])
        assert out.exit_code == 0, out.output
        db = tmp_path / "out" / folder / "r.sqlite"
        assert sqlite3.connect(db).execute("SELECT count(*) FROM results").fetchone() == (6,)
        again = CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", str(job)])  # resumes: nothing to do
        assert again.exit_code == 0 and sqlite3.connect(db).execute("SELECT count(*) FROM runs").fetchone() == (2,)
        stats = CliRunner().invoke(cli, ["stats", "--db", str(db)])
        assert stats.exit_code == 0 and "ok 6" in stats.output, stats.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a%20b", "team#2", "v?1"]


def test_a_closed_standard_output_is_an_error_only_where_the_output_was_asked_for(make_job, tmp_path):
    """`>&-`: `run -q` stopped with a traceback (nothing to print), `export` too, and `report` and
    `stats` exited 0 having written nothing. A command that acts does its work and says nothing."""
    job = str(make_job(rows=4))

    def closed_stdout(*args):
        return subprocess.run([sys.executable, "-m", "runner.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"), preexec_fn=lambda: os.close(1))

    for args in (("run", "--engine", "fake", "-q", job), ("run", "--engine", "fake", "--restart", job),
                 ("validate", job), ("prune", job, "--keep-versions", "0")):
        done = closed_stdout(*args)
        assert done.returncode == 0 and "Traceback" not in done.stderr and "Error" not in done.stderr, (args, done.stderr)
        assert args[0] == "run" or done.stderr == ""
    db = next((tmp_path).rglob("*.sqlite"))
    assert sqlite3.connect(db).execute("SELECT count(*) FROM results_history").fetchone() == (0,)  # the prune ran
    for args, hint in ((("export", "--job", job, "--format", "csv"), " (give -o FILE)"),
                       (("report", "1", "--job", job), " (give -o FILE.html)"),
                       (("stats", "--job", job), ""), (("status", job), ""), (("plan", job), ""),
                       (("prune", job, "--keep-versions", "0", "--dry-run"), "")):
        done = closed_stdout(*args)
        assert done.returncode == 6, (args, done.stderr)
        assert done.stderr == f"Error: standard output is closed: nothing can be written to it{hint}\n", args
    done = closed_stdout("export", "--job", job, "-o", str(tmp_path / "r.csv"))  # a file is still written
    assert done.returncode == 0 and (tmp_path / "r.csv").read_text().count("\n") == 5, done.stderr
