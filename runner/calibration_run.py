"""`runner calibrate JOB`: the job's speculation measured on its own rows, done or not, and the
choice stored for later runs; nothing is written to the job's results. The same engines and
calibration as a run's first minutes (runner/engines/calibrate.py), under the job's lock."""
from __future__ import annotations

import time
from typing import Callable

from runner.collect import ResultCollector
from runner.engines import Engine, build_engine
from runner.engines.calibrate import CalibrationContext, calibrate
from runner.engines.sequence import EngineSequence
from runner.engines.vllm_settings import job_with_grammar
from runner.fingerprint import calibration_key, prompt_keys
from runner.lock import JobLock
from runner.prompting import builder_for
from runner.readers import LocalReader
from runner.requests import RequestBuilder, build_ahead
from runner.signals import sigterm_interrupts
from runner.spec import Job
from runner.store import Store


def calibrate_job(job: Job, *, engine_factory: Callable[[Job], Engine] = build_engine, wait: bool = False,
                  clock: Callable[[], float] = time.perf_counter, backend: str = "vllm") -> dict:
    """`runner calibrate`: measure the job's speculation on its own rows (done or not) and store the
    choice for later runs (keyed by `backend`, what engine_factory builds). Nothing is written to
    the job's results."""
    with sigterm_interrupts():
        return _calibrate(job, engine_factory, wait, clock, backend)


def _calibrate(job: Job, engine_factory: Callable[[Job], Engine], wait: bool, clock: Callable[[], float],
               backend: str) -> dict:
    job, _ = job_with_grammar(job)  # one backend for its engines, as `runner run` decides it
    scan = LocalReader(job.input_path, job.spec.input).scan()
    builder = builder_for(job)
    with JobLock(job.database_path, job.name, wait=wait):
        store = Store(job.database_path)
        engines, ahead = EngineSequence(engine_factory, clock=clock), None
        try:
            collector = ResultCollector(job, store, None, RequestBuilder(job, builder), None, None,
                                        keep_results=False, clock=clock)
            ahead = build_ahead(job, collector.rb, None, scan.skip)
            ctx = CalibrationContext(store, calibration_key(job, prompt_keys(job, scan), backend), scan.rows, None, force=True)
            record, _ = calibrate(job, engines, collector, collector.requests(ahead), ctx)
        finally:
            if ahead is not None:
                ahead.close()
            engines.stop()
            store.close()
        return record
