"""runner export: streamed in batches, with each extraction column's type fixed over all rows."""
from __future__ import annotations

import csv
import io
import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from runner import export
from runner.cli import cli
from runner.engines.fake import FakeEngine
from runner.run import run_job
from runner.spec import load_job

SCHEMA = {"type": "object", "properties": {"score": {"type": "integer"}, "weight": {"type": "number"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["score", "weight", "tags"]}


def answer(r) -> str:
    i = int(r.row_id[1:])
    # rows 0-9: whole scores; the last row a text score (a schema mismatch, stored as the model said it)
    score = "high" if i == 10 else i
    return json.dumps({"score": score, "weight": i if i % 2 else i + 0.5, "tags": [f"t{i}"]})


@pytest.fixture
def db(make_job):
    job = load_job(make_job(rows=11, schema=SCHEMA))
    run_job(job, engine_factory=lambda j: FakeEngine(SCHEMA, respond=answer))
    return job.database_path


def exported(db, fmt, tmp_path):
    target = tmp_path / f"x.{fmt}"
    out = CliRunner().invoke(cli, ["export", "1", "--db", str(db), "--format", fmt, "-o", str(target)])
    assert out.exit_code == 0, out.output
    if fmt == "parquet":
        return pq.read_table(target)
    if fmt == "csv":
        return list(csv.DictReader(io.StringIO(target.read_text())))
    return [json.loads(line) for line in target.read_text().splitlines()]


@pytest.mark.parametrize("batch_rows", [3, 20_000])
def test_a_column_whose_values_change_kind_in_a_later_batch_is_text_in_every_batch(db, tmp_path, monkeypatch,
                                                                                    batch_rows):
    monkeypatch.setattr(export, "BATCH_ROWS", batch_rows)  # 3: the text score arrives in the last of 4 batches
    table = exported(db, "parquet", tmp_path)
    assert table.num_rows == 11
    assert str(table.schema.field("extraction_score").type) == "string"  # 0-9 and "high": as text
    assert str(table.schema.field("extraction_weight").type) == "double"  # 0.5, 1, 2.5...: numbers
    rows = {r["row_id"]: r for r in table.to_pylist()}
    assert rows["r003"]["extraction_score"] == "3" and rows["r010"]["extraction_score"] == "high"
    assert rows["r002"]["extraction_weight"] == 2.5 and rows["r003"]["extraction_weight"] == 3.0
    assert json.loads(rows["r004"]["extraction_tags_json"]) == ["t4"]
    assert rows["r010"]["status"] == "schema_mismatch" and rows["r010"]["run_id"] == 1


def test_every_format_holds_the_same_rows_whatever_the_batch(db, tmp_path, monkeypatch):
    whole = {fmt: exported(db, fmt, tmp_path) for fmt in ("csv", "jsonl")}
    monkeypatch.setattr(export, "BATCH_ROWS", 2)
    for fmt in ("csv", "jsonl"):
        assert exported(db, fmt, tmp_path) == whole[fmt]  # one header, all 11 rows, in order
    assert [r["row_id"] for r in whole["jsonl"]] == [r["row_id"] for r in whole["csv"]] and len(whole["csv"]) == 11


def test_a_whole_number_past_a_doubles_precision_beside_floats_is_text_and_kept_exact(make_job, tmp_path):
    job = load_job(make_job(rows=2, schema={"type": "object", "properties": {"n": {"type": "number"}}}))
    big = 2**53 + 1
    run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema, respond=lambda r: json.dumps(
        {"n": 0.5 if r.row_id == "r000" else big})))
    rows = {r["row_id"]: r for r in exported(job.database_path, "jsonl", tmp_path)}
    assert rows["r001"]["extraction_n"] == str(big) and rows["r000"]["extraction_n"] == "0.5"


def test_rows_that_change_between_the_two_passes_stop_the_export_and_leave_no_part_file(db, tmp_path, monkeypatch):
    from runner.store import Store

    real = Store.results_of
    calls = []

    def results_of(self, *args, **kwargs):  # a run stores a row of a new kind between the passes
        calls.append(1)
        for r in real(self, *args, **kwargs):
            if len(calls) == 2 and r["row_id"] == "r003":
                r = r | {"extraction_json": json.dumps({"score": 3, "weight": "heavy", "tags": []})}  # weight: numbers
            yield r

    monkeypatch.setattr(Store, "results_of", results_of)
    target = tmp_path / "exports" / "x.csv"
    target.parent.mkdir()
    target.write_text("yesterday's export\n")
    out = CliRunner().invoke(cli, ["export", "1", "--db", str(db), "--format", "csv", "-o", str(target)])
    assert out.exit_code == 6 and out.output.startswith("Error: ") and "changed while they were exported" in out.output
    assert target.read_text() == "yesterday's export\n" and [p.name for p in target.parent.iterdir()] == ["x.csv"]


