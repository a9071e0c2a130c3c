"""Real-world input and job mistakes through the command line: CSV as spreadsheets write it, OpenAI
batch files as clients write them, a system template a row cannot fill, a broken chat template,
`--set` values with colons, and results written where they cannot be."""
from __future__ import annotations

import json
import sqlite3
import subprocess

import pyarrow as pa
import pytest
import pyarrow.parquet as pq
from click.testing import CliRunner

from runner.cli import cli
from tests.test_crash_safety import runner_cmd


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_csv_keeps_ids_as_written_text_across_lines_and_empty_cells_as_missing(make_job, tmp_path):
    (tmp_path / "docs.csv").write_text('id,text,system_prompt\n007,"first line\nsecond line",S\n'
                                       '8,"plain, with a comma",S\n9,,S\n')
    job = make_job()
    refused = invoke("run", "--engine", "fake", "--set", "input.path=docs.csv", job)
    assert refused.exit_code == 3 and "is null in 1 row, first at id '9'" in refused.output, refused.output
    out = invoke("run", "--engine", "fake", "--quiet", "--set", "input.path=docs.csv", "--set", "input.on_bad_row=store", job)
    assert out.exit_code == 0, out.output
    rows = dict(sqlite3.connect(tmp_path / "out" / "results.sqlite").execute("SELECT row_id, status FROM results"))
    assert rows == {"007": "ok", "8": "ok", "9": "failed"}
    # only an empty cell is missing: NA (Namibia), null and N/A are what the spreadsheet says
    (tmp_path / "na.csv").write_text("id,text,system_prompt\nNA,null,S\nUS,N/A,S\n")
    out = invoke("run", "--engine", "fake", "--quiet", "--set", "input.path=na.csv", "--set", "output.database=na.sqlite", job)
    assert out.exit_code == 0, out.output
    assert dict(sqlite3.connect(tmp_path / "na.sqlite").execute("SELECT row_id, status FROM results")) == {
        "NA": "ok", "US": "ok"}


def test_an_empty_csv_file_in_a_folder_holds_no_rows_as_an_empty_jsonl_file_does(make_job, tmp_path):
    """A 0-byte CSV beside others (an export that found nothing today) was "corrupt or unreadable"
    and stopped the whole job, as one with only a byte-order mark or a line end, or compressed, still
    was (or more than 4 KiB of line ends); a folder of nothing but empty files still has no rows."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.csv").write_text("id,text,system_prompt\n1,a,S\n")
    (folder / "b.csv").write_text("")
    (folder / "c.jsonl").write_text("")
    (folder / "d.csv").write_bytes(b"\xef\xbb\xbf\r\n")  # a byte-order mark and a line end: nothing else
    import gzip
    (folder / "e.csv.gz").write_bytes(gzip.compress(b"\n"))
    (folder / "f.csv.gz").write_bytes(gzip.compress(b""))
    (folder / "g.csv").write_bytes(b"\r\n" * 70_000)  # more line ends than one read holds
    (folder / "h.csv.gz").write_bytes(gzip.compress(b"\xef\xbb\xbf" + b"\n" * 140_000))
    job = make_job()
    out = invoke("run", "--engine", "fake", "--quiet", "--set", "input.path=in", job)
    assert out.exit_code == 0, out.output
    assert dict(sqlite3.connect(tmp_path / "out" / "results.sqlite").execute("SELECT row_id, status FROM results")) == {"1": "ok"}
    (folder / "a.csv").write_text("")
    out = invoke("validate", "--set", "input.path=in", job)
    assert out.exit_code == 3 and "the input has no rows" in out.output, out.output


def test_a_csv_row_longer_than_pyarrows_blocks_is_read(make_job, tmp_path):
    """A 2.25 MB cell was refused as "corrupt or unreadable csv data" (a straddling object)."""
    (tmp_path / "docs.csv").write_text('id,text,system_prompt\n1,a,S\n2,"' + "word " * 450_000 + '",S\n3,c,S\n')
    out = invoke("run", "--engine", "fake", "--quiet", make_job(job={"input": {"path": "docs.csv", "on_too_long": "truncate"}}))
    assert out.exit_code == 0, out.output
    rows = dict(sqlite3.connect(tmp_path / "out" / "results.sqlite").execute("SELECT row_id, status FROM results"))
    assert rows == {"1": "ok", "2": "ok", "3": "ok"}
    # a header longer than a block left pyarrow's first block empty: "Empty CSV file or block"
    (tmp_path / "wide.csv").write_text("id,text,system_prompt," + "h" * 1_500_000 + "\n4,d,S,x\n")
    out = invoke("run", "--engine", "fake", "--quiet", "--set", "input.path=wide.csv", "--set", "output.database=w.sqlite",
                 make_job(job={"input": {"path": "docs.csv", "on_too_long": "truncate"}}))
    assert out.exit_code == 0, out.output


def test_a_csv_row_that_does_not_fit_the_header_or_utf8_is_named_by_its_row(make_job, tmp_path):
    """pyarrow's own text wrapped the reason in "Error creating dataset ... Is this a 'csv' file?"."""
    (tmp_path / "fields.csv").write_text('id,text,system_prompt\n1,"two\nlines",S\n2,b\n')
    (tmp_path / "latin1.csv").write_bytes("id,text,system_prompt\n1,a,S\n2,café,S\n".encode("latin-1"))
    job = make_job()
    out = invoke("validate", "--set", "input.path=fields.csv", job)
    assert out.exit_code == 3 and out.output == (f"Error: {tmp_path / 'fields.csv'}: row 3 has 2 fields where the "
                                                 "header has 3 (the header is row 1): '2,b'\n"), out.output
    out = invoke("run", "--engine", "fake", "--set", "input.path=latin1.csv", job)
    assert out.exit_code == 3 and out.output == (f"Error: {tmp_path / 'latin1.csv'}: row 3, field 2, holds bytes that "
                                                 "are not UTF-8 text (the header is row 1; save the file as UTF-8)\n")
    assert not (tmp_path / "out" / "results.sqlite").exists()


