"""JSON Lines input beyond what pyarrow's reader takes: a column whose values change type, and a
broken line named by its number (pyarrow counts rows within a block)."""
from __future__ import annotations

import json
import os
from typing import Any, Iterator, Optional

from runner.errors import InputError

# pyarrow's words for a column whose values change type: against the types it inferred itself, and
# against those of the file's first block (typed_dataset)
TYPE_CHANGE = ("changed from", "Failed to convert JSON")
# Files found to change type, by (path, size, modification time): read as text from their first row
# on by every later reader in this process, so that a row reads the same wherever pyarrow stopped
# (`runner run` checks its input, finding the change, before it reads the rows to run).
_AS_TEXT: set[tuple] = set()


def type_change(exc: BaseException) -> bool:
    """Whether pyarrow refused the file because a column's values change type."""
    return any(words in str(exc) for words in TYPE_CHANGE)


def _key(file: str) -> tuple:
    st = os.stat(file)
    return os.path.realpath(file), st.st_size, st.st_mtime_ns


def read_as_text(file: str) -> bool:
    """Whether an earlier read found that this file's columns change type."""
    return _key(file) in _AS_TEXT


def typed_dataset(file: str, inferred, columns: list[str]):
    """The JSON Lines file as a dataset of the job's columns only, each of the type pyarrow inferred
    from the file's first block, but text where that block held only nulls: a title null on the
    first 10,000 lines and text after was refused ("changed from null to string"), and a field the
    job does not read can no longer stop the run by changing type."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.json as pj

    schema = pa.schema([pa.field(c, pa.string() if pa.types.is_null(inferred.field(c).type) else inferred.field(c).type)
                        for c in columns])
    options = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    return ds.dataset(file, format=ds.JsonFileFormat(parse_options=options), schema=schema)


def survey(file: str) -> tuple[Optional[str], set[str]]:
    """Where a JSON Lines file stops being JSON, by line number (pyarrow counts rows per block), or
    None; and the keys its objects hold, one object at a time."""
    keys: set[str] = set()
    for number, line in _numbered(file):
        try:
            value = json.loads(line)
        except ValueError as exc:
            return f"line {number}: not valid JSON ({getattr(exc, 'msg', exc)})", keys
        if not isinstance(value, dict):
            return f"line {number}: not a JSON object", keys
        keys.update(value)
    return None, keys


def text_batches(file: str, columns: list[tuple[str, str]], skip: int, batch_rows: int,
                 keys: Optional[set[str]] = None) -> Iterator:
    """The job's columns as text, read in Python, where pyarrow refused a column whose values change
    type (ids 7 and "A-7" in one file; pyarrow types a column from its first values). Ids may be
    integers or text, the text and system prompt columns text, extra columns anything (numbers as
    str() writes them, objects and arrays as JSON); anything else is an InputError naming the line.
    `skip`: rows pyarrow already gave; `keys`: the file's (survey), to name a column no line has
    before any row goes on (as null ids, say). Later reads of the file are text from its start."""
    import pyarrow as pa

    _AS_TEXT.add(_key(file))
    names = [c for c, _ in columns]
    if keys is not None and (missing := [c for c in names if c not in keys]):
        raise InputError(f"{file}: column {missing[0]!r} ({dict(columns)[missing[0]]}) not found; "
                         f"columns are {sorted(keys)}")
    values: dict[str, list] = {c: [] for c in names}
    for row, (number, line) in enumerate(_numbered(file), 1):
        if row <= skip:
            continue
        obj = json.loads(line)
        for c, field in columns:
            values[c].append(_text(obj.get(c), f"{file}: line {number}: column {c!r} ({field})", field))
        if len(values[names[0]]) == batch_rows:
            yield pa.record_batch([pa.array(values[c], pa.string()) for c in names], names=names)
            values = {c: [] for c in names}
    if values[names[0]]:
        yield pa.record_batch([pa.array(values[c], pa.string()) for c in names], names=names)


def _numbered(file: str) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of the file's lines that are not blank, as pyarrow skips those."""
    with open(file, "rb") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                yield number, line


def _text(value: Any, where: str, field: str) -> Optional[str]:
    if value is None or isinstance(value, str):
        return value
    if field == "input.id_column":
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        raise InputError(f"{where} holds {json.dumps(value)[:60]}: an id must be an integer or text")
    if field != "input.extra_columns":
        raise InputError(f"{where} holds {json.dumps(value)[:60]}, not text")
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else str(value)
