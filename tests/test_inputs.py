"""Parquet reading: streaming in record batches, input paths, and bad input found before a run."""
from __future__ import annotations

import os
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runner.errors import InputError
from runner.inputs import read_documents, scan_input as _scan_input
from runner.input_paths import input_files
from runner.readers import LocalReader
from runner.spec import InputSpec
from tests.conftest import write_docs

SPEC = InputSpec(path="x", id_column="id", text_column="text", system_prompt_column="system_prompt")


def scan_input(path, spec, **kw):
    return _scan_input(LocalReader(str(path), spec), **kw)


def iter_documents(path, spec, system_prompt):
    return read_documents(LocalReader(str(path), spec), system_prompt)


def test_streams_in_record_batches_of_the_configured_size(tmp_path):
    f = write_docs(tmp_path / "d.parquet", 23)
    spec = SPEC.model_copy(update={"batch_rows": 4})
    sizes = [b.num_rows for _, b in LocalReader(str(f), spec).batches(["id", "text"])]
    assert max(sizes) <= 4 and sum(sizes) == 23
    it = iter_documents(str(f), spec, None)
    first = next(it)  # lazily: the first row comes before the rest are read
    assert first.row_id == "r000" and first.text.startswith("Document 0")
    assert [d.row_id for d in it][-1] == "r022"


def test_limit_and_extra_columns(tmp_path):
    f = write_docs(tmp_path / "d.parquet", 10, title=[f"T{i}" for i in range(10)])
    spec = SPEC.model_copy(update={"limit": 7, "batch_rows": 3, "extra_columns": ["title"]})
    rows = list(iter_documents(str(f), spec, None))
    assert len(rows) == 7 and rows[6].fields == {"title": "T6"}
    assert scan_input(str(f), spec).rows == 7


def test_folder_and_glob_inputs(tmp_path):
    write_docs(tmp_path / "in" / "a.parquet", 3)
    pq.write_table(pa.table({"id": ["z1"], "text": ["t"], "system_prompt": ["s"]}), tmp_path / "in" / "b.parquet")
    assert [p.rsplit("/", 1)[1] for p in input_files(str(tmp_path / "in"))] == ["a.parquet", "b.parquet"]
    assert len(input_files(str(tmp_path / "in" / "*.parquet"))) == 2
    assert scan_input(str(tmp_path / "in"), SPEC).rows == 4


def test_a_spark_output_folder_is_read_without_its_hidden_and_underscore_entries(tmp_path):
    """Spark and Hive leave _SUCCESS, _temporary/ (a failed attempt's copies) and .crc files beside
    the parts; pyarrow leaves them out, and so does the runner: read, they were duplicate ids."""
    out = tmp_path / "out"
    write_docs(out / "part-00000.parquet", 3)
    write_docs(out / "_temporary" / "0" / "part-00000.parquet", 3)
    write_docs(out / ".part-00000.parquet", 3)
    write_docs(out / "_extra.parquet", 3)
    (out / "_SUCCESS").write_text("")
    assert input_files(str(out)) == [str(out / "part-00000.parquet")]
    assert input_files(str(out / "**" / "*.parquet")) == [str(out / "part-00000.parquet")]
    assert scan_input(str(out), SPEC).rows == 3
    # the input's own folder, or a file named outright, may be named anything
    assert input_files(str(out / "_temporary")) == [str(out / "_temporary" / "0" / "part-00000.parquet")]
    assert input_files(str(out / "_extra.parquet")) == [str(out / "_extra.parquet")]


def test_a_linked_folder_below_the_input_is_read_once_and_a_link_loop_ends(tmp_path):
    write_docs(tmp_path / "real" / "r.parquet", 2)
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": ["z1"], "text": ["t"], "system_prompt": ["s"]}), tmp_path / "in" / "a.parquet")
    (tmp_path / "in" / "sub").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "back").symlink_to(tmp_path / "in")  # a loop: in/sub/back/sub/...
    assert [p.split("/in/", 1)[1] for p in input_files(str(tmp_path / "in"))] == ["a.parquet", "sub/r.parquet"]
    assert scan_input(str(tmp_path / "in"), SPEC).rows == 3


