"""JSON Lines input, read with pyarrow's streaming JSON reader, and beyond what it takes: a column
whose values change type, a line longer than its block, an empty file, and a broken line named by
its number (pyarrow counts rows within a block)."""
from __future__ import annotations

import io
import json
import os
from typing import Any, Callable, Iterator, Optional

from runner.blocks import Resumable
from runner.errors import InputError

# pyarrow's words for a column whose values change type: against the types it inferred itself, and
# against those of the file's first block (_typed's explicit schema)
TYPE_CHANGE = ("changed from", "Failed to convert JSON")
# Files found to change type, by (path, size, modification time): read as text from their first row
# on by every later reader in this process, so that a row reads the same wherever pyarrow stopped
# (`runner run` checks its input, finding the change, before it reads the rows to run).
_AS_TEXT: set[tuple] = set()
_SURVEYS: dict[tuple, tuple[Optional[str], dict[str, set[str]]]] = {}  # survey's, by _key
INT64 = range(-(1 << 63), 1 << 63)


def type_change(exc: BaseException) -> bool:
    """Whether pyarrow refused the file because a column's values change type."""
    return any(words in str(exc) for words in TYPE_CHANGE)


def _key(file: str) -> tuple:
    st = os.stat(file)
    return os.path.realpath(file), st.st_size, st.st_mtime_ns


def read_as_text(file: str) -> bool:
    """Whether an earlier read found that this file's columns change type."""
    return _key(file) in _AS_TEXT


def batches(file: str, columns: list[tuple[str, str]], batch_rows: int,
            check: Callable[[set[str]], None]) -> Iterator:
    """The job's columns of one JSON Lines file (gzip and the like by their suffix), at most
    batch_rows a batch: typed as pyarrow infers them from the file's first block, or as text from the
    row where a column's values change type on (text_batches). `check` gets the keys the file holds
    and refuses a missing column. pyarrow's streaming reader, not pyarrow.dataset, whose JSON reader
    (pyarrow 26) read a file of one line without a final newline, and a file whose first line
    outgrew its block, as rows of nulls: null ids, or rows left out without a word."""
    import pyarrow as pa

    if read_as_text(file):
        yield from text_batches(file, columns, 0, batch_rows)
        return
    if not _has_rows(file):
        return  # an empty file holds no rows (pyarrow refuses it as an "empty JSON stream")
    rows, schema = Resumable(), {}  # rows given (a read in text goes on after them); the types inferred
    try:
        yield from rows.batches(lambda block: _typed(file, columns, block, check, schema), batch_rows)
        return
    except _NotTheContract:  # before any row: Python reads the ids exactly, or names the line that breaks them
        yield from text_batches(file, columns, 0, batch_rows)
        return
    except pa.ArrowInvalid as exc:
        failure: Exception = exc
    except UnicodeDecodeError as exc:  # a key that is not UTF-8 (pyarrow decodes the names)
        failure = exc
    problem, _ = survey(file)
    if problem is not None:
        raise InputError(f"{file}: {problem}") from None
    if isinstance(failure, UnicodeDecodeError):  # one json.loads took (surrogatepass), pyarrow did not
        raise InputError(f"{file}: a key is not valid UTF-8 ({failure})") from None
    if not type_change(failure):
        raise failure
    yield from text_batches(file, columns, rows.given, batch_rows, check=rows.given == 0)


def _typed(file: str, columns: list[tuple[str, str]], block: int, check: Callable[[set[str]], None],
           schema: dict) -> Iterator:
    """The job's columns as record batches, each of the type pyarrow inferred from the file's first
    block, but text where that block held only nulls or lacked the key (a title null on the first
    10,000 lines and text after was refused: "changed from null to string"; a field the job does
    not read no longer stops the run by changing type), or held dates: JSON has none, and pyarrow's
    guess refused ids "2024-05-01" and rendered "2020-01-01" as "2020-01-01 00:00:00". `schema`
    keeps the types of a first read for a read again in larger blocks, whose first block is larger."""
    import pyarrow as pa
    import pyarrow.json as pj

    read = pj.ReadOptions(block_size=block)
    if "types" not in schema:
        first = pj.open_json(file, read_options=read)
        inferred = first.schema
        first.close()
        names = [c for c, _ in columns]
        keys = set(inferred.names)
        if any(c not in keys for c in names):  # a key the first block lacks may come later (null where absent)
            problem, later = survey(file)
            if problem is not None:
                raise InputError(f"{file}: {problem}")
            keys |= set(later)
        check(keys)
        types = {f.name: f.type for f in inferred}
        schema["types"] = pa.schema([pa.field(c, _as_read(types.get(c, pa.null()))) for c in names])
        if not all(_fits(schema["types"].field(c).type, field) for c, field in columns):
            raise _NotTheContract()
    options = pj.ParseOptions(explicit_schema=schema["types"], unexpected_field_behavior="ignore")
    yield from pj.open_json(file, read_options=read, parse_options=options)


class _NotTheContract(Exception):
    """The first block's types break the row contract: ids pyarrow took for numbers with a fraction
    (2.5, or an integer past 64 bits, which it reads as a double), text columns of numbers. Read in
    Python instead (text_batches), where a big integer stays exact and a bad value names its line."""


def _fits(read_as, field: str) -> bool:
    """Whether a job column read as this type can hold what the row contract asks (ids integers
    or text, the text and system prompt text); extra columns take any type but an object: pyarrow
    gives every line's object the keys of all of them (null where a line lacks one) in the first
    line's order, so a row's prompt would depend on the other lines; read in Python, it is as written."""
    import pyarrow as pa

    if field == "input.extra_columns":
        return not _holds_struct(read_as)
    text = pa.types.is_string(read_as) or pa.types.is_large_string(read_as)
    return text or (field == "input.id_column" and pa.types.is_integer(read_as))


