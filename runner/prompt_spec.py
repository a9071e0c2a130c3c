"""The job's `prompts:` section: system prompt (fixed, from a file, or a template over row fields),
the user message template, few-shot turns, and the chat template with its variables.

`load_prompts` checks it against the input's columns and reads the files it names; every problem
is one SpecError naming the job file and the field.
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field

from runner.engine_config import Strict
from runner.errors import SpecError

RESERVED_TEMPLATE_VARIABLES = {"messages", "tools", "documents", "add_generation_prompt"}
NEW_FIELD_DEFAULTS = {"system_template": None, "examples": [], "chat_template": None, "chat_template_kwargs": {}}


class Turn(Strict):
    """One few-shot turn: placed after the system prompt, so it stays in the shared prefix."""

    role: Literal["user", "assistant"]
    content: str


class PromptSpec(Strict):
    system: Optional[str] = None
    system_file: Optional[str] = None
    system_template: Optional[str] = Field(default=None, description=(
        "a system prompt per row, from columns: 'You extract {kind} records.' (str.format; fields from "
        "input.extra_columns); rows that render the same prompt share a group"))
    user_template: str = "{text}"
    examples: list[Turn] = Field(default=[], description="few-shot user/assistant turns after the system prompt")
    chat_template: Optional[str] = Field(default=None, description="a Jinja file that replaces the model's chat template")
    chat_template_kwargs: dict[str, Any] = Field(default={}, description="variables for the chat template")

    def fingerprint_dump(self) -> dict:
        """The fields that make results, as stored before the newer fields existed when those
        are unset (results made by an older runner keep their fingerprint)."""
        dump = self.model_dump(mode="json", exclude={"system_file", "chat_template"})
        return {k: v for k, v in dump.items() if k not in NEW_FIELD_DEFAULTS or v != NEW_FIELD_DEFAULTS[k]}


@dataclass
class LoadedPrompts:
    system_prompt: Optional[str]
    chat_template: Optional[str]  # the text of prompts.chat_template


def template_fields(template: str, field: str = "prompts.user_template") -> set[str]:
    """The placeholder names of a str.format template: plain fields with an optional format spec.
    Indexing and attribute access (`{title[0]}`, `{title.upper}`) would fail on real rows only."""
    try:
        parsed = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise SpecError(f"{field}: {exc}") from None
    for name, spec, conv in parsed:
        if conv not in (None, "r", "s", "a"):  # str.format would refuse it on every row
            raise SpecError(f"{field}: {{{name}!{conv}}}: unknown conversion !{conv} (use !r, !s or !a)")
        if not name or not name.isidentifier():
            raise SpecError(f"{field}: {{{name}}}: use a column name, as {{text}} or {{title:>20}}; "
                            f"indexing, attribute access and positional fields are not allowed")
        if "{" in (spec or ""):
            raise SpecError(f"{field}: {{{name}:{spec}}}: nested fields in a format spec are not allowed")
    return {name for name, _, _ in parsed}


def load_prompts(p: PromptSpec, base: Path, shown: Path, system_prompt_column: Optional[str],
                 extra_columns: list[str], text_column: str = "text") -> LoadedPrompts:
    """Check the prompts section and read the files it names."""
    given = [n for n in ("system", "system_file", "system_template") if getattr(p, n) is not None]
    if len(given) > 1:
        raise SpecError(f"{shown}: prompts: give one of system, system_file and system_template, not {' and '.join(given)}")
    if system_prompt_column and given:
        raise SpecError(f"{shown}: prompts: a system prompt is set and input.system_prompt_column too")
    system = p.system
    if p.system_file:
        system = _read(base, p.system_file, shown, "prompts.system_file")
    allowed = {"text", *extra_columns}
    fields = template_fields(p.user_template, f"{shown}: prompts.user_template")
    if not fields:  # the same words for every row: the documents would never reach the model
        raise SpecError(f"{shown}: prompts.user_template: uses no field; the document is {{text}}")
    unknown = fields - allowed
    if unknown:
        raise SpecError(f"{shown}: prompts.user_template: unknown field {{{sorted(unknown)[0]}}}; "
                        f"use text or one of input.extra_columns")
    system_fields: set[str] = set()
    if p.system_template is not None:
        system_fields = template_fields(p.system_template, f"{shown}: prompts.system_template")
        unknown = system_fields - set(extra_columns)
        if unknown:
            raise SpecError(f"{shown}: prompts.system_template: unknown field {{{sorted(unknown)[0]}}}; "
                            f"list the column in input.extra_columns")
    _check_the_document(shown, fields, system_fields, extra_columns, text_column)
    if p.examples and p.examples[-1].role != "assistant":
        raise SpecError(f"{shown}: prompts.examples: end with an assistant turn (the document is the next user turn)")
    reserved = sorted(set(p.chat_template_kwargs) & RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise SpecError(f"{shown}: prompts.chat_template_kwargs.{reserved[0]}: set by the runner, not by the job")
    template = _read(base, p.chat_template, shown, "prompts.chat_template") if p.chat_template else None
    return LoadedPrompts(system_prompt=system, chat_template=template)


def _check_the_document(shown: Path, user_fields: set[str], system_fields: set[str], extra_columns: list[str],
                        text_column: str) -> None:
    """The user template must send the document; an extra column named text must be used by the
    system template, since in the user template {text} is the document."""
    if "text" in extra_columns and text_column != "text" and "text" not in system_fields:
        raise SpecError(f"{shown}: input.extra_columns: text names the document ({text_column}) in templates, so "
                        "the column text cannot be used; make it input.text_column and list "
                        f"{text_column} in input.extra_columns")
    if not user_fields & {"text", text_column}:
        raise SpecError(f"{shown}: prompts.user_template: never uses {{text}}, the document (input.text_column: "
                        f"{text_column}): the model would not see it")


def _read(base: Path, rel: str, shown: Path, field: str) -> str:
    path = Path(rel).expanduser()
    path = path if path.is_absolute() else (base / path).resolve()
    try:  # a byte-order mark (Windows editors) is no part of the text: it would reach the model as tokens
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{shown}: {field}: {path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise SpecError(f"{shown}: {field}: cannot read {path}: {exc.strerror or exc}") from None
