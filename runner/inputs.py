"""The input's row contract: what a pre-scan checks, and record batches turned into Documents.

`scan_input` checks the whole input before a run starts (columns, types, nulls, duplicate ids,
UTF-8), so that bad data stops the run before anything is written; `read_documents` then streams
the rows. Where the batches come from is the reader's business (runner/readers.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

from runner.errors import InputError
from runner.plan import group_key
from runner.row_ids import RowIds
from runner.prompting import Document
from runner.readers import Reader
from runner.spec import InputSpec
from runner.summary import plural


MAX_PROMPT_KEYS = 100_000  # distinct system prompts remembered for the prompt-set fingerprint


@dataclass
class InputScan:
    """What a pre-scan of the input found."""

    files: list[str]
    rows: int  # after the job's limit, without rejected rows
    ids: Optional[RowIds]  # the input's row ids on disk (with keep_ids; the caller closes them)
    system_prompt_keys: set[str]  # group keys of the distinct system prompts in the column (empty: none)
    # input.on_bad_row: store: rows left out of the run (row number in the input, id, reason);
    # `skip` holds their row numbers for the reader
    rejected: list[tuple[int, Optional[str], str]] = field(default_factory=list)
    skip: set[int] = field(default_factory=set)
    cut_by_limit: bool = False  # input.limit stopped the reading before the input's end


class NotUtf8(InputError):
    """A text column holds bytes that are not UTF-8; `row`: a row of the batch that does (the scan
    names it by its id)."""

    def __init__(self, message: str, row: Optional[int]):
        super().__init__(message)
        self.row = row


def _not_utf8(arr) -> Iterator[int]:
    """Positions of the values of a (not dictionary) column that are not UTF-8 text."""
    import pyarrow as pa

    raw = arr if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type) else arr.cast(pa.binary())
    for i, value in enumerate(raw.to_pylist()):
        try:
            if value is not None:
                value.decode("utf-8")
        except UnicodeDecodeError:
            yield i


def _text_column(file: str, batch, name: str, field: str):
    """A column as valid UTF-8 strings, or an InputError naming the file and column. A dictionary
    column stays one (its values are checked): a prompt repeated on every row is one string."""
    import pyarrow as pa

    arr = batch.column(name)
    if pa.types.is_dictionary(arr.type):
        try:
            values = _text_column(file, pa.record_batch([arr.dictionary], names=[name]), name, field)
        except NotUtf8 as exc:  # a position in the dictionary: the row is the first that uses such a value
            bad = set(_not_utf8(arr.dictionary))
            raise NotUtf8(str(exc), next((i for i, e in enumerate(arr.indices.to_pylist()) if e in bad), None)) from None
        return pa.DictionaryArray.from_arrays(arr.indices, values)
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
        try:
            arr = arr.cast(pa.string())
        except pa.ArrowInvalid:
            raise NotUtf8(f"{file}: column {name!r} ({field}) holds bytes that are not UTF-8 text",
                          next(_not_utf8(arr), None)) from None
    elif not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        raise InputError(f"{file}: column {name!r} ({field}) must hold text, not {arr.type}")
    try:
        arr.validate(full=True)
    except pa.ArrowInvalid:
        raise NotUtf8(f"{file}: column {name!r} ({field}) holds bytes that are not UTF-8 text",
                      next(_not_utf8(arr), None)) from None
    return arr


def _values(arr) -> list:
    """Python values of a column; a dictionary column's rows share its values' string objects."""
    import pyarrow as pa

    if pa.types.is_dictionary(arr.type):
        values = arr.dictionary.to_pylist()
        return [None if i is None else values[i] for i in arr.indices.to_pylist()]
    return arr.to_pylist()


def _decoded(arr):
    """A dictionary-encoded column (pandas categoricals, repeated prompts) as plain values."""
    import pyarrow as pa

    return arr.dictionary_decode() if pa.types.is_dictionary(arr.type) else arr


def _extra_column(file: str, batch, name: str):
    """An extra column for the template: bytes must be UTF-8 text (they would show as b'...')."""
    import pyarrow as pa

    arr = _decoded(batch.column(name))
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
        return _text_column(file, batch, name, "input.extra_columns")
    return arr


def _id_column(file: str, batch, name: str):
    import pyarrow as pa

    arr = _decoded(batch.column(name))
    if not (pa.types.is_integer(arr.type) or pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        raise InputError(f"{file}: column {name!r} (input.id_column) must hold integers or text, not {arr.type}")
    return arr.cast(pa.string())


def scan_input(reader: Reader, keep_ids: bool = False) -> InputScan:
    """Check the whole input once before a run: raises InputError on the first problem. Memory
    stays bounded: duplicate ids are found in a temporary SQLite file, kept with `keep_ids`."""
    ids_on_disk = RowIds()
    try:
        scan = _scan(reader, ids_on_disk)
    except BaseException:
        ids_on_disk.close()
        raise
    if not keep_ids:
        ids_on_disk.close()
        scan.ids = None
    return scan


def _scan(reader: Reader, seen: RowIds) -> InputScan:
    spec = reader.spec
    scan = InputScan(files=[], rows=0, ids=seen, system_prompt_keys=set())
    for file, batch in reader.batches():
        ids = _id_column(file, batch, spec.id_column)
        try:
            texts = _text_column(file, batch, spec.text_column, "input.text_column")
            if spec.on_bad_row == "fail":
                _refuse_nulls(file, spec, ids, texts)
            if spec.system_prompt_column:
                sp = _text_column(file, batch, spec.system_prompt_column, "input.system_prompt_column")
                if sp.null_count and spec.on_bad_row == "fail":
                    first = ids[sp.is_null().to_pylist().index(True)].as_py()
                    raise InputError(f"{file}: column {spec.system_prompt_column!r} (input.system_prompt_column) is "
                                     f"null in {plural(sp.null_count, 'row')}, first at id {first!r} "
                                     "(input.on_bad_row: store runs the other rows)")
                _add_keys(scan.system_prompt_keys, sp)
            for c in spec.extra_columns:
                _extra_column(file, batch, c)  # bytes that are not UTF-8 stop the run here
        except NotUtf8 as exc:
            at = f" (at id {ids[exc.row].as_py()!r})" if exc.row is not None else ""
            raise InputError(f"{exc}{at}") from None
        if spec.on_bad_row == "fail":
            duplicate = seen.add(ids.to_pylist())
            if duplicate is not None:
                raise InputError(f"{file}: duplicate id {duplicate!r} in column {spec.id_column!r} (input.id_column)")
        else:
            _set_aside(scan, ids.to_pylist(), seen)
        scan.rows += batch.num_rows
    if scan.rows == 0:
        raise InputError(f"{reader.input_path}: the input has no rows")
    scan.files = reader.files()
    scan.rows -= len(scan.skip)
    return scan


def _add_keys(keys: set[str], prompts) -> None:
    """The group keys of a column of system prompts, up to MAX_PROMPT_KEYS in all."""
    import pyarrow.compute as pc

    if len(keys) < MAX_PROMPT_KEYS:
        keys.update(group_key(v) for v in pc.unique(prompts).to_pylist() if v is not None)


def system_prompt_keys(reader: Reader) -> set[str]:
    """The group keys of the system prompts a reader's rows hold, read from that column alone."""
    spec, keys = reader.spec, set()
    for file, batch in reader.batches([spec.system_prompt_column]):
        _add_keys(keys, _text_column(file, batch, spec.system_prompt_column, "input.system_prompt_column"))
    return keys


