"""`--set KEY=VALUE` on the command line: job settings for one command."""
from __future__ import annotations

import re
from typing import Any, Sequence

import yaml

from runner.errors import SpecError


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """The job's mapping with each `dotted.key=value` set (the value read as YAML: 64, true, null)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise SpecError(f"--set {item}: expected KEY=VALUE, e.g. --set engine.max_num_seqs=64")
        value = _value(text)
        node = raw
        for i, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                raise SpecError(f"--set {item}: {'.'.join(parts[:i + 1])} is not a section")
            node = node[part]
        if value and isinstance(value, dict) and isinstance(node.get(parts[-1]), dict) and \
                not (parts[-1] == "speculative" and "method" in value):
            # a whole section, at any depth: key by key, as dotted keys would set it; except `{}`,
            # which empties it, and a speculative setting that names its `method`, whose options
            # are that method's own (a draft's `model` left from the job's would go to ngram)
            _merge(node[parts[-1]], value)
        else:
            node[parts[-1]] = value
    return raw


def _merge(section: dict, value: dict) -> None:
    for k, v in value.items():
        if isinstance(v, dict) and isinstance(section.get(k), dict):
            _merge(section[k], v)
        else:
            section[k] = v


def _value(text: str) -> Any:
    """A value as YAML reads it (64, true, null, [a, b]), except where YAML would turn text into a
    structure the user did not write as one: `Note: be brief` and `{title}: {text}` stay text."""
    stripped = text.strip()
    try:
        if _comment_dropped(text):  # ` #1 priority` reached us quoted from the shell: it is the user's text
            return stripped
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # `[a, b` is a list with its end missing, not a stop string; `[INST] {text}` is text
        for start, end in (("[", "]"), ("{", "}")):
            if stripped.startswith(start) and end not in stripped:
                raise SpecError(f"--set value {text!r}: not valid YAML ({str(exc).splitlines()[0]})") from None
        return text
    if isinstance(value, list) and not stripped.startswith("[") or \
            isinstance(value, dict) and not _is_flow_mapping(stripped, value):
        return text
    return value


def _comment_dropped(text: str) -> bool:
    """Whether YAML would read part of the value as a comment (`Reply in English #1 priority`,
    `#1`): the shell passed it on, so the user quoted it, and it is text they meant."""
    if "\n" in text.strip():  # a block of YAML (`|` and its lines): comment lines are YAML's there
        return False
    node = yaml.compose(text)
    end = len(text.rstrip())
    return end > 0 and (node is None or node.end_mark.index < end)


def _is_flow_mapping(text: str, value: dict) -> bool:
    """`{a: 1}` is a mapping; `{title}: {text}`, `{text}` and `{text:>20}` (templates) are text that
    YAML happens to parse (the last two as {"text": null} and {"text:>20": null}: keys without
    values, which no setting is)."""
    if not (text.startswith("{") and text.endswith("}") and text.count("{") == 1):
        return False
    # `{a: null}` is a mapping (a colon and a space, as YAML needs one); `{text:>20}` has none
    return not (value and all(v is None for v in value.values()) and not re.search(r":\s", text))
