"""What commands that only read a job's results take from its job file without loading it: where
its results are (`job_results`), and which paths are the job's own, for exports and reports not to
overwrite (`job_sources`). The job's schema, engine config, model and input need not be there."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runner.errors import SpecError
from runner.overrides import apply_overrides
from runner.spec import JobFile, OutputSpec
from runner.spec_files import format_validation_error, read_yaml, resolve_relative


def job_results(path: str | Path, overrides: Sequence[str] = ()) -> tuple[Path, str]:
    """(results database, job name) of a job file, for commands that only read or prune its
    results: its schema, engine config, model and input need not be there any more."""
    shown = Path(path)
    raw = apply_overrides(read_yaml(shown), overrides)
    try:
        spec = JobFile.model_validate(raw)
    except ValidationError as exc:
        # A key of the file's that no longer validates (a typo, or one a newer runner renamed) must
        # not keep its stored results from being read: the name and the output section are what
        # these commands use, and they stay checked, as does every --set (`output.databse=...` would
        # read another database than meant).
        with_set = f" (with --set {' --set '.join(overrides)})" if overrides else ""
        if _given_by_set(exc, overrides):
            raise SpecError(format_validation_error(shown, exc) + with_set) from None
        try:
            spec = _JobResults.model_validate(raw)
        except ValidationError as part:  # what these commands read is wrong: that is the error
            raise SpecError(format_validation_error(shown, part) + with_set) from None
    return resolve_relative(shown.resolve().parent, spec.output.database), spec.name


def _given_by_set(exc: ValidationError, overrides: Sequence[str]) -> bool:
    """Whether one of the errors is at (or within, or above) a key that --set gave."""
    keys = [o.split("=", 1)[0].strip() for o in overrides]
    for err in exc.errors():
        at = ".".join(str(p) for p in err["loc"])
        if any(at == k or at.startswith(k + ".") or k.startswith(at + ".") for k in keys):
            return True
    return False


class _JobResults(BaseModel):
    """What job_results reads of a job file whose other keys do not validate."""

    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    output: OutputSpec


def _text(raw: Any, *keys: str) -> Optional[str]:
    """raw[k1][k2]... where it is text, else None."""
    for k in keys:
        raw = raw.get(k) if isinstance(raw, dict) else None
    return raw if isinstance(raw, str) and raw else None


def job_sources(path: str | Path, overrides: Sequence[str] = ()) -> Callable[[Path], Optional[str]]:
    """A test of a path an export or report would write: what of the job's own it is (the job, its
    schema, engine config, prompt files, an input file, or a file its input path would read next
    time), or None. Parts the job no longer names readably are left out: this only guards."""
    import contextlib

    from runner.input_paths import EXTENSIONS, input_files, would_read

    shown = Path(path)
    base = shown.resolve().parent
    files = {shown.resolve(): "the job file"}
    input_path = None
    with contextlib.suppress(Exception):  # a job that does not read: its own file is guarded still
        # Read key by key, not validated: a key elsewhere that no longer validates (stats and export
        # still read such a job) must not drop the guards.
        raw = apply_overrides(read_yaml(shown), overrides)
        named = {"the job's output_schema": _text(raw, "output_schema"),
                 "the job's engine.config": _text(raw, "engine", "config"),
                 "the job's prompts.system_file": _text(raw, "prompts", "system_file"),
                 "the job's prompts.chat_template": _text(raw, "prompts", "chat_template")}
        files.update({resolve_relative(base, p).resolve(): what for what, p in named.items() if p})
        fmt = _text(raw, "input", "format")
        if _text(raw, "input", "path"):  # an unknown format: every known ending, the cautious reading
            input_path = (str(resolve_relative(base, _text(raw, "input", "path"))), fmt if fmt in EXTENSIONS else None)
        with contextlib.suppress(Exception):
            files.update({Path(f).resolve(): "one of the job's input files" for f in input_files(*input_path)})

    def guard(target: Path) -> Optional[str]:
        absolute = os.path.abspath(target)  # the link itself, in its folder's real place
        given = Path(os.path.realpath(os.path.dirname(absolute))) / os.path.basename(absolute)
        target = target.resolve()
        if target in files:
            return files[target]
        # the link itself too: a write through a link in the input folder (dangling now, or to a
        # file outside) leaves a file the next run reads there
        if input_path and any(would_read(str(t), *input_path) for t in {target, given}):
            return "where the job's input.path reads its files: the next run would read it as input"
        return None
    return guard