def test_the_format_comes_from_the_file_name_unless_given_and_never_against_it(db, tmp_path):
    def run(*args):
        return CliRunner().invoke(cli, ["export", "1", "--db", str(db), *args])

    out = run("-o", str(tmp_path / "a.csv"))
    assert out.exit_code == 0 and (tmp_path / "a.csv").read_text().startswith('"row_id",')
    out = run("-o", str(tmp_path / "a.PARQUET"))
    assert out.exit_code == 0 and pq.read_table(tmp_path / "a.PARQUET").num_rows == 11
    out = run("--format", "jsonl", "-o", str(tmp_path / "a.json"))  # a name that says nothing: --format decides
    assert out.exit_code == 0 and len((tmp_path / "a.json").read_text().splitlines()) == 11
    for args, message in ((["--format", "csv", "-o", str(tmp_path / "b.parquet")],
                           "b.parquet: the file's name says parquet, --format says csv"),
                          (["-o", str(tmp_path / "b.txt")], "--format: give parquet, csv or jsonl for "),
                          ([], "--format: give parquet, csv or jsonl for standard output")):
        out = run(*args)
        assert out.exit_code == 2 and out.output.startswith("Error: ") and message in out.output, out.output
    assert not (tmp_path / "b.parquet").exists() and not (tmp_path / "b.txt").exists()


def test_export_and_report_refuse_to_write_over_the_database_they_read(db, tmp_path):
    before = db.read_bytes()
    for args in (["export", "1", "--format", "csv"], ["report", "1"]):
        for target in (db, db.with_name(db.name + "-wal")):
            out = CliRunner().invoke(cli, [*args, "--db", str(db), "-o", str(target)])
            assert out.exit_code == 6 and out.output == f"Error: {target}: is the results database being read: give another file\n"
    link = tmp_path / "db-link.csv"
    link.symlink_to(db)  # through a link too
    out = CliRunner().invoke(cli, ["export", "1", "--db", str(db), "--format", "csv", "-o", str(link)])
    assert out.exit_code == 6 and "is the results database being read" in out.output
    assert db.read_bytes() == before
    # a run's lock (written over, it no longer keeps a second run out) and its engine log
    lock, log = db.with_name(db.name + ".t.lock"), db.with_name(db.name + ".t.log")
    lock.write_text("")
    for args in (["export", "1", "--format", "csv"], ["report", "1"]):
        for target in (lock, log, log.with_name(log.name + ".1")):
            out = CliRunner().invoke(cli, [*args, "--db", str(db), "-o", str(target)])
            assert out.exit_code == 6 and out.output == (f"Error: {target}: is a job's lock or engine log beside the "
                                                         "results database: give another file\n"), out.output
    assert lock.read_text() == "" and not log.exists()
    out = CliRunner().invoke(cli, ["export", "1", "--db", str(db), "--format", "csv", "-o", str(db) + ".t.csv"])
    assert out.exit_code == 0, out.output  # only those two names are the database's
    for args in (["export", "1", "--format", "csv"], ["report", "1"]):  # -o '' read as the current folder
        out = CliRunner().invoke(cli, [*args, "--db", str(db), "-o", ""])
        assert out.exit_code == 6 and out.output == "Error: -o: the name is empty: give a file name\n", out.output


def test_a_report_named_as_results_data_is_refused(db, tmp_path):
    """`report -o x.parquet` meant `export`: HTML under a data file's name is refused, nothing written."""
    for name in ("x.parquet", "x.CSV", "x.jsonl"):
        out = CliRunner().invoke(cli, ["report", "1", "--db", str(db), "-o", str(tmp_path / name)])
        assert out.exit_code == 6 and out.output == (
            f"Error: {tmp_path / name}: a report is HTML: name the file .html (runner export writes results as "
            "Parquet, CSV or JSON Lines)\n"), out.output
        assert not (tmp_path / name).exists()
    assert CliRunner().invoke(cli, ["report", "1", "--db", str(db), "-o", str(tmp_path / "r.htm")]).exit_code == 0