def test_integer_ids_become_text(tmp_path):
    f = tmp_path / "i.parquet"
    pq.write_table(pa.table({"id": [5, 6], "text": ["a", "b"], "system_prompt": ["s", "s"]}), f)
    assert [d.row_id for d in iter_documents(str(f), SPEC, None)] == ["5", "6"]


def _write(tmp_path, **cols):
    f = tmp_path / "bad.parquet"
    pq.write_table(pa.table(cols), f)
    return str(f)


@pytest.mark.parametrize("make, expected", [
    (lambda p: str(p / "missing.parquet"), "missing.parquet: input file not found"),
    (lambda p: str(p / "none-*.parquet"), "no input files match"),
    (lambda p: _write(p, id=pa.array([], pa.string()), text=pa.array([], pa.string()),
                      system_prompt=pa.array([], pa.string())), "the input has no rows"),
    (lambda p: _write(p, ident=["a"], text=["t"], system_prompt=["s"]), "column 'id' (input.id_column) not found"),
    (lambda p: _write(p, id=["a"], body=["t"], system_prompt=["s"]), "column 'text' (input.text_column) not found"),
    (lambda p: _write(p, id=["a", "b", "a"], text=["x", "y", "z"], system_prompt=["s"] * 3), "duplicate id 'a'"),
    (lambda p: _write(p, id=["a", "b"], text=["x", None], system_prompt=["s"] * 2), "is null in 1 row, first at id 'b'"),
    (lambda p: _write(p, id=["a"], text=[b"\xff\xfe bad"], system_prompt=["s"]),
     "holds bytes that are not UTF-8 text (at id 'a')"),
    (lambda p: _write(p, id=["a", "b", "c"], text=[b"ok", None, b"caf\xe9"], system_prompt=["s"] * 3),
     "column 'text' (input.text_column) holds bytes that are not UTF-8 text (at id 'c')"),
    (lambda p: _write(p, id=["a", "b", "c"], text=["x"] * 3,
                      system_prompt=pa.DictionaryArray.from_arrays(pa.array([0, 0, 1]), pa.array([b"s", b"\xff"]))),
     "column 'system_prompt' (input.system_prompt_column) holds bytes that are not UTF-8 text (at id 'c')"),
    (lambda p: _write(p, id=["a", "b"], text=["x"] * 2,  # the bad value is the dictionary's 4th, used by row a
                      system_prompt=pa.DictionaryArray.from_arrays(pa.array([3, 0]), pa.array([b"s", b"t", b"u", b"\xff"]))),
     "column 'system_prompt' (input.system_prompt_column) holds bytes that are not UTF-8 text (at id 'a')"),
    (lambda p: _write(p, id=["a", "b"], text=["x"] * 2, system_prompt=["s", None]), "column 'system_prompt' (input.system_prompt_column) is null in 1 row, first at id 'b'"),
    (lambda p: _write(p, id=["a"], text=[3], system_prompt=["s"]), "must hold text, not int64"),
])
def test_bad_input_is_one_clear_error(tmp_path, make, expected):
    with pytest.raises(InputError) as err:
        scan_input(make(tmp_path), SPEC)
    assert expected in str(err.value)


def test_corrupt_parquet(tmp_path):
    f = write_docs(tmp_path / "c.parquet", 30)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])  # cut off: no footer
    with pytest.raises(InputError, match="c.parquet: (corrupt|not a readable) Parquet"):
        scan_input(str(f), SPEC)
    (tmp_path / "t.parquet").write_text("not parquet at all")
    with pytest.raises(InputError, match="t.parquet"):
        scan_input(str(tmp_path / "t.parquet"), SPEC)


def test_unreadable_file(tmp_path, monkeypatch):
    import os

    import pyarrow.parquet

    f = write_docs(tmp_path / "u.parquet", 2)
    f.chmod(0)
    if os.geteuid() == 0:  # root reads any file whatever its mode: make the open fail as it would
        def refuse(*a, **k):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(pyarrow.parquet, "ParquetFile", refuse)
    with pytest.raises(InputError, match="permission denied"):
        scan_input(str(f), SPEC)


def test_prefetch_reads_ahead_in_order_and_raises_where_the_item_was():
    import threading

    from runner.errors import InputError
    from runner.prefetch import prefetch

    started = threading.Event()

    def rows():
        started.set()
        yield from range(5)
        raise InputError("part-2.parquet: row 5: bad")

    it = prefetch(rows(), 2)
    assert started.wait(5)  # reading began before anything was asked for
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(InputError, match="row 5"):
        next(it)


