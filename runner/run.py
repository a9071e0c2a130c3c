"""Running a job: job spec → plan (groups, order) → engine → checked results → store.

Orchestration only: the lock, the engines, signals and the run's record. What is left to do
(resume) is decided in runner/resume.py, requests are built in runner/requests.py, finished rows handled in runner/collect.py,
engines started in runner/engines/sequence.py and calibrated in runner/engines/calibrate.py.
Results are committed every `output.commit_every_rows` rows; a kill loses at most that batch.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional

from runner.collect import Progress, ResultCollector
from runner.engines import Engine, build_engine
from runner.engines.calibrate import CalibrationContext, calibrate
from runner.engines.sequence import EngineSequence
from runner.engines.vllm_settings import job_with_grammar
from runner.errors import SpecError
from runner.fingerprint import calibration_key, prompt_keys
from runner.inputs import InputScan
from runner.lock import JobLock
from runner.prompting import PromptBuilder, builder_for, check_first_prompt
from runner.readers import LocalReader
from runner.requests import RequestBuilder, build_ahead
from runner.rows import StatsRow, Status
from runner.signals import Interrupted, sigterm_interrupts, stops_deferred
from runner.spec import Job
from runner.resume import Work, restart, shared_name, work_to_do
from runner.store import Store
from runner.summary import plural
from runner.verify import verify_gate


@dataclass
class RunOptions:
    """How to run a job: the CLI's flags, and the seams tests use."""

    restart: bool = False  # set the job's stored results aside (results_history) first
    retry_failed: bool = False  # run the rows that are not ok (ok rows stay, whatever made them)
    recalibrate: bool = False  # measure `speculative: auto` again instead of reusing a stored choice
    wait: bool = False  # wait for a running instance of the job instead of failing
    log_path: Optional[str] = None  # where the engine's output goes (stored with the run)
    progress_factory: Optional[Callable[[int], Progress]] = None
    on_input_ok: Optional[Callable[[], None]] = None  # once input, model, lock and database are fine
    notify: Optional[Callable[[str], None]] = None  # told what the run will redo, before it starts
    verify_gate: bool = True  # a speculative setting whose stored verification failed is not used
    backend: str = "vllm"  # what engine_factory builds: calibrations and verdicts are keyed by it
    exits_after: bool = False  # the caller ends the process after a completed run (the CLI): see Engine.let_go
    clock: Callable[[], float] = time.perf_counter
    # (clock() when the command began, where it was read: "process" for the CLI); None: the call
    started: Optional[tuple[float, str]] = None
    lock_wait_s: float = 0.0  # set by the run: how long it waited for another run of the job (--wait)

    def __post_init__(self) -> None:
        if self.restart and self.retry_failed:  # one redoes every row, the other keeps the ok ones
            raise SpecError("--restart and --retry-failed cannot be used together: --restart runs every row "
                            "again, --retry-failed only the rows that are not ok")


@dataclass
class RunSummary:
    run_id: int
    database: str
    rows_input: int
    rows_skipped: int
    counts: dict[str, int]  # this run's rows by status
    stats: dict
    rows_redone: int = 0  # stored rows run again: made by another version of the job, or --retry-failed
    redo_reasons: list[str] = field(default_factory=list)  # what changed, e.g. "sampling.max_tokens"
    job_counts: dict[str, int] = field(default_factory=dict)  # the input's stored rows by status
    rows_rejected: int = 0  # input rows left out (on_bad_row: store): null or repeated ids
    input_limit: Optional[int] = None  # input.limit (--limit): rows_input counts the rows taken, not the input's
    rows_documents_cut: int = 0  # rows run with their document cut to fit (input.on_too_long: truncate)

    @property
    def rows_judged(self) -> int:
        """The input's rows output.max_failed_fraction is judged on: stored, or left out (on_bad_row: store)."""
        return sum(self.job_counts.values()) + self.rows_rejected

    @property
    def rows_not_ok(self) -> int:
        return self.rows_judged - self.job_counts.get(Status.OK.value, 0)

    @property
    def failed_fraction(self) -> float:
        return self.rows_not_ok / self.rows_judged if self.rows_judged else 0.0


def run_job(job: Job, engine_factory: Callable[[Job], Engine] = build_engine, options: Optional[RunOptions] = None,
            **kw) -> RunSummary:
    """Run a job to completion (or resume it). Raises RunnerError subclasses; never prints.

    Rows stored by this version of the job are skipped; rows made by another version (a changed
    schema, prompt, sampling...) run again and the old results move to results_history. Options:
    RunOptions, or its fields as keywords."""
    opts = options or RunOptions(**kw)
    with sigterm_interrupts():
        return _run(job, engine_factory, opts)