def test_an_export_through_a_link_replaces_its_target_and_keeps_the_link(db, tmp_path):
    (tmp_path / "shared").mkdir()
    real = tmp_path / "shared" / "latest.csv"
    real.write_text("old\n")
    link = tmp_path / "latest.csv"
    link.symlink_to(real)
    out = CliRunner().invoke(cli, ["export", "1", "--db", str(db), "-o", str(link)])
    assert out.exit_code == 0, out.output
    assert link.is_symlink() and len(list(csv.DictReader(io.StringIO(real.read_text())))) == 11
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["latest.csv"]  # no part file left


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_an_export_into_a_named_pipe_reaches_its_reader(db, tmp_path, fmt):
    """A pipe (or /dev/stdout, or a process substitution) is written into, not replaced by a file."""
    import os
    import stat
    import threading

    pipe = tmp_path / f"rows.{fmt}"
    os.mkfifo(pipe)
    got = []
    reader = threading.Thread(target=lambda: got.append(pipe.read_bytes()))
    reader.start()
    out = CliRunner().invoke(cli, ["export", "1", "--db", str(db), "-o", str(pipe)])
    reader.join(10)
    assert out.exit_code == 0, out.output
    assert stat.S_ISFIFO(os.stat(pipe).st_mode)
    if fmt == "csv":
        assert len(list(csv.DictReader(io.StringIO(got[0].decode())))) == 11
    else:
        assert pq.read_table(io.BytesIO(got[0])).num_rows == 11


def test_a_whole_job_export_has_a_column_for_every_version_of_the_schema_that_made_its_rows(make_job, tmp_path):
    """Rows made by an older schema with a field the latest lacks keep it as a column, not only in
    extraction_json: the columns do not depend on which version ran last."""
    v2 = {"type": "object", "properties": {"score": {"type": "integer"}, "priority": {"type": "integer"},
                                           "notes": {"type": "object"}},
          "required": ["score", "priority", "notes"]}
    (tmp_path / "v2.json").write_text(json.dumps(v2))
    job = make_job(rows=5, schema=SCHEMA)
    run = lambda *a: CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", *a, str(job)])  # noqa: E731
    assert run().exit_code == 0
    assert run("--limit", "3", "--set", f"output_schema={tmp_path / 'v2.json'}").exit_code == 0
    assert run("--limit", "2").exit_code == 0  # the latest run: the first schema again
    target = tmp_path / "all.csv"
    out = CliRunner().invoke(cli, ["export", "--job", str(job), "-o", str(target)])
    assert out.exit_code == 0, out.output
    rows = {r["row_id"]: r for r in csv.DictReader(io.StringIO(target.read_text()))}
    assert {"extraction_score", "extraction_priority", "extraction_notes_json", "extraction_tags_json"} <= set(rows["r000"])
    assert rows["r002"]["extraction_priority"] == "1" and rows["r002"]["extraction_notes_json"] == "{}"
    assert rows["r000"]["extraction_priority"] == "" and rows["r004"]["extraction_tags_json"] != ""


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl"])
def test_fields_whose_columns_would_share_a_name_each_get_their_own(make_job, tmp_path, fmt):
    """A field called `json` (extraction_json is the result's own column), or `tags_json` beside an
    array `tags`, stopped every export with a KeyError traceback. A schema with properties but no
    "type": "object" had no field columns at all."""
    schema = {"properties": {"json": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                             "tags_json": {"type": "string"}}, "required": ["json", "tags", "tags_json"]}
    job = load_job(make_job(rows=2, schema=schema))
    run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema, respond=lambda r: json.dumps(
        {"json": f"j-{r.row_id}", "tags": ["a", "b"], "tags_json": "x"})))
    got = exported(job.database_path, fmt, tmp_path)
    rows = got.to_pylist() if fmt == "parquet" else got
    r = {row["row_id"]: row for row in rows}["r001"]
    assert json.loads(r["extraction_json"]) == {"json": "j-r001", "tags": ["a", "b"], "tags_json": "x"}
    assert r["extraction_json_2"] == "j-r001" and r["extraction_tags_json_2"] == "x"
    assert json.loads(r["extraction_tags_json"]) == ["a", "b"]