def test_dictionary_encoded_columns_and_binary_extras_are_text(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({
        "id": pa.array(["a", "b", "c"]).dictionary_encode(),  # pandas categoricals arrive like this
        "text": ["t1", "t2", "t3"],
        "system_prompt": pa.array(["s", "s", "s"]).dictionary_encode(),
        "title": pa.array(["café".encode(), b"plain", None], pa.binary()),
    }), f)
    spec = SPEC.model_copy(update={"extra_columns": ["title"]})
    scan = scan_input(str(f), spec, keep_ids=True)
    assert set(scan.ids) == {"a", "b", "c"} and "b" in scan.ids and "z" not in scan.ids
    scan.ids.close()
    assert not scan.ids.path.exists()
    rows = list(iter_documents(str(f), spec, None))
    assert [r.row_id for r in rows] == ["a", "b", "c"] and rows[0].system_prompt == "s"
    assert [r.fields["title"] for r in rows] == ["café", "plain", ""]  # not "b'caf\\xc3\\xa9'"


def test_hive_partition_folders_become_columns(tmp_path):
    write_docs(tmp_path / "in" / "desk=sports" / "part-0.parquet", 3)
    (tmp_path / "in" / "desk=weather").mkdir()
    pq.write_table(pa.table({"id": ["z1"], "text": ["t"], "system_prompt": ["s"]}),
                   tmp_path / "in" / "desk=weather" / "part-0.parquet")
    spec = SPEC.model_copy(update={"extra_columns": ["desk"]})
    rows = list(iter_documents(str(tmp_path / "in"), spec, None))
    assert [(r.row_id, r.fields["desk"]) for r in rows] == [("r000", "sports"), ("r001", "sports"),
                                                             ("r002", "sports"), ("z1", "weather")]
    assert scan_input(str(tmp_path / "in"), spec).rows == 4


def test_a_column_both_in_a_parquet_file_and_in_its_folders_name_must_agree(tmp_path):
    """The folder's desk=a replaced the file's own desk values without a word (Spark refuses such a
    column); some writers keep the partition's column in the files, with the folder's value."""
    (tmp_path / "in" / "desk=a").mkdir(parents=True)
    spec = SPEC.model_copy(update={"extra_columns": ["desk"]})
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["t", "u"], "system_prompt": ["s", "s"], "desk": ["a", None]}),
                   tmp_path / "in" / "desk=a" / "p.parquet")
    assert [r.fields["desk"] for r in iter_documents(tmp_path / "in", spec, None)] == ["a", "a"]  # they agree
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["t", "u"], "system_prompt": ["s", "s"], "desk": ["a", "zz"]}),
                   tmp_path / "in" / "desk=a" / "p.parquet")
    with pytest.raises(InputError, match=r"p\.parquet: column 'desk' holds 'zz' where its folder's name says desk=a: "
                                         r"rename the column or the folder"):
        scan_input(str(tmp_path / "in"), spec)
    assert scan_input(str(tmp_path / "in"), SPEC).rows == 2  # a column the job does not read: no matter


def test_a_link_to_a_partition_inside_the_input_leaves_the_partition_to_its_own_path(tmp_path):
    """`current -> desk=sports` (sorted before it): read once, by the path that holds desk=sports."""
    write_docs(tmp_path / "in" / "desk=sports" / "part-0.parquet", 2)
    (tmp_path / "in" / "current").symlink_to(tmp_path / "in" / "desk=sports")
    spec = SPEC.model_copy(update={"extra_columns": ["desk"]})
    assert [p.split("/in/", 1)[1] for p in input_files(str(tmp_path / "in"))] == ["desk=sports/part-0.parquet"]
    assert [r.fields["desk"] for r in iter_documents(str(tmp_path / "in"), spec, None)] == ["sports", "sports"]
    # a link to a hidden folder inside is the way in to it: read through the link
    write_docs(tmp_path / "in" / "_staging" / "v2" / "part-0.parquet", 1)
    (tmp_path / "in" / "next").symlink_to(tmp_path / "in" / "_staging" / "v2")
    assert [p.split("/in/", 1)[1] for p in input_files(str(tmp_path / "in"))] == [
        "desk=sports/part-0.parquet", "next/part-0.parquet"]


