"""JSON Lines files as users hand them over, through the command line: what pyarrow's dataset reader
read as rows of nulls (a file of one line without a final newline, a first line longer than its
block), a line longer than pyarrow's blocks, a compressed file whose column changes type, a key the
first block lacks, a key that is not UTF-8, and an empty file among others."""
from __future__ import annotations

import gzip
import json
import sqlite3

from click.testing import CliRunner

from runner.cli import cli


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def stored(tmp_path, database="out/results.sqlite") -> dict:
    with sqlite3.connect(tmp_path / database) as con:
        return dict(con.execute("SELECT row_id, status FROM results"))


def row(i, text="t", **more) -> str:
    return json.dumps({"id": i, "text": text, "system_prompt": "s"} | more) + "\n"


def test_rows_pyarrows_dataset_reader_read_as_nulls_run(make_job, tmp_path):
    """A one-line file without its final newline was one row of nulls ("1 null id"); a first line
    over pyarrow's 1 MiB block made every row of the file null: with on_bad_row: store the whole
    file was left out, exit 0."""
    (tmp_path / "one.jsonl").write_text(row(5).rstrip("\n"))
    job = make_job(job={"input": {"path": "one.jsonl", "on_bad_row": "store", "on_too_long": "truncate"}})
    out = invoke("run", "--engine", "fake", "--quiet", job)
    assert out.exit_code == 0 and stored(tmp_path) == {"5": "ok"}, out.output
    (tmp_path / "long.jsonl").write_text(row(1, "word " * 220_000) + "".join(row(i) for i in range(2, 6)))
    out = invoke("run", "--engine", "fake", "--quiet", "--set", "input.path=long.jsonl", "--set", "output.database=long.sqlite", job)
    assert out.exit_code == 0 and "left out" not in out.output, out.output
    assert stored(tmp_path, "long.sqlite") == {str(i): "ok" for i in range(1, 6)}


def test_a_line_longer_than_pyarrows_blocks_is_read(make_job, tmp_path):
    """A valid 2.25 MB line was refused as "corrupt or unreadable" data (a straddling object)."""
    (tmp_path / "docs.jsonl").write_text(row(1) + row(2, "word " * 450_000) + row(3))
    out = invoke("run", "--engine", "fake", "--quiet", make_job(job={"input": {"path": "docs.jsonl", "on_too_long": "truncate"}}))
    assert out.exit_code == 0, out.output
    assert stored(tmp_path) == {"1": "ok", "2": "ok", "3": "ok"}


def test_a_compressed_file_whose_ids_change_type_runs(make_job, tmp_path):
    """Lines were read from the compressed bytes: "line 1: not valid JSON" for a file pyarrow reads."""
    (tmp_path / "docs.jsonl.gz").write_bytes(gzip.compress((row(7) + row("r8") + row(9)).encode()))
    job = make_job(job={"input": {"path": "docs.jsonl.gz", "format": "jsonl"}})
    out = invoke("run", "--engine", "fake", "--quiet", job)
    assert out.exit_code == 0, out.output
    assert stored(tmp_path) == {"7": "ok", "r8": "ok", "9": "ok"}


def test_a_key_the_first_block_lacks_is_a_column_where_later_lines_hold_it(make_job, tmp_path):
    """An extra column absent from pyarrow's first block was "not found"; its rows run, the
    value empty where a line has no such key. A key no line holds is still refused."""
    lines = [row(i, "x" * 500) if i < 2900 else row(i, "x" * 500, title=f"T{i}") for i in range(3000)]
    (tmp_path / "docs.jsonl").write_text("".join(lines))
    job = make_job(job={"input": {"path": "docs.jsonl", "extra_columns": ["title"]},
                        "prompts": {"user_template": "[{title}] {text}"}})
    out = invoke("run", "--engine", "fake", "--quiet", job)
    assert out.exit_code == 0, out.output
    assert set(stored(tmp_path).values()) == {"ok"} and len(stored(tmp_path)) == 3000
    out = invoke("validate", "--set", "input.extra_columns=[subtitle]", "--set", "prompts.user_template={subtitle} {text}", job)
    assert out.exit_code == 3 and "column 'subtitle' (input.extra_columns) not found" in out.output, out.output


def test_a_key_that_is_not_utf8_is_one_error_naming_its_line(make_job, tmp_path):
    """A traceback (UnicodeDecodeError from the column names), even in a column the job does not read."""
    (tmp_path / "docs.jsonl").write_bytes(row(1).encode() + b'{"id": 2, "text": "b", "system_prompt": "s", "o\xff": 1}\n')
    out = invoke("validate", make_job(job={"input": {"path": "docs.jsonl"}}))
    assert out.exit_code == 3 and out.output.startswith("Error: ") and "docs.jsonl: line 2: not valid JSON" in out.output, out.output
    assert out.output.count("\n") == 1


