"""A max_model_len the model cannot take is refused when the job is checked, as vLLM would refuse it
once started: the limit read from the model folder, the error naming where the length was set."""
from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from runner.cli import cli
from runner.errors import SpecError
from runner.model_length import model_length_limit
from runner.run import run_job
from runner.spec import load_job

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 8192}


def folder(tmp_path: Path, config: dict, tokenizer: dict | None = None, name: str = "m") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return d


# (config.json over LLAMA, tokenizer_config.json, the limit vLLM derives or None where it is not plain)
CASES = {
    "max_position_embeddings": ({}, None, 8192),
    "smallest key": ({"n_positions": 4096}, None, 4096),
    "tokenizer lower": ({}, {"model_max_length": 2048}, 8192),  # vLLM does not lower it (checked below)
    "rope default": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}, None, 8192),
    "rope default, per layer": ({"rope_parameters": {"full": {"rope_type": "default"},
                                                     "sliding": {"rope_type": "default"}}}, None, 8192),
    "rope linear": ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, None, None),
    "rope llama3": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}, None, None),
    "rope yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}},
                  None, None),
    "rope in both names": ({"rope_parameters": {"rope_type": "default"}, "rope_scaling": {"rope_type": "default"}},
                           None, None),
    "model_max_length in config": ({"model_max_length": 4096}, None, None),
    "nested text config": ({"text_config": {"max_position_embeddings": 4096}}, None, None),
    "no length key": ({"max_position_embeddings": None}, None, None),  # transformers' default: vLLM's to judge
    "a nested config's length": ({"decoder": {"max_position_embeddings": 1024}}, None, None),
    "a text config without a length": ({"text_config": {"model_type": "llama"}}, None, None),
    "an infinite length": ({"n_positions": float("inf")}, None, 8192),
    "no finite length": ({"max_position_embeddings": float("nan")}, None, None),
}


@pytest.mark.parametrize("case", CASES)
def test_the_limit_follows_vllms_rule(tmp_path, case):
    config, tokenizer, expected = CASES[case]
    found = model_length_limit(folder(tmp_path, LLAMA | config, tokenizer))
    assert (found and found[0]) == expected


def test_an_unreadable_or_absent_config_says_nothing(tmp_path):
    assert model_length_limit(tmp_path / "absent") is None
    (folder(tmp_path, {}, name="bad") / "config.json").write_text("{not json")
    assert model_length_limit(tmp_path / "bad") is None


def with_limit(make_job, tmp_path, limit: int, **kw) -> Path:
    """A job whose (tiny) model says it takes `limit` tokens."""
    path = make_job(**kw)
    model = Path(load_job(path).model_path)
    config = json.loads((model / "config.json").read_text())
    shutil.copytree(model, tmp_path / "limited")
    (tmp_path / "limited" / "config.json").write_text(json.dumps(config | {"max_position_embeddings": limit}))
    cfg = tmp_path / "configs" / "engine.yaml"
    cfg.write_text(yaml.safe_dump(yaml.safe_load(cfg.read_text()) | {"model": str(tmp_path / "limited")}))
    return path