def test_an_export_that_cannot_be_written_names_the_file_asked_for_and_why(db, tmp_path):
    """A file in the path's way said "File exists"; Arrow's errors named the export's hidden part
    file (.x.parquet.part) instead of the file asked for."""
    (tmp_path / "job.yaml").write_text("name: t\n")
    out = CliRunner().invoke(cli, ["export", "1", "--db", str(db), "-o", str(tmp_path / "job.yaml" / "x.csv")])
    assert out.exit_code == 6 and out.stderr == (f"Error: {tmp_path / 'job.yaml' / 'x.csv'}: cannot write: "
                                                 f"{tmp_path / 'job.yaml'} is a file, not a folder\n"), out.output
    out = CliRunner().invoke(cli, ["export", "1", "--db", str(db), "-o", "/proc/x.parquet"])  # no file can be made there
    assert out.exit_code == 6 and out.stderr.startswith("Error: /proc/x.parquet: cannot write: ") and ".part" not in out.stderr


def test_a_folder_as_the_output_is_one_error_line_and_the_format_is_read_in_any_case(make_job, tmp_path):
    from click.testing import CliRunner

    from runner.cli import cli

    job = make_job(rows=2)
    invoke = lambda *a: CliRunner().invoke(cli, [str(x) for x in a])  # noqa: E731
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    (tmp_path / "folder").mkdir()
    for args in (("export", "--job", job, "--format", "csv", "-o", tmp_path / "folder"),
                 ("export", "--job", job, "-o", tmp_path / "folder"),  # was "--format: give parquet...", exit 2
                 ("report", "1", "--job", job, "-o", tmp_path / "folder")):
        out = invoke(*args)
        assert out.exit_code == 6 and out.output == f"Error: {tmp_path / 'folder'}: is a folder: give a file name\n", (args, out.output)
    for args in (("export", "--job", job, "--format", "csv", "-o", f"{tmp_path}/newdir/"),
                 ("report", "1", "--job", job, "-o", f"{tmp_path}/newdir/")):  # a folder not made yet
        out = invoke(*args)
        assert out.exit_code == 6 and out.output == f"Error: {tmp_path}/newdir/: names a folder: give a file name\n", \
            (args, out.output)
        assert not (tmp_path / "newdir").exists()
    out = invoke("export", "--job", job, "--format", "CSV")
    assert out.exit_code == 0 and out.stdout.startswith('"row_id",'), out.output
    out = invoke("stats", "--job", job, "--set", "name=other")  # a misspelt name: said as such
    assert out.exit_code == 7 and out.output.strip().endswith("no runs of other"), out.output


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_an_export_over_a_private_file_keeps_it_private(db, tmp_path, fmt):
    """The new file was renamed over the old one with the umask's mode: a 0600 export became
    world-readable every night."""
    import os
    import stat

    target = tmp_path / f"private.{fmt}"
    target.write_text("old")
    target.chmod(0o600)
    out = CliRunner().invoke(cli, ["export", "1", "--db", str(db), "-o", str(target)])
    assert out.exit_code == 0, out.output
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600 and target.read_bytes() != b"old"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []


def test_a_prune_during_an_export_does_not_call_the_rows_written_missing(db, tmp_path, monkeypatch):
    """The note counted the run's rows again after the export's snapshot: a prune in between made
    a complete export say that every row was gone."""
    import sqlite3

    real = export.export_run

    def export_then_prune(store, *args, **kw):
        n = real(store, *args, **kw)
        con = sqlite3.connect(db)
        with con:  # the run's rows, replaced and deleted once the export had read them
            con.execute("DELETE FROM results WHERE run_id = 1")
        con.close()
        return n

    monkeypatch.setattr(export, "export_run", export_then_prune)
    out = CliRunner().invoke(cli, ["export", "1", "--db", str(db), "-o", str(tmp_path / "all.jsonl")])
    assert out.exit_code == 0 and "Note:" not in out.output, out.output
    assert len((tmp_path / "all.jsonl").read_text().splitlines()) > 0


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl"])
def test_every_value_of_a_json_column_reads_back_as_json(make_job, tmp_path, fmt):
    """A string where the schema has an array (a schema_mismatch row, or a field of several types)
    was written as it was: 'fake r2' in extraction_tags_json, which json.loads refuses, and the
    string '["x"]' exported as the array ["x"] did."""
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                               "either": {"type": ["string", "array"]}}, "required": ["tags", "either"]}
    job = load_job(make_job(rows=3, schema=schema))
    answers = {"r000": {"tags": ["x"], "either": '["x"]'}, "r001": {"tags": "fake r1", "either": ["x"]},
               "r002": {"tags": '["x"]', "either": "plain"}}
    run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema, respond=lambda r: json.dumps(answers[r.row_id])))
    got = exported(job.database_path, fmt, tmp_path)
    rows = {r["row_id"]: r for r in (got.to_pylist() if fmt == "parquet" else got)}
    for rid, want in answers.items():
        assert json.loads(rows[rid]["extraction_tags_json"]) == want["tags"]
        assert json.loads(rows[rid]["extraction_either_json"]) == want["either"]


