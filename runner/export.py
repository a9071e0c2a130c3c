"""Exporting a run's results to Parquet, CSV or JSON Lines, extraction fields as columns."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional

from runner.errors import OutputClosed, OutputFileError, StoreError
from runner.rows import EXPORT_COLUMNS, EXPORT_COLUMNS_ADDED
from runner.store import Store

FORMATS = ("parquet", "csv", "jsonl")
_SCALARS = {"string", "integer", "number", "boolean"}


def flat_fields(schema: dict) -> dict[str, bool]:
    """Top-level extraction fields -> whether each is a scalar (a plain column) or not (a JSON text column)."""
    if schema.get("type") != "object":
        return {}
    out = {}
    for name, sub in schema.get("properties", {}).items():
        kind = sub.get("type")
        kinds = set(kind) - {"null"} if isinstance(kind, list) else {kind}
        out[name] = (len(kinds) == 1 and kinds <= _SCALARS) or ("enum" in sub and kind is None)
    return out


def export_run(store: Store, run_id: Optional[int], fmt: str, out: Optional[Path], job_name: Optional[str] = None) -> int:
    """Write run_id's results (or, with job_name, the job's latest result for every row) to `out`,
    or to stdout when out is None; returns the number of rows."""
    run = store.run(run_id) if job_name is None else next(iter(store.latest_runs(job_name, 1)), None)
    if run is None:
        raise StoreError(f"{store.path}: no run {run_id}" if job_name is None else f"{store.path}: no runs of {job_name}")
    fields = flat_fields(json.loads(run["config_json"]).get("output_schema", {}))
    cols: dict[str, list] = {c: [] for c in EXPORT_COLUMNS}
    cols.update({_col(f, scalar): [] for f, scalar in fields.items()})
    cols.update({c: [] for c in EXPORT_COLUMNS_ADDED})
    n = 0
    for r in store.results_of(run_id, job_name):
        n += 1
        for c in EXPORT_COLUMNS + EXPORT_COLUMNS_ADDED:
            cols[c].append(r[c])
        value = json.loads(r["extraction_json"]) if r["extraction_json"] else {}
        for f, scalar in fields.items():
            v = value.get(f) if isinstance(value, dict) else None
            cols[_col(f, scalar)].append(v if scalar or v is None else json.dumps(v, ensure_ascii=False))
    import pyarrow as pa

    if fmt not in FORMATS:
        raise StoreError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    table = pa.table({c: _array(v) for c, v in cols.items()})
    if out is not None:
        write_whole(out, lambda part: _write(table, fmt, part))
        return n
    try:
        _write(table, fmt, None)
        sys.stdout.flush()
    except OSError as exc:
        if isinstance(exc, BrokenPipeError) or exc.errno == errno.EPIPE or "Broken pipe" in str(exc):
            raise OutputClosed("standard output was closed by its reader") from None
        raise OutputFileError(f"standard output: cannot write: {exc.strerror or exc}") from None
    return n


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """A file written whole or not at all: `write` fills a file beside `path`, which is then
    renamed over it, so a failed write (a full disk) leaves the file from before as it was. Exports
    and reports; an OutputFileError names the path."""
    part = path.with_name(f".{path.name}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(part)
        os.replace(part, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            part.unlink()
        raise OutputFileError(f"{path}: cannot write: {exc.strerror or exc}") from None


def _write(table, fmt: str, out: Optional[Path]) -> None:
    sink = str(out) if out is not None else sys.stdout.buffer
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, sink)
    elif fmt == "csv":
        import pyarrow.csv as pcsv

        pcsv.write_csv(table, sink)
    else:
        lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in table.to_pylist())
        if out is None:
            _write_all(sys.stdout.buffer, lines.encode("utf-8"))
        else:
            out.write_text(lines, encoding="utf-8")


def _write_all(stream, data: bytes) -> None:
    """Write every byte or raise: an unbuffered stdout (PYTHONUNBUFFERED) reports a pipe its reader
    closed as a short write, not an error."""
    view = memoryview(data)
    while view:
        n = stream.write(view)
        if not n:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        view = view[n:]


def _col(field: str, scalar: bool) -> str:
    return f"extraction_{field}" if scalar else f"extraction_{field}_json"


def _array(values: list):
    """An Arrow column; a field whose values mix types (a model may answer 3 or 3.5) becomes text."""
    import pyarrow as pa

    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([None if v is None else str(v) for v in values], pa.string())
