"""Exporting a run's results to Parquet, CSV or JSON Lines, extraction fields as columns."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from runner.errors import NotFound, OutputClosed, OutputFileError, SpecError, StoreError
from runner.rows import EXPORT_COLUMNS, EXPORT_COLUMNS_ADDED
from runner.store import Store
from runner.whole_file import write_whole

FORMATS = ("parquet", "csv", "jsonl")
BATCH_ROWS = 5_000  # rows an export holds in memory at once (a Parquet row group each)
# Arrow types of the result's own columns (the rest are text)
_COLUMN_TYPES = {c: "int64" for c in ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "attempts", "run_id",
                                      "document_tokens_cut")} \
    | {"latency_ms": "float64"}
_SCALARS = {"string", "integer", "number", "boolean"}


_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}


def format_for(output: str, given: Optional[str]) -> str:
    """The export format: --format, else the output file's suffix. A suffix that names another
    format than --format is refused (CSV in a file named .parquet would fool whatever reads it)."""
    named = _SUFFIXES.get(Path(output).suffix.lower()) if output != "-" else None
    if output != "-" and Path(output).suffix.lower() in (".gz", ".gzip", ".tgz", ".bz2", ".zst", ".zstd", ".xz", ".lz4", ".zip"):
        raise SpecError(f"{output}: exports are not compressed: name the file {Path(output).stem} "
                        "and compress it after (Parquet compresses its own columns)")
    if given and named and given != named:
        raise SpecError(f"{output}: the file's name says {named}, --format says {given}")
    if given or named:
        return given or named
    if output != "-" and os.path.isdir(output):  # what is wrong first: no file name can be written there
        raise OutputFileError(f"{output}: is a folder: give a file name")
    where = "standard output" if output == "-" else f"{output}: a name ending in none of {', '.join(_SUFFIXES)}"
    raise SpecError(f"--format: give parquet, csv or jsonl for {where}")


def flat_fields(schema: dict) -> dict[str, bool]:
    """Top-level extraction fields -> whether each is a scalar (a plain column) or not (a JSON text
    column). A root or a field given by a local `$ref` is read where it points (schema generators
    write `{"$ref": "#/$defs/Doc", "$defs": ...}`); `const` of a scalar is one; a field whose schema
    is `true` or `false` (any value; none) is not."""
    # a root that is only a `$ref` is read where it points; one with properties of its own, as given
    top = _followed(schema, schema) if isinstance(schema, dict) and "properties" not in schema else schema
    if not isinstance(top, dict):
        return {}
    # an object schema (`"type": ["object"]` too); one that gives properties but no type (JSON
    # Schema allows it) is read as one
    kind = top.get("type", "object" if "properties" in top else None)
    if "object" not in (kind if isinstance(kind, list) else [kind]):
        return {}
    properties = top.get("properties")
    return {name: _scalar(_followed(sub, schema)) for name, sub in (properties or {}).items()} \
        if isinstance(properties, dict) else {}


def _scalar(sub) -> bool:
    if not isinstance(sub, dict):
        return False
    kind = sub.get("type")
    kinds = set(kind) - {"null"} if isinstance(kind, list) else {kind}
    if "const" in sub and kind is None:
        return isinstance(sub["const"], (str, int, float, bool))
    return (len(kinds) == 1 and kinds <= _SCALARS) or ("enum" in sub and kind is None)


def _followed(sub, root: dict, hops: int = 16):
    """`sub` with its local `$ref` (`#/$defs/x`) followed, a few hops at most (a cycle stops)."""
    from runner.schema_file import NOTHING, pointed

    while hops and isinstance(sub, dict) and isinstance(sub.get("$ref"), str) and sub["$ref"].startswith("#/"):
        target = pointed(root, sub["$ref"])
        if target is NOTHING:
            return sub
        sub, hops = target, hops - 1
    return sub


def export_run(store: Store, run_id: Optional[int], fmt: str, out: Optional[Path], job_name: Optional[str] = None,
               keep: Optional[Callable[[Path], Optional[str]]] = None) -> int:
    """Write run_id's results (or, with job_name, the job's latest result for every row) to `out`,
    or to stdout when out is None; returns the number of rows. `keep`: files `out` must not be (the
    job's own: write_whole). Streamed in batches of
    BATCH_ROWS: a first pass over the rows fixes each extraction column's type, so memory stays
    bounded whatever the job's size."""
    run = store.run(run_id) if job_name is None else next(iter(store.latest_runs(job_name, 1)), None)
    if run is None:
        raise NotFound(f"{store.path}: no run {run_id}" if job_name is None else f"{store.path}: no runs of {job_name}")
    if fmt not in FORMATS:
        raise StoreError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    fields = flat_fields(json.loads(run["config_json"]).get("output_schema", {}))
    for older in (store.result_runs(job_name) if job_name is not None else []):  # newest first
        # the job's rows were made by several versions of it: every version's fields get a column
        for name, scalar in flat_fields(json.loads(older["config_json"]).get("output_schema", {})).items():
            fields[name] = fields.get(name, scalar) and scalar  # a field that was an object anywhere: JSON text
    schema = _schema(fields, _field_kinds(store.results_of(run_id, job_name, columns=["extraction_json"]), fields))
    written = [0]

    def write(sink) -> None:
        written[0] = _write(_tables(store.results_of(run_id, job_name), fields, schema), schema, fmt, sink)

    if out is not None:
        write_whole(out, write, reading=store.path, check=store.check_unchanged, keep=keep)
        return written[0]
    try:
        write(None)
        store.check_unchanged()
        sys.stdout.flush()
    except OSError as exc:
        if isinstance(exc, BrokenPipeError) or exc.errno == errno.EPIPE or "Broken pipe" in str(exc):
            raise OutputClosed("standard output was closed by its reader") from None
        raise OutputFileError(f"standard output: cannot write: {exc.strerror or exc}") from None
    return written[0]


def _value(r: dict) -> dict:
    value = json.loads(r["extraction_json"]) if r["extraction_json"] else {}
    return value if isinstance(value, dict) else {}


def _field_kinds(rows: Iterable[dict], fields: dict[str, bool]) -> dict[str, set[str]]:
    """The kinds of value each scalar field holds over all rows (a model may answer 3 or 3.5 or "3")."""
    kinds: dict[str, set[str]] = {f: set() for f, scalar in fields.items() if scalar}
    for r in rows:
        value = _value(r)
        for f, seen in kinds.items():
            v = value.get(f)
            if v is not None:
                seen.add(_kind(v))
    return kinds


def _kind(v) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):  # past 2**53 a double cannot hold it: beside floats, such a column is text
        return "int" if abs(v) <= 2**53 else "bigint" if -2**63 <= v < 2**63 else "str"
    return "float" if isinstance(v, float) else "str"


