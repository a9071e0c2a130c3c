"""A CSV file that ends inside a quoted field: cut off mid-copy, or its quoting broken; and
pyarrow's CSV errors said in the user's terms.

pyarrow reads a quote left open at the end of the file as closed there, so the last row would be
stored with its text cut short, as if nothing were wrong. Python's csv module (C, ~140 MB/s) is
run over the file with a sentinel line after it: where a quote is still open at the end, the
sentinel is read into that field instead of as a row of its own. Not strict, as pyarrow is not: a
quote inside an unquoted cell (5" screen) is text, and text after a closing quote ("a"b) joins
the field. A file with no quote character at all is passed over after a byte count.
"""
from __future__ import annotations

import csv
import io
import itertools

from runner.errors import InputError

SENTINEL = "\x00runner: end of file\x00"
FIELD_LIMIT_CHARS = 64 << 20  # a quoted field this long is a quote never closed, not a document


def refuse_open_quote(file: str) -> None:
    """InputError where the CSV file (plain, .gz or .bz2) ends inside a quoted field, naming the
    line of the row it opened in."""
    import pyarrow as pa

    with pa.input_stream(file, compression="detect") as f:
        while chunk := f.read(1 << 24):
            if b'"' in chunk:
                break
        else:
            return
    limit = csv.field_size_limit(FIELD_LIMIT_CHARS)
    start, end, last = 1, 0, None  # the line the last row read starts on, the line it ends on; that row
    try:
        with pa.input_stream(file, compression="detect") as f:
            text = io.TextIOWrapper(f, encoding="utf-8", errors="replace", newline="")
            rows = csv.reader(itertools.chain(text, ["\n", SENTINEL + "\n"]))
            for last in rows:
                start, end = end + 1, rows.line_num
    except csv.Error:  # only the field limit: not strict
        raise InputError(f"{file}: a quoted field opened in the row on line {end + 1:,} runs on for more than "
                         f"{FIELD_LIMIT_CHARS >> 20} MiB: its quote is never closed") from None
    finally:
        csv.field_size_limit(limit)
    if last != [SENTINEL]:
        raise InputError(f"{file}: the file ends inside a quoted field opened in the row on line {start:,}: "
                         "it was cut off, or its quoting is broken")


def explain_csv_error(file: str, message: str) -> str:
    """One line for a CSV error pyarrow raised: which row (the header is row 1; a quoted field may
    span lines) and what is wrong with it, without pyarrow's dataset wrapping."""
    import re

    reason = message.rsplit("Invalid: ", 1)[-1]  # "Error creating dataset. ... Invalid: <the error>"
    if m := re.search(r"Row #(\d+): Expected (\d+) columns, got (\d+): ?(.*)", reason, re.S):
        row, want, got, text = m.groups()
        return (f"{file}: row {int(row):,} has {got} fields where the header has {want} (the header is row 1): "
                f"{text[:80]!r}")
    if m := re.search(r"column #(\d+): Row #(\d+): CSV conversion error to string: invalid UTF8", reason):
        column, row = m.groups()
        return (f"{file}: row {int(row):,}, field {int(column) + 1}, holds bytes that are not UTF-8 text "
                "(the header is row 1; save the file as UTF-8)")
    return f"{file}: corrupt or unreadable csv data ({reason})"