def test_a_csv_cut_off_inside_a_quoted_field_is_refused_before_anything_is_stored(make_job, tmp_path):
    """pyarrow reads a quote left open at the end of the file as closed there: the last row would be
    stored ok with its text cut short. A quote inside an unquoted cell (5" screen) is text, and so is
    one after a closing quote ("Model "X" review"); neither hides a cut, whatever the count of quotes."""
    # the text last: the cut row still has every column, which pyarrow would otherwise count
    header, tail = "id,system_prompt,text\n", '2,S,"first line\nsecond line"\n'
    firsts = ['1,S,"a 5"" screen"\n', '1,S,a 5" screen\n', '1,S,"Model "X" review"\n']
    job = make_job(job={"input": {"path": "docs.csv"}})
    for first in firsts:
        whole = header + first + tail
        (tmp_path / "docs.csv").write_text(whole)
        assert invoke("validate", job).exit_code == 0
        (tmp_path / "docs.csv").write_text(whole[:whole.index("second line")])  # a copy stopped inside row 2
        for args in (("validate", job), ("run", "--engine", "fake", "--quiet", job), ("run", "--engine", "fake", "--quiet",
                                                                                       "--limit", "5", job)):
            out = invoke(*args)
            assert out.exit_code == 3, (first, args, out.output)
            assert out.output.strip() == (f"Error: {tmp_path / 'docs.csv'}: the file ends inside a quoted field opened "
                                          "in the row on line 3: it was cut off, or its quoting is broken")
        assert not (tmp_path / "out" / "results.sqlite").exists()
    (tmp_path / "docs.csv").write_text(header + "".join(firsts[1:]).replace("1,", "3,", 1).replace("1,", "4,") + tail)
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    texts = dict(sqlite3.connect(tmp_path / "out" / "results.sqlite").execute("SELECT row_id, status FROM results"))
    assert texts == {"2": "ok", "3": "ok", "4": "ok"}


