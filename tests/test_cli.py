"""The command line through click's CliRunner: output, `Error:` lines and exit codes."""
from __future__ import annotations

import json
import shutil
import sqlite3

import pytest
import yaml
from click.testing import CliRunner

from runner.cli import cli


@pytest.fixture
def invoke():
    def go(*args):
        return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return go


@pytest.mark.parametrize("command", [[], ["run"], ["validate"], ["plan"], ["stats"], ["report"], ["export"],
                                     ["prepare-model"], ["calibrate"], ["status"], ["prune"]])
def test_every_command_has_help_with_an_example(invoke, command):
    out = invoke(*command, "--help")
    assert out.exit_code == 0
    assert "Example:" in out.output and "runner" in out.output


@pytest.mark.parametrize("args, message", [
    (["prune", "job.yaml"], "Missing option '--keep-versions'. (see: runner prune --help)"),
    (["prune", "--keep-versions", "-1", "job.yaml"], "Invalid value for '--keep-versions': -1 is not in the range"),
    (["stats", "--last", "x"], "Invalid value for '--last': 'x' is not a valid integer range. (see: runner stats --help)"),
    (["run"], "Missing argument 'JOB'. (see: runner run --help)"),
    (["nope"], "No such command 'nope'. (see: runner --help)"),
    (["distill", "job.yaml", "--out", "d", "--layers", "-5"], "Invalid value for '--layers': -5 is not in the range x>=1."),
    (["distill", "job.yaml", "--out", "d", "--epochs", "0"], "Invalid value for '--epochs': 0 is not in the range x>=1."),
    (["distill", "job.yaml", "--out", "d", "--holdout", "7"], "Invalid value for '--holdout': 7.0 is not in the range 0<x<1."),
    (["distill", "job.yaml", "--out", "d", "--max-rows", "-3"], "Invalid value for '--max-rows': -3 is not in the range x>=1."),
    (["verify", "job.yaml", "--rows", "0"], "Invalid value for '--rows': 0 is not in the range x>=1."),
])
def test_a_usage_error_is_one_error_line(args, message):
    """click printed its usage, a hint and the error on 3-4 lines; every other error is one line."""
    out = CliRunner().invoke(cli, args, prog_name="runner")
    assert out.exit_code == 2 and out.stdout == "" and len(out.stderr.splitlines()) == 1, out.output
    assert out.stderr.startswith("Error: ") and message in out.stderr, out.stderr


def test_runner_alone_shows_its_help(invoke):
    out = invoke()
    assert out.exit_code == 2 and "Commands:" in out.output and "Error" not in out.output


def test_validate_reports_rows_and_model(invoke, make_job):
    out = invoke("validate", make_job(rows=7))
    assert out.exit_code == 0, out.output
    assert "7 rows in 1 file\n" in out.output and "[ready]" in out.output


def test_plan_prints_groups_and_prefix_bound(invoke, make_job, tmp_path, monkeypatch):
    out = invoke("plan", make_job(rows=12))
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0].split()[:2] == ["group", "rows"]
    assert [int(l.split()[1]) for l in lines[1:3]] == [6, 6]
    assert "2 groups, 12 rows" in out.output
    share = float(out.output.rsplit(":", 1)[1].strip().rstrip("%"))
    assert 50 < share < 100
    # the builtin model not prepared yet: the bound is estimated from characters, and says so
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    from runner.models import builtin_model_dir

    out = invoke("plan", make_job(rows=12, engine={"model": str(builtin_model_dir())}))
    assert out.exit_code == 0, out.output
    last = out.output.splitlines()[-1]
    assert last.endswith("(estimated: model not prepared)")
    estimate = float(last.rsplit(": ~", 1)[1].split("%")[0])
    assert 50 < estimate < 100
    # a mistyped folder is not "not prepared": plan stops as validate and run do (it printed estimates)
    out = invoke("plan", make_job(rows=12, engine={"model": str(tmp_path / "modles/tiny")}))
    assert out.exit_code == 4 and "model folder not found or incomplete: no such folder" in out.output, out.output


