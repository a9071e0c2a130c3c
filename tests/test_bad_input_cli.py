"""Bad input through the CLI: one `Error:` line, a non-zero exit code, and no run at all."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from runner.cli import cli


def _parquet(path, **cols):
    pq.write_table(pa.table(cols), path)


def bad_parquet(kind):
    def make(tmp_path, job):
        f = tmp_path / "data" / "docs.parquet"
        if kind == "missing":
            f.unlink()
        elif kind == "corrupt":
            f.write_bytes(f.read_bytes()[:200])
        elif kind == "empty":
            _parquet(f, id=pa.array([], pa.string()), text=pa.array([], pa.string()), system_prompt=pa.array([], pa.string()))
        elif kind == "no_id":
            _parquet(f, key=["a"], text=["t"], system_prompt=["s"])
        elif kind == "no_text":
            _parquet(f, id=["a"], body=["t"], system_prompt=["s"])
        elif kind == "dup_ids":
            _parquet(f, id=["a", "a"], text=["t", "u"], system_prompt=["s", "s"])
        elif kind == "null_text":
            _parquet(f, id=["a", "b"], text=["t", None], system_prompt=["s", "s"])
        elif kind == "not_utf8":
            _parquet(f, id=["a"], text=pa.array([b"caf\xe9"], pa.binary()), system_prompt=["s"])
        elif kind == "extra_not_utf8":
            _parquet(f, id=["a"], text=["t"], system_prompt=["s"], title=pa.array([b"caf\xe9"], pa.binary()))
    return make


def edit_job(fn):
    def make(tmp_path, job):
        spec = yaml.safe_load(job.read_text())
        fn(spec, tmp_path)
        job.write_text(yaml.safe_dump(spec))
    return make


def write_text(rel, text):
    def make(tmp_path, job):
        (tmp_path / rel if rel else job).write_text(text)
    return make


CASES = [
    ("missing parquet", bad_parquet("missing"), 3, "docs.parquet: input file not found"),
    ("corrupt parquet", bad_parquet("corrupt"), 3, "docs.parquet: "),
    ("empty input", bad_parquet("empty"), 3, "the input has no rows"),
    ("missing id column", bad_parquet("no_id"), 3, "column 'id' (input.id_column) not found"),
    ("missing text column", bad_parquet("no_text"), 3, "column 'text' (input.text_column) not found"),
    ("duplicate ids", bad_parquet("dup_ids"), 3, "duplicate id 'a'"),
    ("null text", bad_parquet("null_text"), 3, "null in 1 row, first at id 'b'"),
    ("non-UTF-8 bytes", bad_parquet("not_utf8"), 3, "not UTF-8 text"),
    ("invalid YAML", write_text(None, "name: t\n  input: : :\n"), 2, "job.yaml: invalid YAML"),
    ("unknown key", edit_job(lambda s, p: s["output"].update(databse="x")), 2, "job.yaml: output.databse: unknown key"),
    ("schema not JSON Schema", write_text("schemas/out.json", json.dumps({"type": 12})), 2,
     "out.json: not a valid JSON Schema"),
    ("extra column not UTF-8", lambda p, j: (bad_parquet("extra_not_utf8")(p, j), edit_job(
        lambda s, _: s["input"].update(extra_columns=["title"]))(p, j)), 3,
     "column 'title' (input.extra_columns) holds bytes that are not UTF-8 text"),
    ("template indexing", edit_job(lambda s, p: s.update(prompts={"user_template": "{text} {title[999]}"}) or
                                   s["input"].update(extra_columns=["title"])), 2,
     "prompts.user_template: {title[999]}: use a column name"),
    ("template attribute", edit_job(lambda s, p: s.update(prompts={"user_template": "{text.upper}"})), 2,
     "prompts.user_template: {text.upper}"),
    ("template conversion", edit_job(lambda s, p: s.update(prompts={"user_template": "{text!x}"})), 2,
     "prompts.user_template: {text!x}: unknown conversion !x (use !r, !s or !a)"),
    ("template without a field", edit_job(lambda s, p: s.update(prompts={"user_template": "Summarize."})), 2,
     "prompts.user_template: uses no field; the document is {text}"),
    ("schema ref to nothing", write_text("schemas/out.json", json.dumps(
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}, "required": ["a"]})), 2,
     "out.json: #/properties/a/$ref: $ref '#/$defs/nope' points to nothing in the file"),
    ("schema anchor to nothing", write_text("schemas/out.json", json.dumps(
        {"type": "object", "properties": {"a": {"$ref": "#nope"}, "b": {"$anchor": "here", "type": "string"},
                                          "c": {"$ref": "#here"}}, "required": ["a"]})), 2,
     "out.json: #/properties/a/$ref: $ref '#nope' points to nothing in the file"),
    ("schema ref loop", write_text("schemas/out.json", json.dumps(
        {"type": "object", "$defs": {"x": {"$ref": "#/$defs/y", "description": "d"}, "y": {"$ref": "#/$defs/x"}},
         "properties": {"a": {"type": "string"}, "b": {"$ref": "#/$defs/x"}}, "required": ["a"]})), 2,
     "out.json: #/$defs/x/$ref: $ref '#/$defs/y' leads back to itself without going into the value"),
    ("schema ref loop through allOf", write_text("schemas/out.json", json.dumps(
        {"type": "object", "$defs": {"a": {"allOf": [{"type": "object"}, {"$ref": "#/$defs/a"}]}},
         "properties": {"a": {"type": "string"}, "b": {"$ref": "#/$defs/a"}}, "required": ["a"]})), 2,
     "out.json: #/$defs/a/allOf/1/$ref: $ref '#/$defs/a' leads back to itself without going into the value"),
    ("schema anchor loop", write_text("schemas/out.json", json.dumps(
        {"type": "object", "$defs": {"a": {"$anchor": "here", "type": "object", "$ref": "#here"}},
         "properties": {"a": {"type": "string"}, "b": {"$ref": "#here"}}, "required": ["a"]})), 2,
     "out.json: #/$defs/a/$ref: $ref '#here' leads back to itself without going into the value"),
    ("schema nested too deeply", write_text("schemas/out.json", '{"type": "object", "properties": {"a": ' * 300
                                            + '{"type": "string"}' + "}}" * 300), 2,
     "out.json: nested too deeply to be checked"),
    ("schema JSON nested too deeply", write_text("schemas/out.json", "[" * 5000 + "]" * 5000), 2,
     "out.json: nested too deeply to be checked"),
    ("empty stop string", edit_job(lambda s, p: s["sampling"].update(stop=[""])), 2,
     "job.yaml: sampling.stop: Value error, an empty string would stop every output"),
    ("max_tokens past the model length", edit_job(lambda s, p: s["sampling"].update(max_tokens=100_000)), 2,
     "job.yaml: sampling.max_tokens: 100000 leaves no room for a prompt within max_model_len"),
    ("engine config a folder", edit_job(lambda s, p: s["engine"].update(config="configs")), 2,
     "configs is a folder: name the engine config file in it"),
    ("missing model path", edit_job(lambda s, p: s["engine"].update(model=str(p / "nope"))), 4, "nope: model folder not found or incomplete: no such folder (engine.model)"),
]


@pytest.mark.parametrize("name, breaker, code, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_error_line_and_no_run(make_job, tmp_path, name, breaker, code, message):
    job = make_job(rows=6)
    breaker(tmp_path, job)
    # `runner validate && runner run` from cron: validate stops where run would, with the same line
    for command in (["validate"], ["run", "--engine", "fake"]):
        result = CliRunner().invoke(cli, [*command, str(job)])
        assert result.exit_code == code, (command, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], command
    assert not (tmp_path / "out" / "results.sqlite").exists()  # no partial run


def test_a_database_path_that_holds_another_kind_of_file_stops_validate_as_it_stops_run(make_job, tmp_path):
    job = make_job(rows=6)
    db = tmp_path / "out" / "results.sqlite"
    db.parent.mkdir(parents=True, exist_ok=True)
    db.write_text("not a database\n")
    for command, message in ((["validate"], "output.database: the file there is not a SQLite database"),
                             (["run", "--engine", "fake"], "file is not a database")):
        result = CliRunner().invoke(cli, [*command, str(job)])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 6 and len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0]
    assert db.read_text() == "not a database\n"
    db.write_bytes(b"")  # an empty file is an empty database to SQLite: fine
    assert CliRunner().invoke(cli, ["validate", str(job)]).exit_code == 0


def test_validate_refuses_a_model_folder_without_weights_for_a_local_engine(make_job, tmp_path, model_dir):
    import shutil

    no_weights = tmp_path / "no-weights"
    shutil.copytree(model_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    job = make_job(rows=6)
    edit_job(lambda s, p: s["engine"].update(model=str(no_weights)))(tmp_path, job)
    result = CliRunner().invoke(cli, ["validate", str(job)])
    assert result.exit_code == 4 and result.output.startswith("Error: ") and len(result.output.splitlines()) == 1
    assert "no-weights: model folder not found or incomplete: no *.safetensors weights" in result.output
    # with Ray the replicas load the weights where they run: here only the tokenizer must be
    ray = CliRunner().invoke(cli, ["validate", "--set", "executor=ray", str(job)])
    assert ray.exit_code == 0, ray.output
    assert "weights not here: the Ray replicas load them" in ray.output


def test_on_bad_row_store_records_bad_rows_and_runs_the_rest(make_job, tmp_path):
    """One bad row does not abort the night: null texts and system prompts are stored failed with
    the reason, repeated ids keep their first row and the rest are listed in rejected_rows."""
    import shlex
    import sqlite3

    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = tmp_path / "data" / "bad.parquet"
    docs.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "id": ["a", "b", "a", None, "c", "d", "c"],
        "text": ["first a", None, "second a", "no id", "first c", "d text", "second c"],
        "system_prompt": ["S", "S", "S", "S", "S", None, "S"]}), docs, row_group_size=3)
    job = make_job(docs=docs)
    refused = CliRunner().invoke(cli, ["run", "--engine", "fake", str(job)])
    assert refused.exit_code == 3 and "input.on_bad_row: store runs the other rows" in refused.output
    assert not (tmp_path / "out" / "results.sqlite").exists()

    # plan counts what a run generates: the null text and null system prompt rows apart, no group for them
    plan = CliRunner().invoke(cli, ["plan", "--set", "input.on_bad_row=store", str(job)])
    assert plan.exit_code == 0 and "1 group, 2 rows," in plan.output, plan.output
    assert "2 rows with a null text or system prompt" in plan.output and "(no system prompt)" not in plan.output
    result = CliRunner().invoke(cli, ["run", "--engine", "fake", "--set", "input.on_bad_row=store", str(job)])
    assert result.exit_code == 0, result.output
    assert "3 input rows left out (null or repeated ids" in result.output
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    rows = dict(con.execute("SELECT row_id, status || ':' || coalesce(error, '') FROM results"))
    assert rows == {"a": "ok:", "c": "ok:", "b": "failed:input: null text (text)",
                    "d": "failed:input: null system prompt (system_prompt)"}
    assert con.execute("SELECT input_row_number, row_id, reason FROM rejected_rows ORDER BY 1").fetchall() == [
        (2, "a", "duplicate id (the first row with it runs)"), (3, None, "null id"),
        (6, "c", "duplicate id (the first row with it runs)")]
    # the throughput samples count the failed rows apart: the report's curve is of rows generated
    assert con.execute("SELECT rows_done, rows_failed FROM run_samples ORDER BY elapsed_s DESC").fetchone() == (4, 2)
    again = CliRunner().invoke(cli, ["run", "--engine", "fake", "--set", "input.on_bad_row=store", str(job)])
    assert again.exit_code == 0 and "4 already done" in again.output, again.output
    # rows left out count against output.max_failed_fraction as the failed ones do: 5 of 7, not 2 of 4
    judged = CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", "--set", "input.on_bad_row=store",
                                      "--set", "output.max_failed_fraction=0.5", str(job)])
    assert judged.exit_code == 65 and judged.output.startswith(
        "Error: the run completed, but 5 of the input's 7 rows (71.4%, 3 of them left out for null or repeated ids) "
        "are not ok (output.max_failed_fraction: 50.0%)"), judged.output
    # the hint keeps the run's --set settings (they may name another database): pasted, it shows these rows
    hint = judged.output.strip().split("; see: ")[1]
    assert hint == f"runner status --set input.on_bad_row=store --set output.max_failed_fraction=0.5 {job}", hint
    shown = CliRunner().invoke(cli, shlex.split(hint)[1:])
    assert shown.exit_code == 0 and "4 rows stored" in shown.output, shown.output


def test_the_reports_throughput_counts_rows_generated_not_rows_failed():
    """Failed rows were never generated: 10 rows stored in a second, 8 of them failed, is 2 a second
    (as the run's documents/s counts them); samples from before the column have 0 failed."""
    from runner.report import generated_rates

    samples = [dict(elapsed_s=0.0, rows_done=0, rows_failed=0), dict(elapsed_s=1.0, rows_done=10, rows_failed=8),
               dict(elapsed_s=1.0, rows_done=10, rows_failed=8), dict(elapsed_s=3.0, rows_done=16, rows_failed=8)]
    assert generated_rates(samples) == ([1.0, 3.0], [2.0, 3.0])



def test_the_reports_throughput_spans_at_least_a_second_a_point():
    """An engine step's rows stored in commits a millisecond apart read as 4,000 a second, then 0."""
    from runner.report import generated_rates

    samples = [dict(elapsed_s=0.0, rows_done=0, rows_failed=0)]
    for step in range(1, 41):  # every 0.1 s an engine step finishes 8 rows, stored in two commits of 4
        samples += [dict(elapsed_s=step / 10, rows_done=8 * step - 4, rows_failed=0),
                    dict(elapsed_s=step / 10 + 0.001, rows_done=8 * step, rows_failed=0)]
    xs, ys = generated_rates(samples)
    assert len(xs) == 4 and all(b - a >= 0.99 for a, b in zip([0.0] + xs, xs)) and xs[-1] == samples[-1]["elapsed_s"]
    assert all(75 <= y <= 85 for y in ys), ys  # 80 a second throughout
    # a last sample at the time of the one before still counts; a run under a second has no point
    rows = lambda *pairs: [dict(elapsed_s=t, rows_done=n, rows_failed=0) for t, n in pairs]  # noqa: E731
    assert generated_rates(rows((0, 0), (5, 10), (5, 14))) == ([5], [2.8])
    assert generated_rates(rows((0, 0), (0.001, 4))) == ([], []) and generated_rates(rows((0, 0))) == ([], [])


def test_jsonl_csv_and_openai_batch_inputs_run_like_parquet(make_job, tmp_path):
    """The same documents as JSON Lines (in hive partitions), CSV, and an OpenAI batch file
    (vLLM run_batch's input) give the same rows, prompts and groups as Parquet."""
    import csv
    import sqlite3

    rows = [{"id": f"r{i}", "text": f"Review {i}: it broke.", "system_prompt": f"Prompt {i % 2}"} for i in range(6)]
    for part in ("2026-11-29", "2026-11-30"):
        d = tmp_path / "jsonl" / f"day={part}"
        d.mkdir(parents=True)
        (d / "docs.jsonl").write_text("".join(json.dumps(r | {"id": f"{r['id']}-{part}"}) + "\n" for r in rows[:3]))
    with open(tmp_path / "docs.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, ["id", "text", "system_prompt"])
        w.writeheader()
        w.writerows(rows)
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps({
        "custom_id": r["id"], "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "system", "content": r["system_prompt"]},
                                            {"role": "user", "content": [{"type": "text", "text": r["text"]}]}]}}) + "\n"
        for r in rows))
    job = make_job()
    cases = {
        "jsonl": ["--set", "input.path=jsonl", "--set", "input.extra_columns=[day]"],
        "csv": ["--set", "input.path=docs.csv"],
        "openai": ["--set", "input.path=batch.jsonl", "--set", "input.format=openai-batch", "--set", "input.id_column=custom_id",
                   "--set", "input.text_column=user", "--set", "input.system_prompt_column=system"],
    }
    for name, args in cases.items():
        db = tmp_path / f"{name}.sqlite"
        plan = CliRunner().invoke(cli, ["plan", *args, str(job)])
        assert plan.exit_code == 0 and "2 groups, 6 rows" in plan.output, (name, plan.output)
        out = CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", *args, "--set", f"output.database={db}", str(job)])
        assert out.exit_code == 0, (name, out.output)
        ids = sorted(r[0] for r in sqlite3.connect(db).execute("SELECT row_id FROM results WHERE status = 'ok'"))
        expected = sorted(f"r{i}-{d}" for i in range(3) for d in ("2026-11-29", "2026-11-30")) if name == "jsonl" \
            else [f"r{i}" for i in range(6)]
        assert ids == expected, name
    (tmp_path / "batch.jsonl").write_text('{"custom_id": "x", "body": {}}\n')
    bad = CliRunner().invoke(cli, ["validate", *cases["openai"], str(job)])
    assert bad.exit_code == 3 and "batch.jsonl: line 1: not an OpenAI batch request" in bad.output