def test_openai_batch_files_as_clients_write_them(make_job, tmp_path):
    lines = [{"custom_id": 5, "body": {"messages": [{"role": "user", "content": ["part one, ", {"type": "text", "text": "two"}]}]}},
             {"custom_id": "b", "body": {"messages": [{"role": "system", "content": "S"}, {"role": "assistant", "content": None},
                                                      {"role": "user", "content": "hello"}]}}]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = ["--set", "input.path=batch.jsonl", "--set", "input.format=openai-batch", "--set", "input.id_column=custom_id",
            "--set", "input.text_column=user", "--set", "input.system_prompt_column=system"]
    job = make_job()
    out = invoke("run", "--engine", "fake", "--quiet", *args, job)
    assert out.exit_code == 0, out.output
    assert dict(sqlite3.connect(tmp_path / "out" / "results.sqlite").execute("SELECT row_id, status FROM results")) == {
        "5": "ok", "b": "ok"}
    # a BOM before the first line; OpenAI's newer "developer" role holds the instructions
    dev = {"custom_id": "d", "body": {"messages": [{"role": "developer", "content": "D"}, {"role": "user", "content": "u"}]}}
    (tmp_path / "dev.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(dev).encode() + b"\n")
    from runner.openai_batch import batches

    assert [b.to_pylist() for b in batches(str(tmp_path / "dev.jsonl"), 10)] == [
        [{"custom_id": "d", "system": "D", "user": "u"}]]
    # content parts, each on a line of its own, as vLLM's chat parsing joins them ("Sys parts" before)
    assert [b.to_pylist() for b in batches(str(tmp_path / "batch.jsonl"), 10)][0][0]["user"] == "part one, \ntwo"
    (tmp_path / "batch.jsonl").write_bytes(b'{"custom_id": "x", "body": {"messages": []}}\n{"custom_id": "\xff"}\n')
    bad = invoke("validate", *args, job)
    assert bad.exit_code == 3 and "batch.jsonl: line 2: not UTF-8 text" in bad.output and bad.output.count("\n") == 1


def test_a_row_the_system_template_cannot_fill_fails_alone(make_job, tmp_path):
    docs = tmp_path / "data" / "n.parquet"
    docs.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": ["x", "y", "z"], "n": [1.5, None, 2.0]}), docs)
    job = make_job(docs=docs, job={"input": {"system_prompt_column": None, "extra_columns": ["n"]},
                                   "prompts": {"system_template": "Record {n:.1f}"}})
    plan = invoke("plan", job)  # under on_bad_row: fail (the default), not credited to `store`
    assert plan.exit_code == 0 and "1 row with values prompts.system_template cannot take (a run stores" in plan.output
    assert "on_bad_row" not in plan.output
    out = invoke("run", "--engine", "fake", job)
    assert out.exit_code == 0, out.output
    rows = dict(sqlite3.connect(tmp_path / "out" / "results.sqlite").execute("SELECT row_id, status || ' ' || coalesce(error, '') FROM results"))
    assert rows["a"] == "ok " and rows["c"] == "ok " and rows["b"].startswith("failed prompt could not be built from prompts.system_template")


def test_validate_says_when_the_first_row_does_not_fit_the_user_template(make_job, tmp_path):
    """validate said only "OK" for {text:zz}, a format spec no row fits; the night's run then stored
    every row failed. It says so (a row that does not fit is still the row's failure, not the job's)."""
    job = make_job(rows=3)
    out = CliRunner().invoke(cli, ["validate", "--set", "prompts.user_template='{text:zz}'", str(job)])
    assert out.exit_code == 0 and out.stdout.startswith("OK: "), out.output
    assert out.stderr.startswith("Note: the first row (id 'r000') does not fit prompts.user_template (ValueError: "), out.stderr
    out = CliRunner().invoke(cli, ["validate", str(job)])
    assert out.exit_code == 0 and out.stderr == ""


def test_validate_renders_a_prompt_so_a_broken_chat_template_is_found_before_the_night(make_job, tmp_path):
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m['content'] }{% endfor %}")
    job = make_job()
    for command in (["validate"], ["run", "--engine", "fake"]):  # cron may run `run` alone: it stops too
        result = invoke(*command, "--set", "prompts.chat_template=broken.jinja", job)
        assert result.exit_code == 2 and result.output == (
            f"Error: {job}: prompts.chat_template (broken.jinja): line 1: TemplateSyntaxError: unexpected '}}'\n")
    assert not (tmp_path / "out" / "results.sqlite").exists()  # no run recorded, no row stored failed
    result = invoke("validate", "--set", "prompts.chat_template_kwargs.add_generation_prompt=false", make_job())
    assert result.exit_code == 2 and "prompts.chat_template_kwargs.add_generation_prompt: set by the runner" in result.output