def test_run_with_fake_engine_then_stats(invoke, make_job, tmp_path):
    job = make_job(rows=9)
    out = invoke("run", "--engine", "fake", "--quiet", job)
    assert out.exit_code == 0 and out.output == ""
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT count(*), count(DISTINCT row_id) FROM results").fetchone() == (9, 9)
    assert con.execute("SELECT count(*) FROM run_stats").fetchone()[0] == 1
    out = invoke("run", "--engine", "fake", job)
    assert "0 run, 9 already done, 9 in input" in out.output and "Results:" in out.output
    # the nightly rerun that found every row stored does not hide the run that made them
    out = invoke("stats", "--job", job, "--last", "2")
    assert out.exit_code == 0
    assert out.output.count("completed") == 1 and out.output.startswith("run 1 ") and "ok 9" in out.output
    got = json.loads(invoke("stats", "--job", job, "--json").output)
    assert [r["run"]["id"] for r in got] == [1] and got[0]["stats"]["documents_per_s"] > 0
    out = invoke("stats", "--job", job, "--last", "2", "--with-idle")
    assert out.output.count("completed") == 2 and out.output.startswith("run 2 ")
    out = invoke("stats", "1", "--db", tmp_path / "out" / "results.sqlite")
    assert out.output.startswith("run 1  t  completed") and "(plan bound " in out.output
    idle = invoke("stats", "2", "--db", tmp_path / "out" / "results.sqlite")  # generated nothing: no bound of 0.0%
    assert idle.exit_code == 0 and "prefix-cache hit rate" in idle.output and "plan bound" not in idle.output
    with sqlite3.connect(tmp_path / "out" / "results.sqlite") as old:  # as an older version stored it
        old.execute("UPDATE run_stats SET plan_prefix_share = 0.0 WHERE run_id = 2")
    idle = invoke("stats", "2", "--db", tmp_path / "out" / "results.sqlite")
    assert idle.exit_code == 0 and "plan bound" not in idle.output
    other = tmp_path / "other.sqlite"
    shutil.copy(tmp_path / "out" / "results.sqlite", other)
    for command in (["stats"], ["report", "1"], ["export", "--format", "csv"]):  # which one would it read?
        out = CliRunner().invoke(cli, [*command, "--job", str(job), "--db", str(other)])
        assert out.exit_code == 2 and out.output == "Error: give --job JOB or --db DATABASE, not both\n"
        out = CliRunner().invoke(cli, [*command, "--db", str(other), "--set", "output.database=elsewhere.sqlite"])
        assert out.exit_code == 2 and out.output.startswith("Error: --set changes a job's settings")


@pytest.mark.parametrize("break_it, code, message", [
    (lambda s: s["input"].update(idcolumn="x"), 2, "Error: {job}: input.idcolumn: unknown key"),
    (lambda s: s["input"].update(path="nowhere.parquet"), 3, "nowhere.parquet: input file not found"),
    (lambda s: s["input"].update(id_column="nope"), 3, "column 'nope' (input.id_column) not found"),
])
def test_errors_are_one_line_with_exit_code(invoke, make_job, break_it, code, message):
    job = make_job()
    spec = yaml.safe_load(job.read_text())
    break_it(spec)
    job.write_text(yaml.safe_dump(spec))
    for command in ("validate", "run"):
        result = CliRunner().invoke(cli, [command, "--engine", "fake", str(job)] if command == "run" else [command, str(job)])
        assert result.exit_code == code
        assert result.output.strip().splitlines() == [result.output.strip()]  # one line
        assert result.output.startswith("Error: ") and message.format(job=job) in result.output


def test_missing_model_is_an_error(invoke, make_job, tmp_path):
    job = make_job(engine={"model": str(tmp_path / "no-model")})
    result = CliRunner().invoke(cli, ["run", str(job)])
    assert result.exit_code == 4
    assert result.output == f"Error: {tmp_path / 'no-model'}: model folder not found or incomplete: no such folder (engine.model)\n"
    (tmp_path / "no-model").mkdir()
    result = CliRunner().invoke(cli, ["validate", str(job)])
    assert result.exit_code == 4 and result.output.endswith("no-model: model folder not found or incomplete: no tokenizer.json\n")
    assert "prepare-model" not in result.output  # only the builtin model's folder is prepared by the runner
    builtin = make_job(engine={"model": "builtin:smollm2-135m-instruct"})
    result = CliRunner().invoke(cli, ["validate", str(builtin)], env={"RUNNER_CACHE": str(tmp_path / "cache")})
    assert result.exit_code == 4 and result.output == (
        f"Error: {tmp_path / 'cache' / 'models' / 'smollm2-135m-instruct'}: the builtin model is not prepared yet: "
        "run `runner prepare-model` once\n")


def test_stats_without_database(invoke, tmp_path):
    result = CliRunner().invoke(cli, ["stats", "--db", str(tmp_path / "none.sqlite")])
    assert result.exit_code == 7 and "Error: " in result.output and "no results database" in result.output
    # monitoring reads --json: a job that has not run has no runs, which is not a failure
    result = CliRunner().invoke(cli, ["stats", "--db", str(tmp_path / "none.sqlite"), "--json"])
    assert result.exit_code == 0 and json.loads(result.output) == []
    result = CliRunner().invoke(cli, ["stats", "3", "--db", str(tmp_path / "none.sqlite"), "--json"])
    assert result.exit_code == 7 and "Error: " in result.output  # a run asked for by id is not there
    result = CliRunner().invoke(cli, ["stats"])
    assert result.exit_code == 2 and "give --job JOB or --db DATABASE" in result.output


def test_calibrate_then_run_reuses_the_stored_choice(invoke, make_job):
    job = make_job(rows=20, engine={"speculative": "auto", "calibration": {"rows": 4}})
    out = invoke("calibrate", "--engine", "fake", job)
    assert out.exit_code == 0, out.output
    assert "stored as calibration #1" in out.output and "0 drafts" in out.output and "6 drafts" in out.output
    out = invoke("run", "--engine", "fake", job)
    assert out.exit_code == 0, out.output
    assert "(calibration #1 of " in out.output and "reused" in out.output
    out = invoke("run", "--engine", "fake", "--restart", "--recalibrate", job)
    assert "stored as calibration #2" in out.output
    out = invoke("stats", "--job", job)
    assert "stored as calibration #2" in out.output