def test_an_export_or_report_over_one_of_the_jobs_own_files_is_refused(make_job, tmp_path):
    """`-o job.yaml` or `-o data/docs.parquet` replaced the job file or its input, exit 0."""
    job = make_job(rows=3)
    assert CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", str(job)]).exit_code == 0
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".yaml", ".json", ".parquet")}
    cases = [(job, "the job file"), (tmp_path / "data" / "docs.parquet", "one of the job's input files"),
             (tmp_path / "schemas" / "out.json", "the job's output_schema"),
             (tmp_path / "configs" / "engine.yaml", "the job's engine.config")]
    for target, what in cases:
        fmt = [] if target.suffix == ".parquet" else ["--format", "csv"]
        for args in (["export", "--job", str(job), *fmt], ["report", "1", "--job", str(job)]):
            out = CliRunner().invoke(cli, [*args, "-o", str(target)])
            if args[0] == "report" and target.suffix in (".parquet", ".json"):
                continue  # refused already as a data file's name
            assert out.exit_code == 6 and out.output == f"Error: {target}: is {what}: give another file\n", (args, out.output)
    assert all(p.read_bytes() == data for p, data in before.items())
    # a file the job's input folder or glob would read next time: the next run would take it as input
    (tmp_path / "template.jinja").write_text("{{ messages }}")
    for setting, target in (("input.path=data", tmp_path / "data" / "results.parquet"),
                            ("input.path=data/*.parquet", tmp_path / "data" / "new.parquet"),
                            ("prompts.chat_template=template.jinja", tmp_path / "template.jinja")):
        out = CliRunner().invoke(cli, ["export", "--job", str(job), "--set", setting, "--format", "parquet",
                                       "-o", str(target)])
        assert out.exit_code == 6 and "give another file" in out.output, (setting, out.output)
    assert not (tmp_path / "data" / "results.parquet").exists()
    out = CliRunner().invoke(cli, ["export", "--job", str(job), "--set", "input.path=data", "-o", str(tmp_path / "data" / "x.csv.txt"),
                                   "--format", "csv"])  # a name the input does not read is fine
    assert out.exit_code == 0, out.output


def test_a_compressed_name_is_refused_rather_than_written_uncompressed(db, tmp_path):
    out = CliRunner().invoke(cli, ["export", "1", "--db", str(db), "--format", "csv", "-o", str(tmp_path / "x.csv.gz")])
    assert out.exit_code == 2 and "x.csv.gz: exports are not compressed: name the file x.csv" in out.output
    assert not (tmp_path / "x.csv.gz").exists()