def test_a_line_that_is_not_an_object_is_named(make_job, tmp_path):
    """A line `null` reached pyarrow as a row of nulls: "has 1 null id", with no line to look at;
    a number or an array is named by the same words."""
    job = make_job(job={"input": {"path": "docs.jsonl"}})
    for line, shown in (("null", "null"), ("5", "5"), ("[1, 2]", "[1, 2]")):
        (tmp_path / "docs.jsonl").write_text(row(1) + line + "\n" + row(3))
        for command in ("validate", "run"):
            out = invoke(command, *(["--engine", "fake"] if command == "run" else []), job)
            assert out.exit_code == 3 and out.output == f"Error: {tmp_path / 'docs.jsonl'}: line 2 holds {shown}, not a JSON object\n", out.output
    assert not (tmp_path / "out" / "results.sqlite").exists() or stored(tmp_path) == {}


def test_an_empty_json_lines_file_holds_no_rows(make_job, tmp_path):
    """One empty (or blank) file in a folder stopped the job as "corrupt or unreadable" data."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text(row(1) + row(2))
    (folder / "b.jsonl").write_text("")
    (folder / "c.jsonl").write_text("\n  \n")
    (folder / "d.jsonl").write_text(row(3))
    out = invoke("run", "--engine", "fake", "--quiet", make_job(job={"input": {"path": "in"}}))
    assert out.exit_code == 0, out.output
    assert stored(tmp_path) == {"1": "ok", "2": "ok", "3": "ok"}


def test_numbers_stay_numbers_where_another_column_changes_type(make_job, tmp_path):
    """Ids 1 then "r2" made every extra column text: `{n:03d}` failed every row of that file, and
    of only that file in a folder. Columns of integers (or numbers) across a file stay so; a column
    that mixes numbers and text is text, as before."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text(row(1, n=7, f=2.0) + row(2, n=8, f=3.5))
    (folder / "b.jsonl").write_text(row(3, n=9, f=2) + row("r4", n=10, f=4.5) + row(5, n=None, f=None))
    job = make_job(job={"input": {"path": "in", "extra_columns": ["n", "f"]},
                        "prompts": {"user_template": "{text} n={n:03d} f={f:.1f}"}})
    out = invoke("run", "--engine", "fake", "--quiet", job)
    assert out.exit_code == 0, out.output
    assert stored(tmp_path) == {"1": "ok", "2": "ok", "3": "ok", "r4": "ok", "5": "failed"}  # n=None: no :03d
    with sqlite3.connect(tmp_path / "out" / "results.sqlite") as con:
        assert "Unknown format code 'd'" in con.execute("SELECT error FROM results WHERE row_id = '5'").fetchone()[0]
    (folder / "c.jsonl").write_text(row(6, n=1) + row("r7", n="one"))
    out = invoke("run", "--engine", "fake", "--quiet", "--set", "prompts.user_template={text} n={n}",
                 "--set", "input.extra_columns=[n]", "--set", "output.database=c.sqlite", job)
    assert out.exit_code == 0 and stored(tmp_path, "c.sqlite")["r7"] == "ok", out.output


def test_dates_are_text_as_written(make_job, tmp_path):
    """pyarrow guessed timestamps: ids "2024-05-01" were refused ("not timestamp[s]")."""
    (tmp_path / "docs.jsonl").write_text(row("2024-05-01", "2020-01-01", day="2020-01-01") + row("2024-05-02", day="2021-02-03"))
    job = make_job(job={"input": {"path": "docs.jsonl", "extra_columns": ["day"]},
                        "prompts": {"user_template": "{day:.10} {text}"}})
    out = invoke("run", "--engine", "fake", "--quiet", job)
    assert out.exit_code == 0, out.output
    assert stored(tmp_path) == {"2024-05-01": "ok", "2024-05-02": "ok"}


def test_text_that_is_not_unicode_is_one_error(make_job, tmp_path):
    """A key holding a UTF-8-encoded surrogate, and a lone surrogate in a file read in Python,
    ended in tracebacks."""
    (tmp_path / "a.jsonl").write_bytes(b'{"id": 1, "text": "a", "system_prompt": "s", "k\xed\xa0\x80": 1}\n')
    (tmp_path / "b.jsonl").write_text(row(1) + row("x", "a\\ud800").replace("\\\\ud800", "\\ud800"))
    for name, said in (("a.jsonl", "a key is not valid UTF-8"),
                       ("b.jsonl", "line 2: column 'text' (input.text_column) holds text that is not valid Unicode")):
        out = invoke("validate", "--set", f"input.path={name}", make_job())
        assert out.exit_code == 3 and out.output.startswith("Error: ") and said in out.output, out.output
        assert out.output.count("\n") == 1


