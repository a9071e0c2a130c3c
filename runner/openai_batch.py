"""OpenAI batch files (what vLLM's run_batch reads) as input: one request per line,
`{"custom_id": ..., "body": {"messages": [...]}}`.

Each line becomes a row with the columns `custom_id`, `system` (the system and developer
messages, in order, joined by a blank line; empty when there is none) and `user` (the user
message: a line with several turns is refused): a job names them as input.id_column,
system_prompt_column and text_column. The body's other fields (model, max_tokens, response_format) are not used: the job's
sampling and output schema apply to every row.
"""
from __future__ import annotations

import io
import json
from typing import Iterator

from runner.errors import InputError

COLUMNS = ("custom_id", "system", "user")


def row(line: str, file: str, number: int) -> dict:
    """One request line as a row; an InputError names the file and line of a malformed one, or of a
    conversation of several turns (only its last user message would reach the model)."""
    try:
        request = json.loads(line)
        messages = request["body"]["messages"]
        instructions, turns = [], []
        for m in messages:
            role, text = m["role"], _text(m.get("content"))
            if role in ("system", "developer"):
                instructions.append((role, text))
            elif text or role == "user":  # an empty assistant turn (a tool call's) says nothing
                turns.append((role, text))
        custom_id = request["custom_id"]
        if custom_id is not None and (not isinstance(custom_id, (str, int)) or isinstance(custom_id, bool)):
            raise TypeError(f"custom_id must be text or an integer, not {type(custom_id).__name__}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InputError(f"{file}: line {number}: not an OpenAI batch request with custom_id and body.messages "
                         f"({exc.__class__.__name__}: {exc})") from None
    if len(turns) > 1:  # few-shot turns, or a chat's history: dropped, they would change every answer unseen
        roles = ", ".join(role for role, _ in turns)
        raise InputError(f"{file}: line {number}: a conversation of several turns ({roles}): a row is one system "
                         "prompt and one user message (few-shot turns go in the job's prompts.examples)")
    # Every system and developer message, in order (OpenAI's newer clients send the instructions as
    # "developer"). None: an empty system prompt (the rows group together, with none).
    system = "\n\n".join(text for _, text in instructions if text)
    # no text (only images, or null): a null text, as a missing message is (refused, or with
    # on_bad_row: store, stored failed): an empty prompt would be run and stored ok
    user = (turns[0][1] or None) if turns and turns[0][0] == "user" else None
    # a null custom_id is the input's null id: refused, or rejected with input.on_bad_row: store
    return {"custom_id": None if custom_id is None else str(custom_id), "system": system, "user": user}


def _text(content) -> str:
    """A message's text: a string, or the text parts of a list of content parts, each on a line of
    its own as vLLM joins them for a template that takes text (null: none)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part if isinstance(part, str) else part["text"] for part in content
                     if isinstance(part, str) or part.get("type") == "text")


def batches(file: str, batch_rows: int) -> Iterator:
    """Arrow record batches of at most batch_rows requests, read line by line (bounded memory)."""
    import pyarrow as pa

    schema = pa.schema([(c, pa.string()) for c in COLUMNS])
    rows: list[dict] = []
    with io.BufferedReader(pa.input_stream(file, compression="detect")) as fh:  # .gz and .bz2 by the ending
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