def test_a_glob_reads_the_underscore_names_it_names_and_each_file_once(tmp_path):
    write_docs(tmp_path / "data" / "_2024_a.parquet", 2)
    write_docs(tmp_path / "data" / "_tmp" / "x.parquet", 2)
    assert [p.rsplit("/", 1)[1] for p in input_files(str(tmp_path / "data" / "_2024_*.parquet"))] == ["_2024_a.parquet"]
    with pytest.raises(InputError, match="names that begin with _ or . are left out unless the pattern names them"):
        input_files(str(tmp_path / "data" / "*.parquet"))
    (tmp_path / "data" / "up").symlink_to(tmp_path / "data")  # `**` through a link back up
    assert len(input_files(str(tmp_path / "data" / "**" / "_2024_*.parquet"))) == 1


def test_wildcard_characters_in_a_path_that_exists_are_the_names_themselves(tmp_path):
    """A job in `team [x]/` (or a file named lit[1].parquet) was read as a pattern: "no input files match"."""
    folder = tmp_path / "team [x]"
    write_docs(folder / "data" / "a.parquet", 2)
    write_docs(folder / "data" / "lit[1].parquet", 2)
    write_docs(tmp_path / "team x" / "data" / "b.parquet", 2)  # what `[x]` would match as a pattern
    assert input_files(str(folder / "data" / "lit[1].parquet")) == [str(folder / "data" / "lit[1].parquet")]
    assert [f.rsplit("/", 1)[1] for f in input_files(str(folder / "data" / "*.parquet"))] == ["a.parquet", "lit[1].parquet"]
    assert input_files(str(folder / "data" / "a*.parquet")) == [str(folder / "data" / "a.parquet")]
    assert input_files(str(folder / "data")) == sorted(input_files(str(folder / "data" / "*.parquet")))
    # a pattern in a folder that does not exist as written is still a pattern
    assert [f.rsplit("/", 1)[1] for f in input_files(str(tmp_path / "team ?" / "data" / "*.parquet"))] == ["b.parquet"]
    # and one whose folder exists as written but holds no match is the pattern: `data/[ab]/` beside a/ and b/
    write_docs(tmp_path / "d" / "a" / "1.parquet", 2)
    write_docs(tmp_path / "d" / "b" / "2.parquet", 2)
    (tmp_path / "d" / "[ab]").mkdir()
    assert [f.rsplit("/", 2)[1] for f in input_files(str(tmp_path / "d" / "[ab]" / "*.parquet"))] == ["a", "b"]
    # but only that last folder: an empty `team [x]/data/` is not another team's `team x/data/`
    (folder / "empty").mkdir()
    write_docs(tmp_path / "team x" / "empty" / "c.parquet", 2)
    with pytest.raises(InputError, match="no input files match"):
        input_files(str(folder / "empty" / "*.parquet"))


def test_a_prefetch_dropped_unread_stops_its_thread():
    """Dropped without close() and before its first item (a caller that failed early), the
    reading thread still stops: it does not hold the Prefetched alive."""
    import gc
    import itertools

    from runner.prefetch import prefetch

    ahead = prefetch(itertools.count(), 2)  # never ends on its own
    thread = ahead.thread
    del ahead
    gc.collect()
    thread.join(2.0)
    assert not thread.is_alive()


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl"])
def test_the_system_prompts_of_the_whole_input_are_read_past_a_limit(tmp_path, fmt):
    """A --limit run keys its calibration by the whole input's prompts (runner/fingerprint.py): the
    scan stops at the limit, the column's own pass does not."""
    import json

    from runner.inputs import system_prompt_keys
    from runner.plan import group_key

    rows = [{"id": f"r{i}", "text": f"t{i}", "system_prompt": "A" if i < 6 else "B"} for i in range(8)]
    f = tmp_path / f"d.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), f, row_group_size=3)
    elif fmt == "csv":
        f.write_text("id,text,system_prompt\n" + "".join(f"{r['id']},{r['text']},{r['system_prompt']}\n" for r in rows))
    else:
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    limited = SPEC.model_copy(update={"limit": 4})
    scan = LocalReader(str(f), limited).scan()
    assert scan.cut_by_limit and scan.system_prompt_keys == {group_key("A")}
    assert system_prompt_keys(LocalReader(str(f), SPEC)) == {group_key("A"), group_key("B")}