@pytest.mark.parametrize("where", ["under_a_file", "read_only", "a_folder"])
def test_validate_refuses_a_database_that_cannot_be_written(make_job, tmp_path, where):
    blocker = tmp_path / "blocker"
    if where == "a_folder":  # output.database: out/ meant a file in it
        blocker.mkdir()
        db = blocker
    elif where == "under_a_file":
        blocker.write_text("")
        db = blocker / "sub" / "results.sqlite"  # its nearest existing "folder" is a file
    else:
        if os.getuid() == 0:
            pytest.skip("root writes in any folder")
        blocker.mkdir(mode=0o500)
        db = blocker / "results.sqlite"
    job = make_job(rows=6)
    edit_job(lambda s, p: s["output"].update(database=str(db)))(tmp_path, job)
    result = CliRunner().invoke(cli, ["validate", str(job)])
    assert result.exit_code == 6 and len(result.output.splitlines()) == 1, result.output
    assert result.output.startswith(f"Error: {db}: output.database: " + (
        "is a folder: name the database file in it" if where == "a_folder" else "cannot be written")), result.output
    run = CliRunner().invoke(cli, ["run", "--engine", "fake", str(job)])
    assert run.exit_code == 6 and run.output == result.output  # what validate foretold, as it said it


def test_a_parquet_file_read_as_another_format_is_said_so_and_an_error_line_holds_no_control_bytes(make_job):
    """input.format: csv on a Parquet file gave pyarrow's 600-character message with the file's NULs
    in it, written to the terminal as they were."""
    from runner.summary import one_line

    job = make_job(rows=3)
    out = CliRunner().invoke(cli, ["validate", "--set", "input.format=csv", str(job)])
    assert out.exit_code == 3 and out.output.endswith(": a Parquet file, read as csv (input.format: csv)\n"), out.output
    assert one_line("row 12: \x00\x01PAR1\x1b[31m\tend \u00e9") == "row 12: \\x00\\x01PAR1\\x1b[31m end \u00e9"