def _run(job: Job, engine_factory: Callable[[Job], Engine], opts: RunOptions) -> RunSummary:
    # Bad input or a missing model stops the run here, before anything is written.
    reader = LocalReader(job.input_path, job.spec.input)
    scan = reader.scan(keep_ids=True)  # the driver checks its input
    try:
        builder = builder_for(job)
        # a chat template that refuses the first row stops the run, as it stops validate and plan
        check_first_prompt(job, builder, reader.documents(job.system_source, scan.skip))
        t_lock = opts.clock()
        with JobLock(job.database_path, job.name, wait=opts.wait, on_wait=opts.notify):
            opts = replace(opts, lock_wait_s=opts.clock() - t_lock)
            store = Store(job.database_path)
            try:
                return _run_locked(job, scan, builder, store, engine_factory, opts)
            finally:
                store.close()  # the last connection checkpoints the WAL into the database file
    finally:
        scan.ids.close()


def _why_redone(work: Work) -> str:
    """Why a run without --restart or --retry-failed runs stored rows again."""
    aside = f"{work.set_aside:,} set aside by a --restart that stopped before it ran them" if work.set_aside else ""
    if work.redone <= work.set_aside:
        return aside
    changed = " (changed: " + ", ".join(work.reasons) + ")" if work.reasons else ""
    return (aside + "; the others " if aside else "they ") + f"were made by another version of the job{changed}"


def _run_locked(job: Job, scan: InputScan, builder: PromptBuilder, store: Store,
                engine_factory: Callable[[Job], Engine], opts: RunOptions) -> RunSummary:
    store.check_integrity()
    if opts.on_input_ok is not None:
        opts.on_input_ok()
    store.mark_abandoned_runs(job.name)  # first: a killed run ended at its last stored row, set aside below
    restarted = restart(store, job, scan) if opts.restart else None
    # the fingerprint has the backend as configured; the rows --restart marked count as not done
    work = work_to_do(store, job, scan, opts.retry_failed)
    for note in work.notes if opts.notify is not None else ():
        opts.notify(note)
    shared = shared_name(store, job, work.fingerprint)
    if shared:
        work.notes.append(shared)
        if opts.notify is not None:
            opts.notify(shared)
    try:
        job, work.grammar = job_with_grammar(job)  # one backend for every engine; measured while vLLM imports
        if work.redone and opts.notify is not None:
            opts.notify(f"running {plural(work.redone, 'stored row')} again: " + (
                restarted if restarted else "--retry-failed" if opts.retry_failed else _why_redone(work)))
        key = calibration_key(job, prompt_keys(job, scan), opts.backend)
        job, gated = verify_gate(job, store, key, opts.verify_gate, opts.notify)
        if gated:
            work.notes.append(gated)
        summary = _run_recorded(job, scan, builder, store, engine_factory, opts, work, key, lambda: store.begin_run(
            job.name, str(job.path), job.snapshot() | {"fingerprint": work.fingerprint}, opts.log_path))
    finally:
        work.is_done.close()
    summary.rows_input, summary.rows_skipped, summary.rows_rejected = scan.rows, work.skipped, len(scan.skip)
    summary.input_limit = job.spec.input.limit
    summary.rows_redone, summary.redo_reasons = work.redone, work.reasons
    summary.job_counts = store.input_status_counts(job.name, scan.ids.path)
    return summary


def _run_recorded(job: Job, scan: InputScan, builder: PromptBuilder, store: Store,
                  engine_factory: Callable[[Job], Engine], opts: RunOptions, work: Work, key: dict,
                  begin: Callable[[], int]) -> RunSummary:
    """The run from its row (`begin` makes it): whatever stops it, the row ends interrupted or
    failed, with the stats of the rows it stored (a nightly run stopped at its deadline still shows
    its speed)."""
    partial: dict = {}  # where _execute and _generate leave a stopped run's stats and speculation choice
    run_id = None
    try:
        with stops_deferred():  # the row and its id together: a stop between left the row `running`
            run_id = begin()
        if scan.skip:
            store.save_rejected(run_id, job.name, scan.rejected)
            if opts.notify is not None:
                opts.notify(f"{plural(len(scan.skip), 'input row')} left out (null or repeated ids; input.on_bad_row: store): "
                            f"see the rejected_rows table of {job.database_path}")
        ctx = CalibrationContext(store, key, work.todo, run_id, force=opts.recalibrate, verify_gate=opts.verify_gate)
        engines = EngineSequence(engine_factory, clock=opts.clock, let_go_last=opts.exits_after,
                                 on_start=lambda info: store.set_engine(run_id, info.backend, info.version, info.settings))
        return _execute(job, store, run_id, engines, builder, work, opts, ctx, partial)
    except BaseException as exc:
        if run_id is None:
            raise
        status = "interrupted" if isinstance(exc, (Interrupted, KeyboardInterrupt)) else "failed"
        error = "stopped by Ctrl-C (SIGINT); finished rows are stored, rerun to resume" \
            if isinstance(exc, KeyboardInterrupt) else str(exc) or exc.__class__.__name__
        # A stop while a failure is recorded would leave the row `running` and lose the error: the
        # process ends with this failure anyway. (A completed run stays completed: finish_run.)
        with stops_deferred(raise_after=False):
            store.finish_run(run_id, status, stats=partial.get("stats"), error=error, if_running=True)
        raise