MAX_REJECTED_KEPT = 10_000  # rejected rows listed in the database; more are only counted


def _set_aside(scan: InputScan, ids: list, seen: RowIds) -> None:
    """on_bad_row: store: null ids and repeated ids (after the first) are left out of the run."""
    start = scan.rows
    present = [n for n, i in enumerate(ids) if i is not None]
    rejected = [(n, None, "null id") for n, i in enumerate(ids) if i is None]
    rejected += [(present[d], ids[present[d]], "duplicate id (the first row with it runs)")
                 for d in seen.add_keep_first([ids[n] for n in present])]
    for n, rid, why in sorted(rejected, key=lambda r: r[0]):
        scan.skip.add(start + n)
        if len(scan.rejected) < MAX_REJECTED_KEPT:
            scan.rejected.append((start + n, rid, why))


def _refuse_nulls(file: str, spec: InputSpec, ids, texts) -> None:
    if ids.null_count or texts.null_count:
        _refuse_non_objects(file, spec)
    if ids.null_count:
        raise InputError(f"{file}: column {spec.id_column!r} (input.id_column) has {plural(ids.null_count, 'null id')} "
                         f"(input.on_bad_row: store runs the other rows)")
    if texts.null_count:
        first = ids[texts.is_null().to_pylist().index(True)].as_py()
        raise InputError(f"{file}: column {spec.text_column!r} (input.text_column) is null in {plural(texts.null_count, 'row')}, "
                         f"first at id {first!r} (input.on_bad_row: store runs the other rows)")


