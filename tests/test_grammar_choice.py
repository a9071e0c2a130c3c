"""structured_output_backend: measure: the guided-decoding backend whose token masks cost less for
the job's schema, measured once on an example output and cached."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from bench.workload import WORKLOADS
from runner.engine_config import EngineConfig
from runner.engines import grammar_choice
from runner.engines.grammar_choice import GrammarChoice, NoExample, choose, decide, example_output
from runner.engines.vllm_settings import llm_kwargs, resolve_grammar
from tests.conftest import SCHEMA

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = {"sample": json.loads((ROOT / "schemas" / "summarize.schema.json").read_text()), "tests": SCHEMA,
           "invoices": WORKLOADS["invoices"][2], "incidents": WORKLOADS["incidents"][2]}


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch):
    monkeypatch.setattr(grammar_choice, "_MEMO", {})


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_example_output_is_valid_under_the_schema(name):
    value = example_output(SCHEMAS[name])
    jsonschema.validate(value, SCHEMAS[name])
    # bounded strings are filled to their bound: the dear part of a bounded string's mask is measured
    bounded = [k for k, v in SCHEMAS[name]["properties"].items() if v.get("type") == "string" and "maxLength" in v]
    assert any(len(value[k]) >= min(SCHEMAS[name]["properties"][k]["maxLength"], 60) for k in bounded)


def test_a_schema_keyword_without_an_example_is_refused():
    with pytest.raises(NoExample, match="pattern"):
        example_output({"type": "object", "properties": {"d": {"type": "string", "pattern": "^[0-9]+$"}}})
    with pytest.raises(NoExample, match="anyOf"):
        example_output({"anyOf": [{"type": "string"}, {"type": "integer"}]})


def test_guidance_replaces_xgrammar_only_when_clearly_cheaper():
    assert decide({"xgrammar": 300.0, "guidance": 90.0})[0] == "guidance"
    assert decide({"xgrammar": 100.0, "guidance": 85.0})[0] == "xgrammar"  # within the margin: vLLM's default
    assert decide({"xgrammar": 5.0, "guidance": 12.0})[0] == "xgrammar"


def test_the_choice_is_measured_once_then_read_from_the_cache(tmp_path, tiny_model_dir, monkeypatch):
    calls = []

    def fake_measure(model_dir, schema):
        calls.append(model_dir)
        return {"xgrammar": 300.0, "guidance": 90.0}

    first = choose(tiny_model_dir, SCHEMA, tmp_path / "grammar", fake_measure)
    monkeypatch.setattr(grammar_choice, "_MEMO", {})  # a later process: only the file remains
    later = choose(tiny_model_dir, SCHEMA, tmp_path / "grammar", fake_measure)
    assert len(calls) == 1 and first.backend == later.backend == "guidance"
    assert not first.cached and later.cached and later.us_per_token == {"xgrammar": 300.0, "guidance": 90.0}
    # another schema is another key: measured again
    other = dict(SCHEMA, properties=dict(SCHEMA["properties"], extra={"type": "integer"}))
    choose(tiny_model_dir, other, tmp_path / "grammar", fake_measure)
    assert len(calls) == 2


def test_no_example_or_a_failing_backend_leaves_the_default_uncached(tmp_path, tiny_model_dir):
    def broken(model_dir, schema):
        raise RuntimeError("llguidance is not installed")

    choice = choose(tiny_model_dir, SCHEMA, tmp_path / "grammar", broken)
    assert choice.backend == "xgrammar" and "RuntimeError" in choice.reason
    assert not (tmp_path / "grammar").exists()
    patterned = {"type": "object", "properties": {"d": {"type": "string", "pattern": "^[0-9]+$"}}}
    assert choose(tiny_model_dir, patterned, tmp_path / "grammar", grammar_choice.measure).backend == "xgrammar"


def test_measure_in_the_engine_config_becomes_the_chosen_backend(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(grammar_choice, "measure", lambda model_dir, schema: {"xgrammar": 300.0, "guidance": 90.0})
    cfg = EngineConfig(model=str(tiny_model_dir))
    assert cfg.structured_output_backend == "measure"  # the default
    resolved, choice = resolve_grammar(cfg, tiny_model_dir, SCHEMA)
    kw = llm_kwargs(resolved, tiny_model_dir, 0)
    assert choice.backend == "guidance"
    assert kw["structured_outputs_config"] == {"backend": "guidance", "disable_any_whitespace": True}
    named = EngineConfig(model=str(tiny_model_dir), structured_output_backend="xgrammar")
    assert resolve_grammar(named, tiny_model_dir, SCHEMA) == (named, None)  # a named backend is kept


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["sample", "invoices"])
def test_both_backends_accept_the_example_with_the_real_tokenizer(model_dir, name):
    """The example output passes both real grammars token by token (a refusal raises NoExample)."""
    costs = grammar_choice.measure(model_dir, SCHEMAS[name])
    assert set(costs) == {"xgrammar", "guidance"} and all(v > 0 for v in costs.values())


def test_a_cache_that_cannot_be_written_or_read_never_stops_the_run(tmp_path, tiny_model_dir):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    choice = choose(tiny_model_dir, SCHEMA, blocked / "grammar", lambda m, s: {"xgrammar": 300.0, "guidance": 90.0})
    assert choice.backend == "guidance" and not choice.cached


def test_a_cached_choice_naming_another_backend_is_measured_again(tmp_path, tiny_model_dir):
    folder = tmp_path / "grammar"
    folder.mkdir()
    key = grammar_choice.cache_key(tiny_model_dir, SCHEMA)
    (folder / f"{key}.json").write_text(json.dumps({"backend": "outlines", "us_per_token": {}, "reason": "?"}))
    choice = choose(tiny_model_dir, SCHEMA, folder, lambda m, s: {"xgrammar": 5.0, "guidance": 12.0})
    assert choice.backend == "xgrammar" and not choice.cached
    assert json.loads((folder / f"{key}.json").read_text())["backend"] == "xgrammar"


def test_the_runners_own_interrupt_is_not_taken_for_a_failing_backend(tmp_path, tiny_model_dir):
    from runner.run import Interrupted

    def interrupted(model_dir, schema):
        raise Interrupted("SIGTERM")

    with pytest.raises(Interrupted):
        choose(tiny_model_dir, SCHEMA, tmp_path / "grammar", interrupted)


@pytest.mark.parametrize("schema, why", [
    ({"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 2}, "minItems 3 above maxItems 2"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 above maxLength 2"),
    ({"type": "integer", "minimum": 1.2, "maximum": 1.8}, "no integer"),
    ({"type": ["string", "null"]}, "type"),
    ({"enum": []}, "empty enum"),
    ({"type": "array", "items": [{"type": "string"}]}, "subschema"),
    ({"type": "object", "required": ["a"]}, "without properties"),
])
def test_schemas_without_an_example_keep_xgrammar_and_say_why(tmp_path, tiny_model_dir, schema, why):
    choice = choose(tiny_model_dir, schema, tmp_path / "grammar")
    assert choice.backend == "xgrammar" and why in choice.reason and choice.us_per_token == {}


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "string"}, "minItems": 3},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 0},
    {"type": "string", "maxLength": 300},
    {"type": "integer", "minimum": 100},
    {"type": "integer", "minimum": 1.5, "maximum": 3},
])
def test_example_output_meets_bounds_on_either_side(schema):
    value = example_output(schema)
    jsonschema.validate(value, schema)
    if schema.get("maxLength") == 300:
        assert len(value) >= 290  # filled to its bound: the bound is what makes masks dear


def test_the_result_fingerprint_has_the_backend_as_configured_the_calibration_key_as_chosen(
        tmp_path, make_job, monkeypatch):
    """A choice measured per machine must not redo a job's stored rows (as `speculative: auto`);
    a backend a config names other than xgrammar does. Calibration (speed) keys the backend run."""
    from runner.fingerprint import calibration_key, result_fingerprint
    from runner.spec import load_job

    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    keys, prints = {}, {}
    for picked in ("xgrammar", "guidance"):
        monkeypatch.setattr(grammar_choice, "_MEMO", {})
        monkeypatch.setattr(grammar_choice, "measure", lambda m, s, p=picked: {
            "xgrammar": 100.0, "guidance": 10.0 if p == "guidance" else 500.0})
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
        job = load_job(make_job(engine={"structured_output_backend": "measure"}))
        prints[picked], keys[picked] = result_fingerprint(job), calibration_key(job, [])
    assert prints["xgrammar"] == prints["guidance"] and "grammar" not in prints["guidance"][1]
    assert keys["guidance"]["engine"]["structured_output_backend"] == "guidance"
    assert keys["xgrammar"]["engine"]["structured_output_backend"] == "xgrammar"
    named = {b: result_fingerprint(load_job(make_job(engine={"structured_output_backend": b})))
             for b in ("xgrammar", "guidance")}
    assert "grammar" not in named["xgrammar"][1] and named["xgrammar"][0] == prints["xgrammar"][0]
    assert named["guidance"][1]["grammar"] == "guidance" and named["guidance"][0] != named["xgrammar"][0]


def test_a_number_bounded_only_above_gets_an_example():
    for schema in ({"type": "integer", "maximum": 10}, {"type": "number", "maximum": -3.5}):
        jsonschema.validate(example_output(schema), schema)


def test_a_run_with_a_measured_backend_stores_rows_that_later_commands_recognise(tmp_path, make_job, monkeypatch):
    """`runner run` gives its engines the measured backend but fingerprints the job as configured,
    so status and distill (which never measure for a run) find its rows; the decision is stored."""
    import sqlite3

    from runner.engines.fake import FakeEngine
    from runner.fingerprint import result_fingerprint
    from runner.run import run_job
    from runner.spec import load_job

    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(grammar_choice, "measure", lambda m, s: {"xgrammar": 300.0, "guidance": 90.0})
    job = load_job(make_job(rows=6, engine={"structured_output_backend": "measure"}))
    seen = []
    run_job(job, engine_factory=lambda j: seen.append(j.engine.structured_output_backend) or FakeEngine(j.output_schema))
    con = sqlite3.connect(job.database_path)
    stored = {r[0] for r in con.execute("SELECT fingerprint FROM results")}
    choice = json.loads(con.execute("SELECT engine_choice_json FROM run_stats").fetchone()[0])["grammar"]
    assert seen == ["guidance"] and choice["backend"] == "guidance"
    assert stored == {result_fingerprint(load_job(job.path))[0]}
    again = run_job(job, engine_factory=lambda j: FakeEngine(j.output_schema))
    assert again.rows_skipped == 6  # nothing redone


def test_measuring_never_starts_cuda_in_the_runners_process(tiny_model_dir, monkeypatch):
    """vLLM forks its engine core from this process after the measurement: had the measurement asked
    CUDA anything here (importing xgrammar asks torch.cuda.is_available(); llguidance pins its mask),
    the forked engine core could not use the GPU. Any CUDA query counts, answered or not."""
    import torch

    asked = []
    for name in ("is_available", "device_count", "init", "current_device", "_lazy_init"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, **k: asked.append(_n) or False)
    costs = grammar_choice.measure(tiny_model_dir, SCHEMA)
    assert set(costs) == {"xgrammar", "guidance"} and all(v > 0 for v in costs.values())
    assert asked == []


def test_a_measuring_process_that_fails_leaves_the_default_and_says_why(tmp_path, monkeypatch):
    """A model folder without a tokenizer: the child fails, the run goes on with xgrammar."""
    (tmp_path / "config.json").write_text("{}")
    choice = choose(tmp_path, SCHEMA, tmp_path / "grammar")
    assert choice.backend == "xgrammar" and "the measuring process failed" in choice.reason
    assert not (tmp_path / "grammar").exists()  # not cached: measured again next time


def test_what_the_child_prints_besides_its_result_line_is_ignored_and_a_bad_result_is_a_failure(
        tiny_model_dir, tmp_path, monkeypatch):
    """Libraries may print to stdout after the result; a result of the wrong shape, or none, leaves
    xgrammar for this process (not cached) instead of crashing the run."""
    import subprocess

    def child_prints(out: str, rc: int = 0) -> GrammarChoice:
        monkeypatch.setattr(grammar_choice.subprocess, "run",
                            lambda args, **kw: subprocess.CompletedProcess(args, rc, out, "a warning\n"))
        grammar_choice._MEMO.clear()
        return choose(tiny_model_dir, SCHEMA, tmp_path / "grammar")

    for bad in ("a C library's notice\n", 'GRAMMAR_COSTS {"xgrammar": 1.0}\n', "GRAMMAR_COSTS [1, 2]\n"):
        choice = child_prints(bad)
        assert choice.backend == "xgrammar" and "the measuring process" in choice.reason, bad
    assert not (tmp_path / "grammar").exists()
    good = child_prints('noise\nGRAMMAR_COSTS {"xgrammar": 300.0, "guidance": 90.0}\nmore noise\n')
    assert good.backend == "guidance" and good.us_per_token == {"xgrammar": 300.0, "guidance": 90.0}


def test_vllm_is_started_with_cuda_checks_that_leave_cuda_alone(monkeypatch):
    """torch.cuda.is_available() asks NVML, not CUDA, in the runner's process: vLLM's frontend
    imports xgrammar (which asks) before a later engine forks its core."""
    from runner.engines.vllm_settings import offline_environment

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    assert offline_environment(False)["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"


def test_vllm_keeps_one_triton_kernel_cache_under_the_runners_cache_unless_the_user_set_one(monkeypatch, tmp_path):
    """A start that loads its compile from the cache must find the kernels the compiling start made."""
    from runner.engines.vllm_settings import offline_environment

    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert offline_environment(False)["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert "TRITON_CACHE_DIR" not in offline_environment(False)  # the user's own stays
