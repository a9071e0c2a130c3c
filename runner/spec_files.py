"""Reading the job's YAML files and saying what is wrong in them: one line, `FILE: field: why`,
with the key a misspelt one is close to. Raw text stops here; spec.py validates what it returns."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, get_args

import yaml
from pydantic import BaseModel, ValidationError

from runner.errors import SpecError


def format_validation_error(file: Path, exc: ValidationError, prefix: str = "") -> str:
    """One line: `FILE: field.path: message` for the first error, with a count of the rest."""
    import difflib

    # An unknown key first: a misspelt one (id_colum) is why its field is "required" beside it.
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    # a union's member names its errors (speculative.SpeculativeSpec.method, speculative.literal['auto']):
    # the user's file has no such key
    loc = ".".join(str(p) for p in first["loc"] if not _union_member(p))
    loc = prefix + loc if loc else prefix.rstrip(".") or "(top level)"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        missing = [str(e["loc"][-1]) for e in errors if e["type"] == "missing" and e["loc"][:-1] == first["loc"][:-1]]
        # a required key left missing first (it is why that key is missing), then any key of the section
        close = (difflib.get_close_matches(str(first["loc"][-1]), missing, n=1)
                 or difflib.get_close_matches(str(first["loc"][-1]), _keys_at(exc.title, first["loc"][:-1]), n=1))
        if not close and len(first["loc"]) == 1 and str(first["loc"][0]) in _keys_at(exc.title, ("engine",)):
            close = [f"engine.{first['loc'][0]}"]  # an engine setting at the job's top level (verify: ...)
        msg = "unknown key" + (f"; did you mean {close[0]}?" if close else "")
    elif first["type"] in _PARSING:
        msg += _got(first.get("input"))
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{file}: {loc}: {msg}{more}"


_PARSING = ("int_parsing", "int_from_float", "float_parsing", "bool_parsing", "int_type", "float_type")


def _got(value: Any) -> str:
    """What the file gave, for an error about its type: PyYAML reads `1e9` and `1.0e9` (a number
    with an exponent but no dot, or no sign after the e) as text."""
    import re

    if not isinstance(value, (str, int, float)) or len(repr(value)) > 40:
        return ""
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d+(\.\d*)?[eE][+-]?\d+", value.strip()):
        number = float(value)
        plain = f"{int(number)}" if number.is_integer() and abs(number) < 1e18 else f"{number}"
        return f" (given the text {value!r}: YAML reads this form of a number as text; write {plain})"
    return f" (given {value!r})"


def _union_member(part: Any) -> bool:
    """Whether a part of a pydantic error location is a union member's tag (one of the runner's
    models, or a literal), not a key: a user's own key (MaxNumSeqs, an env variable) stays."""
    if not isinstance(part, str):
        return False
    return part.startswith("literal[") or part in _model_names()


def _keys_at(model_name: str, loc: tuple) -> list[str]:
    """The keys of the section at `loc` in the runner's model `model_name` (JobFile, EngineConfig),
    following its fields and union tags; none where the walk leaves the runner's models."""
    models = _models()
    cls = models.get(model_name)
    for part in loc:
        if cls is None:
            return []
        if isinstance(part, str) and part in models:  # a union member's tag: that member's section
            cls = models[part]
            continue
        if isinstance(part, int):  # an item of a list of sections (calibration.candidates.0)
            continue
        field = cls.model_fields.get(part)
        cls = _section_model(field.annotation) if field else None
    return list(cls.model_fields) if cls else []


def _section_model(annotation: Any) -> Optional[type]:
    """The runner's model a field holds, directly or as the items of a list (or an Optional of either)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for a in get_args(annotation) if (m := _section_model(a)) is not None), None)


def _model_names() -> set[str]:
    return set(_models())


def _models() -> dict[str, type]:
    found, todo = {}, [BaseModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("runner.") and sub.__name__ not in found:
                found[sub.__name__] = sub
            todo.append(sub)
    return found


class _UniqueKeys(yaml.SafeLoader):
    """YAML as safe_load reads it, but a key given twice in one mapping is refused: safe_load keeps
    the last silently (a second `sampling:` block dropped the first's settings)."""

    def construct_mapping(self, node, deep=False):
        self._refuse_repeats(node, deep)
        return super().construct_mapping(node, deep)

    def _refuse_repeats(self, node, deep: bool) -> None:
        seen: dict[Any, tuple[str, int]] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden here
                # An inline source (`<<: {a: 1, a: 2}`) is flattened into this mapping without being
                # constructed as one: check it here (an alias's mapping is checked again: the same answer).
                sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for source in sources:
                    if isinstance(source, yaml.MappingNode):
                        self._refuse_repeats(source, deep)
                continue
            key, line = self.construct_object(key_node, deep=deep), key_node.start_mark.line + 1
            try:
                if key in seen:
                    first, first_line = seen[key]
                    # `on` and `true`, or 1 and true, are one key once read: the second replaced the first.
                    what = (f"{key} is given twice" if first == key_node.value else
                            f"{first} and {key_node.value} are one key once read ({key!r})")
                    raise yaml.constructor.ConstructorError(
                        None, None, f"{what} (lines {first_line} and {line})", key_node.start_mark)
                seen[key] = (key_node.value, line)
            except TypeError:  # an unhashable key: the base class says so
                return


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping, or raise SpecError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read: {exc}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeys)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"{path}: invalid YAML: {where}{problem}") from None
    if data is None:
        raise SpecError(f"{path}: the file is empty (no YAML keys)")
    if not isinstance(data, dict):
        raise SpecError(f"{path}: (top level): expected a mapping of keys, got {type(data).__name__}")
    return data


def resolve_relative(base: Path, rel: str) -> Path:
    """A path the job gives, relative to its folder `base` unless absolute (`~` expanded)."""
    p = Path(rel).expanduser()
    return p if p.is_absolute() else (base / p).resolve()