def test_a_chat_template_that_refuses_the_first_row_stops_validate_plan_and_run_alike(make_job, tmp_path):
    """validate and plan refused it; run went ahead and stored every row failed."""
    (tmp_path / "raises.jinja").write_text("{% if messages[0].role != 'user' %}{{ raise_exception('first must be "
                                           "user') }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    job = make_job()
    said = set()
    for command in (["validate"], ["plan"], ["run", "--engine", "fake"]):
        result = invoke(*command, "--set", "prompts.chat_template=raises.jinja", job)
        assert result.exit_code == 2, result.output
        said.add(result.output)
    assert said == {f"Error: {job}: prompts.chat_template (raises.jinja): refuses the first row's prompt (id 'r000'): "
                    "first must be user\n"}
    assert not (tmp_path / "out" / "results.sqlite").exists()


def test_a_chat_template_that_refuses_the_first_rows_group_fails_those_rows_only(make_job, tmp_path):
    """A template that refuses some content (one group's system prompt) refuses rows, not the job: a
    first row it refuses must not stop every night's run (it is stored failed, and resume skips it)."""
    (tmp_path / "word.jinja").write_text("{% for m in messages %}{% if 'customer reviews' in m.content %}{{ "
                                         "raise_exception('not reviews') }}{% endif %}{{ m.content }}{% endfor %}")
    job = make_job()
    out = invoke("validate", "--set", "prompts.chat_template=word.jinja", job)
    assert out.exit_code == 0 and ("Note: the chat template refuses the first row's prompt (id 'r000': not reviews), "
                                   "but not others: a run stores each row it refuses failed") in out.output, out.output
    for _ in range(2):  # the second run: r000 is stored, and the check lets it be
        out = invoke("run", "--engine", "fake", "--quiet", "--set", "prompts.chat_template=word.jinja", job)
        assert out.exit_code == 0, out.output
    rows = dict(sqlite3.connect(tmp_path / "out" / "results.sqlite").execute("SELECT row_id, status FROM results"))
    assert [r for r, v in sorted(rows.items()) if v == "failed"] == ["r000", "r001", "r002", "r006", "r007", "r008"]
    assert sum(v == "ok" for v in rows.values()) == 6  # the other system prompt's rows


def test_mistakes_in_settings_and_columns_are_named(make_job, tmp_path):
    job = make_job()
    out = invoke("validate", "--set", "input.system_prompt_column=sys", job)
    assert out.exit_code == 3 and "column 'sys' (input.system_prompt_column) not found" in out.output
    out = invoke("validate", "--set", "sampling.extra_args.n=3", job)
    assert out.exit_code == 2 and "sampling.extra_args: Value error, n: use sampling.n" in out.output
    out = invoke("validate", "--set", "sampling.extra_args.output_kind=1", job)
    assert out.exit_code == 2 and "output_kind: set by the runner" in out.output
    assert invoke("run", "--engine", "fake", "--quiet", "--set", "prompts.user_template=Title: {text}", job).exit_code == 0
    config = json.loads(sqlite3.connect(tmp_path / "out" / "results.sqlite").execute("SELECT config_json FROM runs").fetchone()[0])
    assert config["job"]["prompts"]["user_template"] == "Title: {text}"  # text with a colon stays text


def test_results_written_where_they_cannot_be_are_one_error_line(make_job, tmp_path):
    job = make_job()
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    out = invoke("report", "1", "--job", job, "-o", tmp_path / "new" / "folder" / "r.html")
    assert out.exit_code == 0 and (tmp_path / "new" / "folder" / "r.html").is_file()
    (tmp_path / "file").write_text("")
    for command in (["export", "--job", job, "--format", "jsonl", "-o", tmp_path / "file" / "x.jsonl"],
                    ["report", "1", "--job", job, "-o", tmp_path / "file" / "r.html"]):
        out = invoke(*command)  # the same place, the same exit code, whichever command writes there
        assert out.exit_code == 6 and out.output.startswith("Error: ") and out.output.count("\n") == 1, out.output
        assert f"{tmp_path / 'file'}/" in out.output and "cannot write" in out.output

def test_an_export_or_report_is_written_whole_or_not_at_all(make_job, tmp_path, monkeypatch):
    """Written beside the target and renamed over it: when the last step fails (a full disk, here
    a refused rename), the file from the night before is intact and no partial file stays."""
    import os

    job = make_job()
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    (tmp_path / "last.csv").write_text("yesterday")
    (tmp_path / "last.html").write_text("yesterday")

    def refused(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refused)
    for command in (["export", "--job", job, "--format", "csv", "-o", tmp_path / "last.csv"],
                    ["report", "1", "--job", job, "-o", tmp_path / "last.html"]):
        out = invoke(*command)
        assert out.exit_code == 6 and "No space left on device" in out.output, out.output
    assert (tmp_path / "last.csv").read_text() == (tmp_path / "last.html").read_text() == "yesterday"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []
    monkeypatch.undo()
    assert invoke("export", "--job", job, "--format", "csv", "-o", tmp_path / "last.csv").exit_code == 0
    assert (tmp_path / "last.csv").read_text().startswith('"row_id",')


def test_rejected_rows_are_counted_kept_once_and_never_reach_verify(make_job, tmp_path):
    docs = tmp_path / "data" / "d.parquet"
    docs.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ["a", None, "a", "b"], "text": ["x", "y", "z", "w"], "system_prompt": ["S"] * 4}), docs)
    job = make_job(docs=docs, job={"input": {"on_bad_row": "store"}})
    for _ in range(2):
        out = invoke("run", "--engine", "fake", job)
        assert out.exit_code == 0 and "2 left out (see rejected_rows)" in out.output, out.output
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT count(*) FROM rejected_rows").fetchone()[0] == 2  # the latest run's list, not one per run
    out = invoke("verify", "--engine", "fake", job)
    assert out.exit_code == 0 and "2 rows unchanged" in out.output, out.output