def test_calibrate_refuses_a_fixed_speculative_setting(invoke, make_job):
    out = invoke("calibrate", "--engine", "fake", make_job(rows=4))
    assert out.exit_code == 2 and out.output.startswith("Error: ") and "speculative: auto" in out.output


def test_calibrate_and_verify_take_set_as_run_does(invoke, make_job):
    """A job whose engine config fixes its drafts is calibrated with --set engine.speculative=auto,
    and a run with the same --set reuses what it stored; verify --set checks the setting given."""
    job = make_job(rows=20, engine={"calibration": {"rows": 4}})  # the test config's fixed ngram
    auto = ("--set", "engine.speculative=auto")
    out = invoke("calibrate", "--engine", "fake", *auto, job)
    assert out.exit_code == 0, out.output
    assert "stored as calibration #1" in out.output
    out = invoke("run", "--engine", "fake", *auto, job)
    assert out.exit_code == 0 and "(calibration #1 of " in out.output and "reused" in out.output, out.output
    out = invoke("verify", "--engine", "fake", "--rows", "4", "--set", "engine.speculative.num_speculative_tokens=2", job)
    assert out.exit_code == 0 and "(k=2)" in out.output, out.output


def test_python_dash_m_knows_every_command():
    """`python -m runner.cli` (what tests and the benchmark run) registers the same commands."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "runner.cli", "--help"], capture_output=True, text=True, timeout=60)
    for command in ("run", "validate", "plan", "calibrate", "verify", "distill", "status", "prune", "stats", "report", "export"):
        assert f"  {command} " in out.stdout, command


def test_plan_counts_the_rows_a_run_would_store_failed_as_too_long(invoke, make_job, tmp_path):
    job = make_job(rows=12)
    out = invoke("plan", job)
    assert out.exit_code == 0 and "too long" not in out.output and "with a prompt over" not in out.output
    # 40 tokens of room: the rows whose prompt is longer are the rows a run stores failed
    tight = ("--set", "sampling.max_tokens=984")
    out = invoke("plan", *tight, job)
    assert out.exit_code == 0, out.output
    line = next(l for l in out.output.splitlines() if "with a prompt over 40 tokens" in l)
    planned = int(line.split()[0])
    assert invoke("run", "--engine", "fake", "--quiet", *tight, job).exit_code in (0, 65)
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    failed = con.execute("SELECT count(*) FROM results WHERE status = 'failed' AND error LIKE 'prompt is %'").fetchone()[0]
    assert 0 < planned == failed and "input.on_too_long: fail: a run stores them as failed" in line
    # these rows' system prompts alone are over the 40 tokens: no cut saves them, and neither says it would
    beyond = next(l for l in out.output.splitlines() if "no cut of the document makes those fit" in l)
    assert int(beyond.split()[0]) == planned
    errors = [e for (e,) in con.execute("SELECT error FROM results WHERE status = 'failed'")]
    assert errors and all("do not fit even with the document cut" in e and "truncate" not in e for e in errors)


def test_plan_counts_the_rows_no_cut_saves_as_a_truncating_run_does(invoke, make_job, tmp_path):
    """plan counted only groups whose system prompt alone was over the room; the chat template's
    and the user template's tokens count too (a run stored 125 rows failed where plan said 75)."""
    from runner.prompting import Document, builder_for
    from runner.spec import load_job
    from tests.conftest import SYSTEM_A

    job = make_job(rows=12)
    b = builder_for(load_job(job))
    system = b.system_prefix_tokens(SYSTEM_A)
    bare = len(b.prompt_ids(SYSTEM_A, b.user_text(Document("x", "", SYSTEM_A, {}))))
    assert bare > system + 2  # the room below lies between: the system prompt fits, the bare prompt does not
    room = (system + bare) // 2
    tight = ("--set", f"sampling.max_tokens={1024 - room}", "--set", "input.on_too_long=truncate")
    out = invoke("plan", *tight, job)
    assert out.exit_code == 0, out.output
    line = next(l for l in out.output.splitlines() if "no cut of the document makes those fit" in l)
    assert invoke("run", "--engine", "fake", "--quiet", *tight, job).exit_code in (0, 65)
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    failed = con.execute("SELECT count(*) FROM results WHERE status = 'failed'").fetchone()[0]
    assert int(line.split()[0]) == failed > 0
    # SYSTEM_A's 6 rows fail, its system prompt alone within the room: the old count left them out
    assert con.execute("SELECT count(*) FROM results r WHERE status = 'failed' AND error LIKE '%do not fit even%' "
                       "AND row_id IN ('r000', 'r001', 'r002', 'r006', 'r007', 'r008')").fetchone()[0] == 6
