"""Real vLLM on the CPU with the embedded model: JSON guidance, prefix caching and ngram speculation together."""
from __future__ import annotations

import json
import sqlite3

import jsonschema
import pytest
from click.testing import CliRunner

from runner.cli import cli
from tests.conftest import SCHEMA

pytestmark = pytest.mark.vllm


def test_real_run_stores_valid_rows_and_engine_stats(make_job, tmp_path):
    job = make_job(rows=8)
    result = CliRunner().invoke(cli, ["run", str(job)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "Results:" in result.output

    con = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    con.row_factory = sqlite3.Row
    rows = con.execute("SELECT * FROM results").fetchall()
    assert sorted(r["row_id"] for r in rows) == [f"r{i:03d}" for i in range(8)]
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) >= 6, [(r["status"], r["output_text"]) for r in rows]
    for r in ok:
        jsonschema.validate(json.loads(r["extraction_json"]), SCHEMA)
        assert r["completion_tokens"] > 0 and r["finish_reason"] in ("stop", "length")
    # Rows after the first of each system prompt reuse its cached prefix.
    assert sum(r["cached_prompt_tokens"] > 0 for r in rows) >= 6

    st = dict(con.execute("SELECT * FROM run_stats").fetchone())
    assert st["rows_total"] == 8 and st["completion_tokens"] > 0
    assert st["prefix_cache_hits"] > 0 and 0 < st["prefix_cache_hit_rate"] <= 1
    assert st["spec_draft_tokens"] > 0 and st["spec_accepted_tokens"] > 0
    assert st["documents_per_s"] > 0 and st["output_tokens_per_s"] > 0
    run = dict(con.execute("SELECT * FROM runs").fetchone())
    assert run["status"] == "completed" and run["engine_backend"] == "vllm"
    settings = json.loads(run["engine_settings_json"])
    assert settings["enable_prefix_caching"] is True and settings["speculative_config"]["method"] == "ngram"