def test_a_broken_json_lines_file_is_named_by_its_line(make_job, tmp_path):
    lines = [json.dumps({"id": f"r{i}", "text": "t", "system_prompt": "s"}) for i in range(3000)]
    lines[2500] = '{"id": "bad", '
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    out = invoke("validate", "--set", "input.path=docs.jsonl", make_job())
    assert out.exit_code == 3 and "docs.jsonl: line 2501: not valid JSON" in out.output, out.output


def test_json_lines_whose_column_is_null_for_a_first_block_and_text_later_run(make_job, tmp_path):
    """pyarrow infers a JSON file's types from its first block: a title null on the first 20,000
    lines, or a field the job does not read changing type, must not stop the run."""
    lines = [{"id": f"r{i}", "text": "t", "system_prompt": "s", "title": None, "other": i} for i in range(20_000)]
    lines[-1].update(title="T", other="text now")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = make_job(job={"input": {"path": "docs.jsonl", "extra_columns": ["title"]}})
    out = invoke("run", "--engine", "fake", "--quiet", job)
    assert out.exit_code == 0, out.output
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT count(*), sum(status = 'ok') FROM results").fetchone() == (20_000, 20_000)


def test_json_lines_ids_of_numbers_and_text_run_as_text(make_job, tmp_path, monkeypatch):
    """pyarrow types a JSON column from its first values and refused ids 7 and "r8" in one file as
    corrupt data; the job's columns are then read as text. A change past pyarrow's first blocks
    (row 40,000) goes on after the rows pyarrow already gave: none twice, none lost."""
    from runner import json_lines

    skipped = []
    text_batches = json_lines.text_batches
    monkeypatch.setattr(json_lines, "text_batches",
                        lambda f, c, skip, *a, **k: skipped.append(skip) or text_batches(f, c, skip, *a, **k))
    for first_change in (1, 40_000):
        lines = [{"id": f"r{i}", "text": "t", "system_prompt": "s", "title": "x"} for i in range(40_010)]
        for i in range(first_change, len(lines), 2):
            lines[i].update(id=i, title=i * 1.5)
        if first_change == 1:
            lines[5].update(title={"a": [1]})
        folder = tmp_path / str(first_change)
        folder.mkdir()
        (folder / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + "\n\n")
        job = make_job(job={"input": {"path": f"{first_change}/docs.jsonl", "extra_columns": ["title"]},
                            "prompts": {"user_template": "{title}: {text}"}})
        out = invoke("run", "--engine", "fake", "--quiet", job)
        assert out.exit_code == 0, out.output
        con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
        ids = [r[0] for r in con.execute("SELECT row_id FROM results WHERE job_name = 't'")]
        assert sorted(ids) == sorted(str(x["id"]) for x in lines) and len(set(ids)) == 40_010
        con.execute("DELETE FROM results")
        con.commit()
        con.close()
    # the check before the run meets the change (at once, or after pyarrow's first rows: as many as
    # its readahead gave), and the first row's prompt and the run then read the whole file as text
    assert skipped[0] == 0 and 0 < skipped[3] < 40_000 and skipped[1:3] == skipped[4:] == [0, 0], skipped