def _execute(job: Job, store: Store, run_id: int, engines: EngineSequence, builder: PromptBuilder, work: Work,
             opts: RunOptions, ctx: CalibrationContext, partial: dict) -> RunSummary:
    clock = engines.clock
    t_run = clock()
    # waiting for another run of the job (--wait) is not this run's time
    t_start, wall_from = (t_run, "call") if opts.started is None else \
        (min(opts.started[0] + opts.lock_wait_s, t_run), opts.started[1])
    progress = opts.progress_factory(work.todo) if opts.progress_factory and work.todo else None
    if progress is not None and hasattr(progress, "engine_started"):
        engines.on_start = _and_then(engines.on_start, progress.engine_started)
    collector = ResultCollector(job, store, run_id, RequestBuilder(job, builder), progress, work.fingerprint,
                                clock=clock)
    ahead = build_ahead(job, collector.rb, work.is_done, work.skip) if work.todo else None
    source = collector.requests(ahead if ahead is not None else iter(()))
    choice, completed = None, False
    try:
        if work.todo:  # every row is stored already: a rerun from cron costs no engine start
            choice = _generate(job, engines, collector, source, ctx, partial)
        completed = True
    finally:
        try:
            try:
                if ahead is not None:  # the reading thread stops here, read to the end or not
                    ahead.close()
                collector.flush()  # rows that finished before a failure or a signal are kept
            finally:  # a flush that failed (a full disk) must not leave the engine running
                engines.stop(completed)
        finally:  # also where storing failed: the Error: line then starts a line of its own
            if progress is not None and hasattr(progress, "close"):
                progress.close()
        timing = {"wall_s": clock() - t_start, "before_run_s": t_run - t_start, "wall_from": wall_from}
        if not completed:
            # What the stopped run did, if only start an engine (its own failure must not hide the one
            # that stopped it). No plan bound: the plan holds rows built ahead that never ran. Rows
            # run again: those it replaced.
            with contextlib.suppress(Exception):
                partial["stats"] = _stats(collector, engines, work, opts, partial.get("choice"), timing,
                                          plan_share=None, redone=store.rows_replaced_by(run_id))
    plan_share = collector.rb.plan().prefix_share if work.todo else None  # an idle run planned nothing
    stats = _stats(collector, engines, work, opts, choice, timing, plan_share, work.redone)
    store.finish_run(run_id, "completed", stats=stats)
    return RunSummary(run_id, str(job.database_path), 0, 0, dict(collector.counts), stats.as_dict(),
                      rows_documents_cut=collector.documents_cut)


def _and_then(on_start: Optional[Callable], then: Callable[[], None]) -> Callable:
    """An engine-start callback that calls `on_start(info)` (if any), then `then()`."""
    def both(info) -> None:
        if on_start is not None:
            on_start(info)
        then()
    return both


def _stats(collector: ResultCollector, engines: EngineSequence, work: Work, opts: RunOptions, choice: Optional[dict],
           timing: dict, plan_share: Optional[float], redone: int) -> StatsRow:
    """The run's stats row: throughput, cache hits, tokens, and how the engine was chosen and started."""
    stats = StatsRow.build(collector.counts, collector.tokens, engines.used, wall_s=timing["wall_s"],
                           load_s=engines.load_s, gen_s=engines.gen_s, plan_share=plan_share,
                           skipped=work.skipped, redone=redone)
    stats.engine_choice_json = json.dumps({"speculative_calibration": choice, "engines": engines.adaptations,
                                           "engine_starts_s": [round(x, 3) for x in engines.starts],
                                           "runner_loop": collector.times(), "notes": work.notes,
                                           "grammar": work.grammar, "before_run_s": round(timing["before_run_s"], 3),
                                           "wall_from": timing["wall_from"], "lock_wait_s": round(opts.lock_wait_s, 3),
                                           "spec_acceptance_by_position": _by_position(engines.used)})
    return stats


def _by_position(used) -> list[float]:
    """Share of drafts whose i-th token was accepted (vLLM counts them per position)."""
    return [round(a / used.spec_drafts, 4) for a in used.spec_accepted_per_pos] if used.spec_drafts else []


def _generate(job: Job, engines: EngineSequence, collector: ResultCollector, source: Iterator,
              ctx: CalibrationContext, partial: dict) -> Optional[dict]:
    """Start the engine (choosing speculation with `speculative: auto`), run every row, then the
    retries. Returns the calibration record, if any (also left in `partial`, for a run stopped later)."""
    choice = None
    if job.engine.speculative == "auto":
        choice, source = calibrate(job, engines, collector, source, ctx)
        partial["choice"] = choice
    else:
        engines.start(job)
    while True:
        engines.run(collector, source)
        if not collector.retries:
            return choice
        source = collector.pop_retries()