def test_compressed_files_in_a_folder_or_a_glob_are_found_by_their_ending(make_job, tmp_path):
    """A nightly feed lands as day-1.jsonl.gz, day-2.jsonl.bz2: a folder or a glob of them was "no
    input files match", and a single such file needed input.format. CSV alike; a .gz of another
    format (notes.txt.gz) is still not input."""
    import bz2

    feed = tmp_path / "feed"
    feed.mkdir()
    (feed / "day-1.jsonl.gz").write_bytes(gzip.compress((row(1) + row(2)).encode()))
    (feed / "day-2.jsonl.bz2").write_bytes(bz2.compress(row(3).encode()))
    (feed / "notes.txt.gz").write_bytes(gzip.compress(b"not input"))
    job = make_job(job={"input": {"path": "feed"}})
    out = invoke("run", "--engine", "fake", "--quiet", job)
    assert out.exit_code == 0, out.output
    assert stored(tmp_path) == {"1": "ok", "2": "ok", "3": "ok"}
    out = invoke("run", "--engine", "fake", "--quiet", "--set", "input.path=feed/*.jsonl.gz",
                 "--set", "output.database=glob.sqlite", job)
    assert out.exit_code == 0 and stored(tmp_path, "glob.sqlite") == {"1": "ok", "2": "ok"}, out.output
    csvs = tmp_path / "csvs"
    csvs.mkdir()
    (csvs / "a.csv.gz").write_bytes(gzip.compress(b"id,text,system_prompt\n10,t,s\n11,t,s\n"))
    out = invoke("run", "--engine", "fake", "--quiet", "--set", "input.path=csvs",
                 "--set", "output.database=csv.sqlite", job)
    assert out.exit_code == 0 and stored(tmp_path, "csv.sqlite") == {"10": "ok", "11": "ok"}, out.output


def test_ids_past_64_bits_are_exact_and_a_fractional_id_names_its_line(make_job, tmp_path):
    """pyarrow reads an integer past 64 bits in the first block as a double: such ids were refused
    ("must hold integers or text, not double"), and so was an id of 2.5, naming no line."""
    big = 2**70 + 1  # a double would round it to 2**70
    (tmp_path / "docs.jsonl").write_text(row(big) + row(2))
    job = make_job(job={"input": {"path": "docs.jsonl"}})
    out = invoke("run", "--engine", "fake", "--quiet", job)
    assert out.exit_code == 0, out.output
    assert stored(tmp_path) == {str(big): "ok", "2": "ok"}
    out = invoke("run", "--engine", "fake", job)  # the same ids again: nothing left to do
    assert out.exit_code == 0 and "0 run, 2 already done, 2 in input" in out.output, out.output
    (tmp_path / "frac.jsonl").write_text(row(1) + row(2.5) + row(3))
    out = invoke("validate", "--set", "input.path=frac.jsonl", job)
    assert out.exit_code == 3 and out.output.count("\n") == 1, out.output
    assert "frac.jsonl: line 2: column 'id' (input.id_column) holds 2.5" in out.output, out.output


def test_an_object_column_is_each_line_s_own_object_whatever_the_other_lines_hold(tmp_path):
    """pyarrow types a column of objects as one struct of every line's keys: row 2's {"a": 3} reached
    the prompt as {"b": null, "a": 3, "c": null}, and as {"a": 3} once another line made the file
    read in Python: one row, two prompts."""
    from runner.inputs import read_documents
    from runner.readers import LocalReader
    from runner.spec import InputSpec

    spec = InputSpec(path="x", id_column="id", text_column="text", system_prompt_column="system_prompt",
                     extra_columns=["meta"])

    def metas(*lines):
        (tmp_path / "d.jsonl").write_text("".join(lines))
        got = [d.fields["meta"] for d in read_documents(LocalReader(str(tmp_path / "d.jsonl"), spec), None)]
        return [json.loads(m) if m else m for m in got]

    assert metas(row(1, meta={"b": 1, "a": 2}), row(2, meta={"a": 3}), row(3, meta={"a": 3, "c": {"deep": True}}),
                 row(5, meta=None)) == [{"b": 1, "a": 2}, {"a": 3}, {"a": 3, "c": {"deep": True}}, ""]
    assert metas(row(1, meta=[{"x": 1}]), row(2, meta=[{"y": 2}, {"x": 3}])) == [[{"x": 1}], [{"y": 2}, {"x": 3}]]
    assert metas(row(1, meta=[1, 2]), row(2, meta=[3])) == [[1, 2], [3]]  # no object: pyarrow's read stands