@pytest.mark.parametrize("blocked", ["engine log", "lock file"])
def test_validate_refuses_a_log_or_lock_path_a_run_could_not_write(make_job, tmp_path, blocked):
    """A folder where the job's engine log or lock file goes: the run would stop with exit 6, so
    validate does, naming the path."""
    job = make_job(rows=3)
    db = tmp_path / "out" / "results.sqlite"
    path = Path(f"{db}.t.{'log' if blocked == 'engine log' else 'lock'}")
    path.mkdir(parents=True)
    result = CliRunner().invoke(cli, ["validate", str(job)])
    assert result.exit_code == 6 and len(result.output.splitlines()) == 1, result.output
    assert result.output == (f"Error: {path}: the job's {blocked} beside its results database cannot be written: "
                             "not a writable file\n")
    run = CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", str(job)])
    assert run.exit_code == 6 and run.output == result.output  # what validate foretold, as it said it


def test_validate_refuses_a_writable_database_in_a_folder_this_user_cannot_write(make_job, tmp_path):
    if os.getuid() == 0:
        pytest.skip("root writes in any folder")
    job = make_job(rows=3)
    assert CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", str(job)]).exit_code == 0
    out = tmp_path / "out"
    out.chmod(0o500)
    try:
        result = CliRunner().invoke(cli, ["validate", str(job)])
    finally:
        out.chmod(0o700)
    assert result.exit_code == 6 and f"{out} is not a folder this user can write in" in result.output, result.output