def test_validate_names_the_config_file_or_the_job_where_the_length_was_set(make_job, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    path = with_limit(make_job, tmp_path, 512)  # the engine config's max_model_len: 1024
    r = CliRunner().invoke(cli, ["validate", str(path)])
    assert r.exit_code == 2
    assert r.output.startswith("Error: ") and r.output.count("\n") == 1
    assert "engine.yaml: max_model_len: 1024 is more than the model takes (512: max_position_embeddings" in r.output
    r = CliRunner().invoke(cli, ["validate", "--set", "engine.max_model_len=600", str(path)])
    assert r.exit_code == 2 and "job.yaml: engine.max_model_len: 600 is more than the model takes (512" in r.output
    assert r.output.rstrip().endswith("(with --set engine.max_model_len=600)")
    assert CliRunner().invoke(cli, ["validate", "--set", "engine.max_model_len=512", str(path)]).exit_code == 0
    cfg = tmp_path / "configs" / "engine.yaml"
    cfg.write_text(yaml.safe_dump({k: v for k, v in yaml.safe_load(cfg.read_text()).items() if k != "max_model_len"}))
    r = CliRunner().invoke(cli, ["validate", str(path)])  # set nowhere: the runner's default, 2048
    assert r.exit_code == 2 and "engine.yaml: max_model_len (not set: the default): 2048 is more" in r.output


def test_vllms_own_ways_past_the_limit_pass(make_job, tmp_path, monkeypatch):
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN here or in ray.env (what replicas run with), and extra_args
    that change the model's config or the length vLLM gets, leave the length to vLLM."""
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    path = with_limit(make_job, tmp_path, 512)
    for allow in ("1", "True"):
        monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", allow)
        assert load_job(path).engine.max_model_len == 1024
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
    spec = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump(spec | {"executor": "ray", "ray": {"env": {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}}}))
    assert load_job(path).engine.max_model_len == 1024
    path.write_text(yaml.safe_dump(spec))
    assert load_job(path, ["engine.extra_args.hf_overrides.max_position_embeddings=2048"]).engine.max_model_len == 1024
    assert load_job(path, ["engine.extra_args.max_model_len=512"]).engine.extra_args == {"max_model_len": 512}
    with pytest.raises(SpecError):
        load_job(path, ["engine.extra_args.enforce_eager=true"])  # other extra_args: still checked


def test_commands_that_only_read_results_still_open_the_job(make_job, tmp_path, monkeypatch):
    """A job run where vLLM was let past the limit (or whose model changed since) is still shown
    and exported from a plain shell: status, stats and export read results, and start no engine."""
    from runner.engines.fake import FakeEngine
    from tests.conftest import SCHEMA

    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    path = with_limit(make_job, tmp_path, 512)
    run_job(load_job(path), engine_factory=lambda j: FakeEngine(SCHEMA))
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
    assert CliRunner().invoke(cli, ["validate", str(path)]).exit_code == 2
    out = tmp_path / "rows.jsonl"
    for args in (["status", str(path)], ["stats", "--job", str(path)],
                 ["export", "--job", str(path), "--format", "jsonl", "-o", str(out)]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 0, (args, r.output)
    assert len(out.read_text().splitlines()) == 12


def test_a_run_stops_before_it_writes_anything(make_job, tmp_path, monkeypatch):
    from runner.engines.fake import FakeEngine
    from tests.conftest import SCHEMA

    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    path = with_limit(make_job, tmp_path, 512)
    r = CliRunner().invoke(cli, ["run", "--engine", "fake", str(path)])
    assert r.exit_code == 2 and "max_model_len: 1024 is more than the model takes" in r.output
    assert not (tmp_path / "out").exists()
    job = load_job(path, ["engine.max_model_len=512"])
    run_job(job, engine_factory=lambda j: FakeEngine(SCHEMA))
    assert sqlite3.connect(job.database_path).execute("SELECT count(*) FROM results").fetchone()[0] == 12


@pytest.mark.vllm
def test_vllm_refuses_one_token_past_the_limit_and_takes_the_limit(model_dir, tmp_path, monkeypatch):
    """The mirror checked against vLLM itself: the embedded model (its RoPE is `default`), another
    length key, and a tokenizer whose model_max_length is lower (vLLM keeps the config's limit)."""
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    from vllm.config import ModelConfig

    base = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer_config.json").read_text())
    variants = {"embedded": (base, tok)}
    for case in ("smallest key", "tokenizer lower"):
        config, tokenizer, _ = CASES[case]
        variants[case] = (base | config, tok | (tokenizer or {}))
    for i, (name, (config, tokenizer)) in enumerate(variants.items()):
        d = tmp_path / f"v{i}"
        d.mkdir()
        for f in model_dir.iterdir():
            if f.name not in ("config.json", "tokenizer_config.json"):
                (d / f.name).symlink_to(f)
        (d / "config.json").write_text(json.dumps(config))
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer))
        limit, _ = model_length_limit(d)
        assert ModelConfig(model=str(d), max_model_len=limit).max_model_len == limit, name
        with pytest.raises(ValueError, match="greater than the derived max_model_len"):
            ModelConfig(model=str(d), max_model_len=limit + 1)
