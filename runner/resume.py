"""What a run will do, decided before it starts: the input's rows against what is stored (resume,
a changed job, --retry-failed), --restart's set-aside, and a job name that another job file shares."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from runner.fingerprint import changed_parts, result_fingerprint
from runner.inputs import InputScan
from runner.spec import Job
from runner.store import DoneFilter, Store
from runner.summary import plural


@dataclass
class Work:
    """What a run will do, decided before it starts."""

    fingerprint: str  # of the job as it is now: stored with every row it makes
    todo: int  # input rows to run
    skipped: int  # input rows already done
    redone: int  # stored rows to run again (another version of the job, or --retry-failed)
    reasons: list[str]  # what changed, e.g. "sampling.max_tokens"
    is_done: DoneFilter  # which rows of a batch to skip, asked of the database
    notes: list[str] = field(default_factory=list)  # what the run changed about the job, and why
    grammar: Optional[dict] = None  # how `structured_output_backend: measure` was decided
    skip: set[int] = field(default_factory=set)  # input row numbers rejected by the scan
    set_aside: int = 0  # of the rows redone: marked by a --restart that stopped before it ran them


def restart(store: Store, job: Job, scan: InputScan) -> str:
    """--restart marks the job's stored rows to be run again; returns a note saying so. Where
    input.limit (--limit) cut the input, only the rows this run takes: a smoke run does not undo
    the rest."""
    limited = scan.cut_by_limit
    marked, moved = store.set_aside_results(job.name, scan.ids.path, limited)
    note = f"--restart set {plural(marked, 'stored row')} aside: each stays stored until its new result replaces it"
    if limited:
        return note + "; input.limit: only the rows this run takes"
    return note + (f"; {moved:,} not in this run's input moved to results_history" if moved else "")


def work_to_do(store: Store, job: Job, scan: InputScan, retry_failed: bool) -> Work:
    """Count what the run will do against what is stored, on disk (bounded memory at any size)."""
    fingerprint, components = result_fingerprint(job)
    store.register_fingerprint(job.name, fingerprint, components)
    kept = keep_rows_the_length_rule_does_not_touch(store, job, fingerprint, components)
    counts = store.input_counts(job.name, scan.ids.path, fingerprint)
    skipped = counts.kept(retry_failed)
    redone = counts.stored - skipped
    reasons: set[str] = set()
    if redone and not retry_failed:
        known = store.fingerprint_components(job.name)
        stale = {e.get("fingerprint") for e in store.rows_by_fingerprint(job.name)} - {fingerprint, None}
        for fp in stale & set(known):
            reasons.update(changed_parts(known[fp], components))
    work = Work(fingerprint, scan.rows - skipped, skipped, redone, sorted(reasons),
                store.done_filter(job.name, fingerprint, ok_only=retry_failed), skip=scan.skip,
                set_aside=counts.set_aside)
    if not counts.stored and (renamed := renamed_from(store, job, scan, fingerprint)):
        work.notes.append(renamed)
    if kept:
        work.notes.append(f"input.on_too_long or engine.max_model_len changed: {plural(kept, 'stored row')} that it "
                          "does not change kept (neither cut nor too long)")
    return work


def renamed_from(store: Store, job: Job, scan: InputScan, fingerprint: str) -> Optional[str]:
    """A note where no row of the job is stored, but most of its input's rows are stored under
    another job name, made exactly as this job makes them: rows are kept per job name, so a
    renamed job runs them all again. (Two jobs alike but for their inputs share no ids: no note.)"""
    others = store.same_rows_elsewhere(job.name, scan.ids.path, fingerprint)
    if not others or others[0][1] < 0.9 * scan.rows:
        return None
    name, rows = others[0]
    return (f"no row of job {job.name} is stored, but {rows:,} of its {plural(scan.rows, 'input row')} are stored "
            f"under job {name} in {job.database_path}, made exactly as this job makes them (renamed?): they are not "
            f"reused; set `name: {name}` to resume them")


LENGTH_RULE = {"on_too_long", "engine.max_model_len"}  # what decides which rows are cut or too long, and no more


def length_rule_changes(store: Store, job: Job, fingerprint: str, components: dict) -> list[tuple[str, int]]:
    """(fingerprint, room) of each of the job's stored versions that differ from this one in
    input.on_too_long or engine.max_model_len alone, with the longest prompt a row of it may have
    to be kept: one that fitted it whole and was not cut was made as it would be now, its prompt and
    max_tokens within both that version's length and this one's."""
    max_tokens = job.spec.sampling.max_tokens  # the same in both: sampling is not in LENGTH_RULE
    room = job.engine.max_model_len - max_tokens
    out = []
    for fp, old in store.fingerprint_components(job.name).items():
        old_length = (old.get("engine") or {}).get("max_model_len")
        if fp != fingerprint and set(changed_parts(old, components)) <= LENGTH_RULE and isinstance(old_length, int):
            out.append((fp, min(room, old_length - max_tokens)))  # too long then (failed, or cut): run again
    return out


def keep_rows_the_length_rule_does_not_touch(store: Store, job: Job, fingerprint: str, components: dict) -> int:
    """Where input.on_too_long or engine.max_model_len is all that changed, the stored rows it
    cannot change (their prompt fitted whole, and fits now) take the new fingerprint instead of
    running again; the rows it was applied to (cut, or failed as too long) run again. Returns how
    many were kept."""
    return sum(store.adopt_uncut_rows(job.name, fp, fingerprint, room)
               for fp, room in length_rule_changes(store, job, fingerprint, components))


def shared_name(store: Store, job: Job, fingerprint: str) -> Optional[str]:
    """A note where the job's name was last run, by another version of it, from another job file
    that still names this job and database: the two share its rows by id, each redoing those the
    other made differently. (Copies that make the same rows share them harmlessly: no note.)"""
    import json

    from runner.errors import SpecError
    from runner.unloaded_job import job_results

    last = store.latest_runs(job.name)
    if not last or not last[0]["job_path"]:
        return None
    other = Path(last[0]["job_path"])
    try:
        if not other.exists() or other.samefile(job.path):
            return None
        same_place = job_results(other) == (job.database_path, job.name)
    except (OSError, SpecError):  # gone or unreadable meanwhile: not a job that shares this one
        return None
    if not same_place or json.loads(last[0]["config_json"] or "{}").get("fingerprint") in (fingerprint, None):
        return None
    return (f"job {job.name} in {job.database_path} was last run from another job file, {other}, which makes its "
            "rows differently: the two share its stored rows by id, each redoing the other's; give one of them "
            "another `name:` to keep their results apart")