def test_nested_values_reach_the_prompt_as_json_not_python_repr(tmp_path):
    """A struct, list or map column showed as {'a': 1, 'b': 'q'} / [('k', 'v')] in the prompt, and a
    JSON Lines object as Python's repr in the file's first block but as JSON after it."""
    import json

    table = pa.table({"id": ["a", "b"], "text": ["t", "u"], "system_prompt": ["s", "s"],
                      "meta": [{"a": 1, "b": "q"}, None], "tags": [["u", "é"], []],
                      "kv": pa.array([[("k", "v")], []], type=pa.map_(pa.string(), pa.string()))})
    pq.write_table(table, tmp_path / "d.parquet")
    spec = SPEC.model_copy(update={"extra_columns": ["meta", "tags", "kv"]})
    rows = list(iter_documents(tmp_path / "d.parquet", spec, None))
    assert rows[0].fields == {"meta": '{"a": 1, "b": "q"}', "tags": '["u", "é"]', "kv": '{"k": "v"}'}
    assert rows[1].fields == {"meta": "", "tags": "[]", "kv": "{}"}
    (tmp_path / "d.jsonl").write_text(json.dumps({"id": "j", "text": "t", "system_prompt": "s", "meta": {"k": [1, 2]}})
                                      + "\n")
    [row] = iter_documents(tmp_path / "d.jsonl", SPEC.model_copy(update={"extra_columns": ["meta"]}), None)
    assert row.fields == {"meta": '{"k": [1, 2]}'}


def test_the_export_guard_names_what_the_input_reads_and_nothing_else(tmp_path):
    """would_read (export -o's guard) against input_files: a file made at the target would be read
    exactly when the guard says so. Holes found: a folder linked from inside the input folder, a
    glob below a folder whose name holds brackets, a glob's file of another ending; false alarms: a hidden name, a glob's subfolder."""
    from runner.input_paths import input_files, would_read

    outside = tmp_path / "ext"
    outside.mkdir()
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "ext").symlink_to(outside)
    (data / "_staging" / "v2").mkdir(parents=True)
    (data / "current").symlink_to(data / "_staging" / "v2")  # read as current/..., not as _staging/
    (data / "later").symlink_to(tmp_path / "later")  # dangling until a write makes its folder
    (data / "loop").symlink_to(data / "loop")  # a link to itself: the guard must not fail on it
    (data / "a" / "v1").mkdir(parents=True)
    (data / "a" / "v2").symlink_to(data / "a" / "v1")  # one folder by two names, a link below it
    (data / "a" / "v1" / "ext").symlink_to(outside)
    bracket = tmp_path / "da[ta] x"
    bracket.mkdir()
    for folder in (data, outside, data / "sub", bracket):
        pq.write_table(pa.table({"id": ["a"]}), folder / "seed.parquet")
    cases = [(str(data), outside / "new.parquet", True), (str(data), data / "sub" / "new.parquet", True),
             (str(data), data / "_x.parquet", False), (str(data), data / "new.txt", False),
             (str(data / "*.parquet"), data / "sub" / "new.parquet", False), (str(data / "*.parquet"), data / "n.parquet", True),
             (str(data / "**" / "*.parquet"), data / "sub" / "new.parquet", True),
             (str(bracket / "*.parquet"), bracket / "e.parquet", True), (str(bracket / "*.parquet"), tmp_path / "e.parquet", False),
             # folders the export would make: a new hive partition is read, a hidden folder is not
             (str(data), data / "year=2025" / "x.parquet", True), (str(data), data / "_tmp" / "x.parquet", False),
             (str(data / "gone.parquet"), data / "gone.parquet", True),  # the input file, not there now
             # a glob reads every file it names, of any ending (a report.html beside the data)
             (str(data / "*"), data / "report.html", True), (str(data / "*.parquet"), data / "report.html", False),
             # a glob's folder that is a link to a folder outside: its files are read there
             (str(data / "*" / "*.parquet"), outside / "g.parquet", True), (str(data / "*" / "*.parquet"), outside / "g.txt", False),
             (str(data / "**" / "*.parquet"), outside / "g.parquet", True), (str(data / "e?t" / "*"), outside / "g.txt", True),
             (str(data / "*" / "*.parquet"), outside / "_g.parquet", False),
             (str(data / "**" / "*.parquet"), data / "_staging" / "v2" / "g.parquet", True),
             (str(data / "*.parquet"), data / "_staging" / "v2" / "g.parquet", False),
             (str(data / "*" / "v2" / "ext" / "*.parquet"), outside / "h.parquet", True),
             (str(data / "*" / "v1" / "ext" / "*.parquet"), outside / "h.parquet", True),
             # folders the write would make below a linked folder, and a dangling link's own
             (str(data / "*" / "*" / "*.parquet"), outside / "2025" / "g.parquet", True),
             (str(data / "**" / "*.parquet"), outside / "new" / "g.parquet", True),
             (str(data / "*" / "*.parquet"), tmp_path / "later" / "g.parquet", True)]  # last: it makes the folder
    for path, target, expected in cases:
        assert would_read(str(target.resolve()), path) is expected, (path, target)
        target.parent.mkdir(exist_ok=True)
        pq.write_table(pa.table({"id": ["a"]}), target) if target.suffix == ".parquet" else target.write_text("")
        read = {os.path.realpath(f) for f in input_files(path)}
        assert (os.path.realpath(target) in read) is expected, (path, target, read)
        target.unlink()