def test_a_json_lines_file_that_changes_type_reads_every_row_alike(make_job, tmp_path):
    """Where pyarrow gave rows before the change (typed, 3 as 3.0 in a column of decimals) and
    Python after (text), a row's prompt would depend on where pyarrow stopped, which varies run to
    run. The run reads the file whole as text: `{x:.1f}` fails on every row, not on those after."""
    lines = [{"id": f"r{i}", "text": "t", "system_prompt": "s", "x": 1.5 if i == 0 else 3} for i in range(40_010)]
    lines[-1]["x"] = "n/a"
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = make_job(job={"input": {"path": "docs.jsonl", "extra_columns": ["x"]},
                        "prompts": {"user_template": "{x:.1f} {text}"}})
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT status, count(*) FROM results GROUP BY status").fetchall() == [("failed", 40_010)]
    assert "Unknown format code 'f'" in con.execute("SELECT error FROM results LIMIT 1").fetchone()[0]


def test_json_lines_numbers_that_stop_fitting_their_column_are_a_change_of_type(make_job, tmp_path):
    """Past the first block pyarrow reads with the first block's types and says "Failed to convert
    JSON" (an integer id column meeting 2.5): named by its line, not called corrupt."""
    lines = [{"id": i, "text": "t", "system_prompt": "s"} for i in range(40_010)]
    lines[40_005]["id"] = 2.5
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = invoke("validate", "--set", "input.path=docs.jsonl", make_job())
    assert out.exit_code == 3 and "docs.jsonl: line 40006: column 'id' (input.id_column) holds 2.5" in out.output, out.output