def _schema(fields: dict[str, bool], kinds: dict[str, set[str]]):
    """The export's columns and types: the result's own, the extraction's fields, the added ones."""
    import pyarrow as pa

    def field_type(f: str, scalar: bool):
        k = kinds.get(f, set())
        if not scalar or k == {"str"}:
            return pa.string()
        if not k:
            return pa.null()
        if k == {"bool"}:
            return pa.bool_()
        if k <= {"int", "bigint"}:
            return pa.int64()
        return pa.float64() if k <= {"int", "float"} else pa.string()  # mixed: as text

    names = _column_names(fields)
    return pa.schema([(c, _COLUMN_TYPES.get(c, "string")) for c in EXPORT_COLUMNS]
                     + [(names[f], field_type(f, scalar)) for f, scalar in fields.items()]
                     + [(c, _COLUMN_TYPES.get(c, "string")) for c in EXPORT_COLUMNS_ADDED])


def _tables(rows: Iterable[dict], fields: dict[str, bool], schema) -> Iterator:
    """The rows as Arrow tables of BATCH_ROWS rows each (one, empty, when there are none)."""
    batch: list[dict] = []
    sent = False
    for r in rows:
        batch.append(r)
        if len(batch) >= BATCH_ROWS:
            yield _table(batch, fields, schema)
            batch, sent = [], True
    if batch or not sent:
        yield _table(batch, fields, schema)