def test_a_write_through_a_link_in_the_input_folder_is_refused(make_job, tmp_path):
    """A link in the input folder, dangling or to a file outside: writing there leaves a file the
    next run reads through the link, so export -o and report -o refuse it as they refuse the folder."""
    from runner.errors import OutputFileError
    from runner.input_paths import input_files
    from runner.unloaded_job import job_sources
    from runner.whole_file import write_whole

    job = make_job(rows=2)  # its input: data/docs.parquet; give it the folder instead
    text = job.read_text().replace("data/docs.parquet", "data")
    job.write_text(text)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (tmp_path / "data" / "gone.parquet").symlink_to(outside / "gone.parquet")  # dangling
    guard = job_sources(job)
    assert guard(tmp_path / "data" / "gone.parquet").startswith("where the job's input.path reads")
    assert guard(outside / "other.parquet") is None
    with pytest.raises(OutputFileError, match="gone.parquet: is where the job's input.path reads"):
        write_whole(tmp_path / "data" / "gone.parquet", lambda p: p.write_text(""), keep=guard)  # as export -o
    assert not (outside / "gone.parquet").exists()
    pq.write_table(pa.table({"id": ["a"]}), tmp_path / "data" / "gone.parquet")  # what the export would have done
    assert str(tmp_path / "data" / "gone.parquet") in input_files(str(tmp_path / "data"))
    # a glob input reached through a linked folder: the link's real place is what the glob names
    (tmp_path / "via").symlink_to(tmp_path)
    globbed = job_sources(job, ["input.path=data/*.parquet"])
    assert globbed(tmp_path / "via" / "data" / "new.parquet") is not None


def test_a_link_to_a_file_in_the_input_folder_leaves_it_to_its_own_name(tmp_path):
    """`latest.parquet -> year=2024/part-7.parquet` made the folder's rows twice: exit 3, duplicate id."""
    write_docs(tmp_path / "in" / "year=2024" / "part-7.parquet", 2)
    (tmp_path / "in" / "latest.parquet").symlink_to(tmp_path / "in" / "year=2024" / "part-7.parquet")
    (tmp_path / "in" / "also.parquet").symlink_to(tmp_path / "in" / "latest.parquet")  # a link to the link
    spec = SPEC.model_copy(update={"extra_columns": ["year"]})
    assert [p.split("/in/", 1)[1] for p in input_files(str(tmp_path / "in"))] == ["year=2024/part-7.parquet"]
    assert [r.fields["year"] for r in iter_documents(str(tmp_path / "in"), spec, None)] == ["2024", "2024"]
    # two links to one file outside the folder: read once, by the first name
    (tmp_path / "in2").mkdir()
    for name in ("b.parquet", "a.parquet"):
        (tmp_path / "in2" / name).symlink_to(tmp_path / "in" / "year=2024" / "part-7.parquet")
    assert [p.split("/in2/", 1)[1] for p in input_files(str(tmp_path / "in2"))] == ["a.parquet"]
    assert scan_input(str(tmp_path / "in2"), SPEC).rows == 2