def first_keys(file: str) -> set[str]:
    """The keys of the file's first block as pyarrow reads it (none where it cannot: the read
    that follows names the problem)."""
    import pyarrow.json as pj

    try:
        reader = pj.open_json(file)
        keys = set(reader.schema.names)
        reader.close()
        return keys
    except Exception:  # noqa: BLE001 - an empty or broken file: batches() says what is wrong
        return set()


def _holds_struct(t) -> bool:
    """Whether an Arrow type is, or holds at any depth, a struct (a JSON object)."""
    import pyarrow as pa

    if pa.types.is_struct(t):
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _holds_struct(t.value_type)
    return False


def _as_read(inferred):
    """The type a column is read as: pyarrow's guess, but text for a column of nulls or of dates."""
    import pyarrow as pa

    return pa.string() if pa.types.is_null(inferred) or pa.types.is_temporal(inferred) else inferred


def _has_rows(file: str) -> bool:
    """Whether the file holds anything but blank lines (read up to its first such line)."""
    with _open(file) as fh:
        return any(line.strip() for line in fh)


def _open(file: str):
    """The file's bytes, decompressed where its suffix names a codec (.gz, .bz2, .zst...), as pyarrow
    reads them."""
    import pyarrow as pa

    return io.BufferedReader(pa.input_stream(file, compression="detect"))


def survey(file: str) -> tuple[Optional[str], dict[str, set[str]]]:
    """Where a JSON Lines file stops being JSON, by line number (pyarrow counts rows per block), or
    None; and the kinds of value each key holds ("int", "float", "str", "dict"...; "bigint" past
    64 bits), one object at a time. Once per file (by path, size and time) in a process: it parses
    every line in Python (~18 s a GB), and a command reads its input more than once."""
    key = _key(file)
    if key not in _SURVEYS:
        _SURVEYS[key] = _survey(file)
    return _SURVEYS[key]


def _survey(file: str) -> tuple[Optional[str], dict[str, set[str]]]:
    kinds: dict[str, set[str]] = {}
    for number, line in _numbered(file):
        try:
            value = json.loads(line)
        except ValueError as exc:
            return f"line {number}: not valid JSON ({getattr(exc, 'msg', exc)})", kinds
        if not isinstance(value, dict):
            return f"line {number} holds {json.dumps(value)[:40]}, not a JSON object", kinds
        for key, v in value.items():
            kind = type(v).__name__
            kinds.setdefault(key, set()).add("bigint" if kind == "int" and v not in INT64 else kind)
    return None, kinds


def text_batches(file: str, columns: list[tuple[str, str]], skip: int, batch_rows: int,
                 check: bool = False) -> Iterator:
    """The job's columns read in Python, where pyarrow refused a column whose values change type
    (ids 7 and "A-7" in one file; pyarrow types a column from its first values). Ids may be integers
    or text, the text and system prompt columns text. An extra column whose values are all integers
    (or numbers) across the file stays one (`{n:03d}` renders as it does where no column changes
    type); any other is text (numbers as str() writes them, objects and arrays as JSON). Anything
    else is an InputError naming the line. `skip`: rows pyarrow already gave; `check`: name a column
    no line has before any row goes on (as null ids, say). Later reads of the file are text from its
    start."""
    import pyarrow as pa

    _AS_TEXT.add(_key(file))
    kinds = survey(file)[1]  # the kinds of value each key holds over the file (survey keeps them)
    names = [c for c, _ in columns]
    if check and (missing := [c for c in names if c not in kinds]):
        raise InputError(f"{file}: column {missing[0]!r} ({dict(columns)[missing[0]]}) not found; "
                         f"columns are {sorted(kinds)}")
    types = {c: _number_type(kinds.get(c, set())) if field == "input.extra_columns" else pa.string()
             for c, field in columns}
    numbers = {c for c in names if types[c] != pa.string()}  # taken as they are; the rest through _text
    values: dict[str, list] = {c: [] for c in names}
    for row, (number, line) in enumerate(_numbered(file), 1):
        if row <= skip:
            continue
        obj = json.loads(line)
        for c, field in columns:
            value = obj.get(c)
            values[c].append(value if c in numbers else
                             _text(value, f"{file}: line {number}: column {c!r} ({field})", field))
        if len(values[names[0]]) == batch_rows:
            yield pa.record_batch([pa.array(values[c], types[c]) for c in names], names=names)
            values = {c: [] for c in names}
    if values[names[0]]:
        yield pa.record_batch([pa.array(values[c], types[c]) for c in names], names=names)


def _number_type(kinds: set[str]):
    """int64 for a column of integers, float64 for one of numbers (as pyarrow types them), else text."""
    import pyarrow as pa

    held = kinds - {"NoneType"}
    if held and held <= {"int"}:
        return pa.int64()
    if held and held <= {"int", "float"}:
        return pa.float64()
    return pa.string()


def _numbered(file: str) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of the file's lines that are not blank, as pyarrow skips those."""
    with _open(file) as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                yield number, line


def _text(value: Any, where: str, field: str) -> Optional[str]:
    if value is None:
        return value
    if isinstance(value, str):
        try:
            value.encode("utf-8")  # a lone surrogate ("\\ud800") is JSON but not Unicode text
        except UnicodeEncodeError:
            raise InputError(f"{where} holds text that is not valid Unicode (a lone surrogate)") from None
        return value
    if field == "input.id_column":
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        raise InputError(f"{where} holds {json.dumps(value)[:60]}: an id must be an integer or text")
    if field != "input.extra_columns":
        raise InputError(f"{where} holds {json.dumps(value)[:60]}, not text")
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else str(value)