def test_fields_by_local_ref_and_const_are_plain_columns_and_a_boolean_subschema_is_json(make_job, tmp_path):
    """A scalar field given through `#/$defs/...` or `const` gets a plain column, as one typed in
    place does; a field whose schema is `true` (any value) is a JSON column. `true` made the export
    stop with a traceback."""
    schema = {"type": "object", "$defs": {"lvl": {"type": "string", "enum": ["low", "high"]}, "n": {"$ref": "#/$defs/m"},
                                          "m": {"type": "integer"}},
              "properties": {"level": {"$ref": "#/$defs/lvl"}, "count": {"$ref": "#/$defs/n"}, "kind": {"const": "x"},
                             "anything": True},
              "required": ["level", "count", "kind", "anything"]}
    job = load_job(make_job(rows=2, schema=schema))
    run_job(job, engine_factory=lambda j: FakeEngine(schema, respond=lambda r: json.dumps(
        {"level": "high", "count": 3, "kind": "x", "anything": {"a": [1]}})))
    row = exported(job.database_path, "jsonl", tmp_path)[0]
    assert (row["extraction_level"], row["extraction_count"], row["extraction_kind"]) == ("high", 3, "x")
    assert json.loads(row["extraction_anything_json"]) == {"a": [1]}


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl"])
def test_extraction_columns_come_in_the_schema_s_own_order(make_job, tmp_path, fmt):
    """The stored run kept its schema with sorted keys, so the columns came out alphabetically, not
    as the schema file lists its fields."""
    schema = {"type": "object", "properties": {"zone": {"type": "string"}, "amount": {"type": "number"},
                                               "items": {"type": "array"}, "code": {"type": "string"}},
              "required": ["zone", "amount", "items", "code"]}
    job = load_job(make_job(rows=2, schema=schema))
    run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema, respond=lambda r: json.dumps(
        {"zone": "z", "amount": 1.5, "items": [], "code": r.row_id})))
    got = exported(job.database_path, fmt, tmp_path)
    names = got.column_names if fmt == "parquet" else list(got[0])
    fields = [n for n in names if n.startswith("extraction_") and n != "extraction_json"]
    assert fields == ["extraction_zone", "extraction_amount", "extraction_items_json", "extraction_code"]


@pytest.mark.parametrize("schema", [
    {"$ref": "#/$defs/Doc", "$defs": {"Doc": {"type": "object", "properties": {
        "zz": {"type": "string"}, "mm": {"$ref": "#/$defs/Count"}, "aa": {"type": "array"}},
        "required": ["zz", "mm", "aa"]}, "Count": {"type": "integer"}}},
    {"type": ["object"], "properties": {"zz": {"type": "string"}, "mm": {"type": "integer"}, "aa": {"type": "array"}},
     "required": ["zz", "mm", "aa"]},
], ids=["root-ref", "type-list"])
def test_a_schema_whose_root_is_a_ref_or_a_type_list_still_gets_its_field_columns(make_job, tmp_path, schema):
    """Schema generators write the root as a `$ref` into `$defs`: the run accepted it, and the export
    had no extraction_FIELD column at all (nor for `"type": ["object"]`)."""
    job = load_job(make_job(rows=2, schema=schema))
    run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema, respond=lambda r: json.dumps(
        {"zz": r.row_id, "mm": 3, "aa": [1]})))
    rows = exported(job.database_path, "parquet", tmp_path).to_pylist()
    assert [(r["extraction_zz"], r["extraction_mm"], r["extraction_aa_json"]) for r in rows] == \
        [("r000", 3, "[1]"), ("r001", 3, "[1]")]


def test_with_db_the_job_file_the_run_started_from_is_guarded_too(make_job, tmp_path):
    """`export 1 --db results.sqlite -o data/docs.parquet` replaced the job's input: only --job guarded."""
    job = make_job(rows=3)
    assert CliRunner().invoke(cli, ["run", "--engine", "fake", "--quiet", str(job)]).exit_code == 0
    db = tmp_path / "out" / "results.sqlite"
    before = {p: p.read_bytes() for p in (job, tmp_path / "data" / "docs.parquet")}
    for args, target, what in ((["export", "1", "--format", "parquet"], tmp_path / "data" / "docs.parquet",
                                "one of the job's input files"),
                               (["report", "1"], job, "the job file")):
        out = CliRunner().invoke(cli, [*args, "--db", str(db), "-o", str(target)])
        assert out.exit_code == 6 and out.output == f"Error: {target}: is {what}: give another file\n", out.output
    assert all(p.read_bytes() == data for p, data in before.items())
    job.rename(tmp_path / "gone.yaml")  # the job file is no longer there: nothing to go by, the export is written
    out = CliRunner().invoke(cli, ["export", "1", "--db", str(db), "-o", str(tmp_path / "data" / "docs.parquet")])
    assert out.exit_code == 0, out.output


def test_a_root_with_properties_of_its_own_beside_a_ref_keeps_them():
    """Following a root `$ref` replaced the root: its own properties lost their columns."""
    schema = {"type": "object", "$ref": "#/$defs/Base", "properties": {"a": {"type": "string"}, "n": {"type": "array"}},
              "$defs": {"Base": {"type": "object", "properties": {"id": {"type": "string"}}}}}
    assert export.flat_fields(schema) == {"a": True, "n": False}