def test_hive_partitions_below_a_glob_s_fixed_part_and_spark_s_null_partition(tmp_path):
    """A glob lost every partition column ("column 'month' not found"), and Spark's folder for a null
    value reached the prompt as the text __HIVE_DEFAULT_PARTITION__."""
    write_docs(tmp_path / "data" / "year=2024" / "month=01" / "p.parquet", 2)
    write_docs(tmp_path / "data" / "year=2024" / "month=__HIVE_DEFAULT_PARTITION__" / "p.parquet", 1)
    spec = SPEC.model_copy(update={"extra_columns": ["month"]})
    got = [r.fields["month"] for r in iter_documents(str(tmp_path / "data" / "year=2024" / "*" / "*.parquet"), spec, None)]
    assert got == ["01", "01", ""]  # null, shown as empty as every null field is
    both = SPEC.model_copy(update={"extra_columns": ["year", "month"]})
    rows = list(iter_documents(str(tmp_path / "data"), both, None))  # a folder: every level below it
    assert [(r.fields["year"], r.fields["month"]) for r in rows] == [("2024", "01"), ("2024", "01"), ("2024", "")]
    with pytest.raises(InputError, match="column 'year' .*not found"):  # in the glob's fixed part: not a column
        list(iter_documents(str(tmp_path / "data" / "year=2024" / "*" / "*.parquet"), both, None))


def test_a_file_column_beside_spark_s_null_partition_must_be_null(tmp_path):
    write_docs(tmp_path / "in" / "city=__HIVE_DEFAULT_PARTITION__" / "p.parquet", 2, city=["Oslo", None])
    spec = SPEC.model_copy(update={"extra_columns": ["city"]})
    with pytest.raises(InputError, match="holds 'Oslo' where its folder's name says city=__HIVE_DEFAULT_PARTITION__"):
        list(iter_documents(str(tmp_path / "in"), spec, None))
    write_docs(tmp_path / "in2" / "city=__HIVE_DEFAULT_PARTITION__" / "p.parquet", 2, city=pa.array([None, None], pa.string()))
    assert [r.fields["city"] for r in iter_documents(str(tmp_path / "in2"), spec, None)] == ["", ""]


def test_a_glob_leaves_a_linked_file_to_its_own_name_too(tmp_path):
    """`in/**/*.parquet` read `latest.parquet -> year=2024/part-7.parquet` by the link's name (sorted
    first), losing the year partition: "column 'year' not found"."""
    write_docs(tmp_path / "in" / "year=2024" / "part-7.parquet", 2)
    (tmp_path / "in" / "latest.parquet").symlink_to(tmp_path / "in" / "year=2024" / "part-7.parquet")
    spec = SPEC.model_copy(update={"extra_columns": ["year"]})
    assert [p.split("/in/", 1)[1] for p in input_files(str(tmp_path / "in" / "**" / "*.parquet"))] == [
        "year=2024/part-7.parquet"]
    assert [r.fields["year"] for r in iter_documents(str(tmp_path / "in" / "**" / "*.parquet"), spec, None)] == [
        "2024", "2024"]


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_text_file_s_own_column_must_agree_with_its_folder_s_name_as_parquet_s_must(tmp_path, fmt):
    """For JSON Lines and CSV the folder's value replaced the file's own without a word ("en-GB"
    read as "en"); Parquet's were checked."""
    folder = tmp_path / "data" / "lang=en"
    folder.mkdir(parents=True)
    rows = [{"id": "1", "text": "t", "system_prompt": "s", "lang": "en-GB"}]
    if fmt == "jsonl":
        (folder / "a.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    else:
        (folder / "a.csv").write_text("id,text,system_prompt,lang\n1,t,s,en-GB\n")
    spec = SPEC.model_copy(update={"extra_columns": ["lang"]})
    for path in (tmp_path / "data", tmp_path / "data" / "*" / f"*.{fmt}"):
        with pytest.raises(InputError, match="holds 'en-GB' where its folder's name says lang=en"):
            list(iter_documents(str(path), spec, None))
    # a file without the column (as Spark writes them): the folder's value
    (folder / f"a.{fmt}").write_text('{"id": "1", "text": "t", "system_prompt": "s"}\n' if fmt == "jsonl"
                                     else "id,text,system_prompt\n1,t,s\n")
    assert [r.fields["lang"] for r in iter_documents(str(tmp_path / "data"), spec, None)] == ["en"]