def test_validate_refuses_a_database_on_a_filesystem_even_root_cannot_write(make_job):
    """os.access says yes to root everywhere: validate said OK for /sys/x.sqlite, and the run then
    stopped at the engine log beside it."""
    if os.getuid() != 0 or not os.path.isdir("/sys/kernel"):
        pytest.skip("needs root and sysfs")
    job = make_job(rows=3)
    for command in (["validate"], ["run", "--engine", "fake", "--quiet"]):
        result = CliRunner().invoke(cli, [*command, "--set", "output.database=/sys/x.sqlite", str(job)])
        assert result.exit_code == 6 and result.output == (
            "Error: /sys/x.sqlite: output.database: cannot be written: /sys is not a folder this user can write "
            "in\n"), result.output


def test_a_file_of_another_format_read_as_parquet_is_said_so(make_job, tmp_path):
    """input.format: parquet on a JSON Lines file said "corrupt Parquet file (ArrowInvalid: ... magic bytes ...)"."""
    (tmp_path / "docs.jsonl").write_text('{"id": "1", "text": "t", "system_prompt": "S"}\n')
    job = make_job(rows=3)
    out = CliRunner().invoke(cli, ["validate", "--set", "input.path=docs.jsonl", "--set", "input.format=parquet", str(job)])
    assert out.exit_code == 3 and out.output == (
        f"Error: {tmp_path / 'docs.jsonl'}: not a Parquet file, read as parquet (input.format: parquet)\n"), out.output
    (tmp_path / "data" / "docs.parquet").write_bytes(b"PAR1 cut off")  # named and begun as Parquet: corrupt
    out = CliRunner().invoke(cli, ["validate", str(job)])
    assert out.exit_code == 3 and ": corrupt Parquet file (" in out.output, out.output


def test_the_failed_share_and_its_limit_are_written_so_that_they_differ():
    """7 of 70 rows over a limit of 0.0999 read "(10.0%) are not ok (output.max_failed_fraction: 10.0%)"."""
    from runner.cli import _apart

    assert _apart(0.1, 0.0999) == ("10.00%", "9.99%")
    assert _apart(5 / 7, 0.5) == ("71.4%", "50.0%")


def test_shares_alike_to_five_decimals_are_still_written_apart():
    from runner.cli import _apart

    a, b = _apart(1 / 3, 0.3333333)
    assert a != b and a.startswith("33.3333333") and b == "33.33333%"