def _table(rows: list[dict], fields: dict[str, bool], schema):
    import pyarrow as pa

    cols: dict[str, list] = {c: [r[c] for r in rows] for c in EXPORT_COLUMNS + EXPORT_COLUMNS_ADDED}
    values = [_value(r) for r in rows]
    for f, name in _column_names(fields).items():
        text = pa.types.is_string(schema.field(name).type)
        cols[name] = [_cell(v.get(f), text, as_json=not fields[f]) for v in values]
    try:
        return pa.table({name: pa.array(cols[name], schema.field(name).type) for name in schema.names}, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):  # a value the first pass did not see
        raise StoreError("the results changed while they were exported (a run is storing rows): "
                         "export again when it has ended") from None


def _cell(v, text: bool, as_json: bool = False):
    """A field's value for its column: as it is, or as text in a text column (JSON for non-strings).
    In an extraction_FIELD_json column every value is JSON, a string too (`"x"`, quoted): a model
    that answered a string where the schema has an array, or a field of several types, still reads
    back with json.loads, and the string '["x"]' stays apart from the array ["x"]."""
    if v is None or not text or isinstance(v, str) and not as_json:
        return v
    return json.dumps(v, ensure_ascii=False)


def _write(tables: Iterable, schema, fmt: str, out: Optional[Path]) -> int:
    """Write the tables one after another to `out` (stdout when None); returns the rows written."""
    if out is not None and out.exists() and not out.is_file():  # a pipe or a device: Arrow would seek in it
        with open(out, "wb") as stream:
            return _write_to(tables, schema, fmt, stream)
    return _write_to(tables, schema, fmt, out if out is not None else sys.stdout.buffer)


def _write_to(tables: Iterable, schema, fmt: str, out) -> int:
    """_write to a file's path or to an open binary stream."""
    sink = str(out) if isinstance(out, Path) else out
    n = 0
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with pq.ParquetWriter(sink, schema) as w:
            for t in tables:
                w.write_table(t)
                n += t.num_rows
    elif fmt == "csv":
        import pyarrow.csv as pcsv

        with pcsv.CSVWriter(sink, schema) as w:
            for t in tables:
                w.write_table(t)
                n += t.num_rows
    else:
        with (open(out, "wb") if isinstance(out, Path) else contextlib.nullcontext(out)) as f:
            for t in tables:
                lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in t.to_pylist())
                _write_all(f, lines.encode("utf-8"))
                n += t.num_rows
    return n


def _write_all(stream, data: bytes) -> None:
    """Write every byte or raise: an unbuffered stdout (PYTHONUNBUFFERED) reports a pipe its reader
    closed as a short write, not an error."""
    view = memoryview(data)
    while view:
        n = stream.write(view)
        if not n:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        view = view[n:]


def _column_names(fields: dict[str, bool]) -> dict[str, str]:
    """Each extraction field's column: extraction_FIELD (a scalar) or extraction_FIELD_json. A name
    the export already has (a field called `json` is the result's own extraction_json; a field
    `tags_json` beside an array `tags`) gets _2, _3... in the order `fields` gives them (the stored
    schema's own; runs stored by runner 0.2.0 and before have its keys sorted)."""
    taken = set(EXPORT_COLUMNS) | set(EXPORT_COLUMNS_ADDED)
    names = {}
    for field, scalar in fields.items():
        base = f"extraction_{field}" if scalar else f"extraction_{field}_json"
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        names[field] = name
        taken.add(name)
    return names