def test_json_lines_values_that_cannot_be_text_name_their_line(make_job, tmp_path):
    cases = [("id", 2.5, "line 3: column 'id' (input.id_column) holds 2.5: an id must be an integer or text"),
             ("id", True, "line 3: column 'id' (input.id_column) holds true"),
             ("text", 5, "line 3: column 'text' (input.text_column) holds 5, not text")]
    for column, value, said in cases:
        lines = [{"id": f"r{i}", "text": "t", "system_prompt": "s"} for i in range(5)]
        lines[2][column] = value
        (tmp_path / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        out = invoke("validate", "--set", "input.path=docs.jsonl", make_job())
        assert out.exit_code == 3 and "docs.jsonl: " + said in out.output, out.output
        assert out.output.count("\n") == 1 and "corrupt" not in out.output
    lines = [{"id": i if i % 2 else f"r{i}", "txt": "t", "system_prompt": "s"} for i in range(5)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = invoke("validate", "--set", "input.path=docs.jsonl", make_job())
    assert out.exit_code == 3 and "column 'text' (input.text_column) not found" in out.output, out.output


def test_bad_input_leaves_no_log_and_no_folder_behind(make_job, tmp_path):
    job = make_job()
    out = CliRunner().invoke(cli, ["run", "--engine", "fake", "--set", "input.text_column=nope", str(job)])
    assert out.exit_code == 3 and "column 'nope'" in out.output
    assert not (tmp_path / "out").exists()


def test_export_to_a_reader_that_stops_early_ends_quietly(make_job, tmp_path):
    """`runner export ... | head`: the reader closes the pipe after a few bytes. As for any filter,
    no `Error:` line; the exit status is 141 (128 + SIGPIPE), which `set -o pipefail` can still see."""
    job = make_job(rows=4000)
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    for fmt in ("csv", "jsonl", "parquet"):
        proc = subprocess.Popen(runner_cmd("export", "--job", job, "--format", fmt), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        assert len(proc.stdout.read(64)) == 64
        proc.stdout.close()  # more than a pipe's 64 KiB is left to write
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 141, (fmt, err)
        assert "Error" not in err and "Traceback" not in err, err


def test_stats_and_status_to_a_reader_that_is_gone_exit_141_quietly(make_job):
    """`runner stats | head -1` under `set -o pipefail`: the reader's leaving is 141, as for export,
    not click's exit 1 for a broken pipe (which a cron wrapper reads as the runner failing)."""
    job = make_job(rows=3)
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    for args in (("stats", "--job", job), ("status", job)):
        proc = subprocess.Popen(runner_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()  # gone before the first line is written
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 141, (args, err)
        assert err == "", err


def test_every_command_that_prints_says_so_in_one_line_when_standard_output_is_full(make_job, tmp_path):
    """Standard output on a full disk (here /dev/full): one `Error:` line and exit 6, as export
    does, not a traceback and exit 1."""
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    job = make_job(rows=3)
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    for args in (("stats", "--job", job), ("stats", "--json", "--job", job), ("status", job), ("plan", job),
                 ("validate", job), ("report", "1", "--job", job), ("export", "--job", job, "--format", "csv")):
        with open("/dev/full", "w") as full:
            proc = subprocess.run(runner_cmd(*args), stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
        assert proc.returncode == 6, (args, proc.stderr)
        assert proc.stderr == "Error: standard output: cannot write: No space left on device\n", (args, proc.stderr)


def test_openai_batch_lines_keep_every_instruction_refuse_conversations_and_may_be_compressed(make_job, tmp_path):
    """Only the last system message reached the model, and a conversation's earlier turns were
    dropped without a word; a null custom_id stopped a run that stores bad rows; .gz was not read."""
    import gzip

    from runner.openai_batch import batches

    def line(cid, *messages):
        return json.dumps({"custom_id": cid, "body": {"messages": [{"role": r, "content": c} for r, c in messages]}}) + "\n"

    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress((
        line("a", ("system", "MAIN"), ("developer", "Also: be terse"), ("user", "hello")) +
        line(None, ("user", "no id"))).encode()))
    assert [r for b in batches(str(tmp_path / "b.jsonl.gz"), 10) for r in b.to_pylist()] == [
        {"custom_id": "a", "system": "MAIN\n\nAlso: be terse", "user": "hello"},
        {"custom_id": None, "system": "", "user": "no id"}]
    args = ["--set", "input.format=openai-batch", "--set", "input.id_column=custom_id",
            "--set", "input.text_column=user", "--set", "input.system_prompt_column=system"]
    job = make_job()
    out = invoke("run", "--engine", "fake", "--quiet", "--set", "input.path=b.jsonl.gz", "--set",
                 "input.on_bad_row=store", *args, job)
    assert out.exit_code == 0, out.output
    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert con.execute("SELECT row_id, status FROM results").fetchall() == [("a", "ok")]
    assert con.execute("SELECT count(*) FROM rejected_rows").fetchone()[0] == 1

    # a user message without text (an image alone) is a null text: the default refuses the run, naming it
    (tmp_path / "img.jsonl").write_text(json.dumps({"custom_id": "i", "body": {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}}) + "\n")
    out = invoke("validate", "--set", "input.path=img.jsonl", *args, job)
    assert out.exit_code == 3 and "column 'user' (input.text_column)" in out.output and "null" in out.output, out.output
    (tmp_path / "chat.jsonl").write_text(line("c", ("system", "S"), ("user", "example"), ("assistant", "{}"),
                                              ("user", "the real one")))
    out = invoke("validate", "--set", "input.path=chat.jsonl", *args, job)
    assert out.exit_code == 3 and out.output == (
        f"Error: {tmp_path / 'chat.jsonl'}: line 1: a conversation of several turns (user, assistant, user): a row is "
        "one system prompt and one user message (few-shot turns go in the job's prompts.examples)\n"), out.output


def test_a_quote_left_open_before_the_last_column_is_named_as_such(make_job, tmp_path):
    """Opened before the last column, the quote swallows the rest of the file into one field: pyarrow
    then counts too few fields in that row, and the error said so instead of naming the open quote."""
    (tmp_path / "docs.csv").write_text('id,text,system_prompt,a,b\n1,fine,S,x,y\n2,"cut off\nand more,S,x,y\n')
    job = make_job(job={"input": {"path": "docs.csv"}})
    out = invoke("validate", job)
    assert out.exit_code == 3 and out.output.strip() == (
        f"Error: {tmp_path / 'docs.csv'}: the file ends inside a quoted field opened in the row on line 3: it was cut "
        "off, or its quoting is broken"), out.output
