"""OpenAI batch files (what vLLM's run_batch reads) as input: one request per line,
`{"custom_id": ..., "body": {"messages": [...]}}`.

Each line becomes a row with the columns `custom_id`, `system` (the system message, or else the
`developer` one; empty when there is none) and `user` (the last user message): a job names them as input.id_column, system_prompt_column and
text_column. The body's other fields (model, max_tokens, response_format) are not used: the job's
sampling and output schema apply to every row.
"""
from __future__ import annotations

import json
from typing import Iterator

from runner.errors import InputError

COLUMNS = ("custom_id", "system", "user")


def row(line: str, file: str, number: int) -> dict:
    """One request line as a row; an InputError names the file and line of a malformed one."""
    try:
        request = json.loads(line)
        messages = request["body"]["messages"]
        by_role: dict[str, str] = {}
        for m in messages:
            by_role[m["role"]] = _text(m.get("content"))
        custom_id = request["custom_id"]
        if not isinstance(custom_id, (str, int)) or isinstance(custom_id, bool):
            raise TypeError(f"custom_id must be text or an integer, not {type(custom_id).__name__}")
        # OpenAI's newer clients send the instructions as a "developer" message. No system message
        # at all: an empty system prompt (the rows group together, with none).
        system = by_role.get("system", by_role.get("developer", ""))
        return {"custom_id": str(custom_id), "system": system, "user": by_role.get("user")}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InputError(f"{file}: line {number}: not an OpenAI batch request with custom_id and body.messages "
                         f"({exc.__class__.__name__}: {exc})") from None


def _text(content) -> str:
    """A message's text: a string, or the text parts of a list of content parts (null: none)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part if isinstance(part, str) else part["text"] for part in content
                   if isinstance(part, str) or part.get("type") == "text")


def batches(file: str, batch_rows: int) -> Iterator:
    """Arrow record batches of at most batch_rows requests, read line by line (bounded memory)."""
    import pyarrow as pa

    schema = pa.schema([(c, pa.string()) for c in COLUMNS])
    rows: list[dict] = []
    with open(file, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a BOM, as editors on Windows write
            except UnicodeDecodeError:
                raise InputError(f"{file}: line {number}: not UTF-8 text") from None
            if not line.strip():
                continue
            rows.append(row(line, file, number))
            if len(rows) >= batch_rows:
                yield pa.RecordBatch.from_pylist(rows, schema=schema)
                rows = []
    if rows:
        yield pa.RecordBatch.from_pylist(rows, schema=schema)