def _refuse_non_objects(file: str, spec: InputSpec) -> None:
    """A JSON Lines line that is `null` reaches pyarrow's reader as a row of nulls: name the line
    rather than a null id (the survey parses the file in Python, so only on this error path)."""
    from runner import input_paths, json_lines

    if input_paths.file_format(file, spec.format) == "jsonl" and (problem := json_lines.survey(file)[0]):
        raise InputError(f"{file}: {problem}")


def read_documents(reader: Reader, system_prompt, skip: frozenset[int] | set[int] = frozenset()) -> Iterator[Document]:
    """Stream the input as Documents, one record batch in memory at a time."""
    return documents_from_batches(reader.batches(), reader.spec, system_prompt, skip)


def _values_of(column) -> list:
    """A column's values; an Arrow map's as dicts (pyarrow gives (key, value) pairs)."""
    import pyarrow as pa

    values = column.to_pylist()
    if pa.types.is_map(column.type):
        return [None if v is None else dict(v) for v in values]
    return values


def _field(value):
    """An extra column's value as a prompt shows it: null as empty, a list, struct or map (Parquet,
    JSON) as JSON text, not Python's repr; anything else as it is (a number keeps its format spec)."""
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        import json

        return json.dumps(value, ensure_ascii=False, default=str)
    return value


def documents_from_batches(batches, spec: InputSpec, system_prompt, skip=frozenset()) -> Iterator[Document]:
    """Documents from (file, Arrow record batch) pairs, whoever read them (pyarrow or Ray Data).
    system_prompt: one prompt for every row, or a function of a row's fields (a system template).
    skip: row numbers (in input order) the scan rejected; a null text or system prompt (with
    on_bad_row: store) makes a Document with a problem, stored failed."""
    row = -1
    for file, batch in batches:
        ids = _id_column(file, batch, spec.id_column).to_pylist()
        texts = _values(_text_column(file, batch, spec.text_column, "input.text_column"))
        if spec.system_prompt_column:
            systems = _values(_text_column(file, batch, spec.system_prompt_column, "input.system_prompt_column"))
        else:
            systems = [system_prompt] * len(ids)
        extras = {c: _values_of(_extra_column(file, batch, c)) for c in spec.extra_columns}
        for i, rid in enumerate(ids):
            row += 1
            if row in skip:
                continue
            fields = {c: _field(v[i]) for c, v in extras.items()}
            problem = (f"input: null text ({spec.text_column})" if texts[i] is None else
                       f"input: null system prompt ({spec.system_prompt_column})" if systems[i] is None
                       and spec.system_prompt_column else None)
            system = systems[i]
            if callable(system_prompt):  # prompts.system_template: a value it cannot take fails this row only
                try:
                    system = system_prompt(fields)
                except InputError as exc:
                    system, problem = None, problem or str(exc)
            yield Document(row_id=rid, text=texts[i] or "", fields=fields, problem=problem, system_prompt=system)
