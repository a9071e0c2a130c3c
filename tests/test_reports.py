"""stats, report and export on the SQLite file of a real vLLM run (CPU)."""
from __future__ import annotations

import csv
import json
import shutil
import sqlite3
import subprocess

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from runner.cli import cli
from runner.export import flat_fields
from runner.report import SECTIONS
from tests.test_crash_safety import runner_cmd



@pytest.fixture(scope="module")
def real_db(tmp_path_factory, model_dir):
    """One real run of a small job; its database is shared by the tests below."""
    import yaml

    from tests.conftest import SCHEMA, write_docs

    root = tmp_path_factory.mktemp("real")
    write_docs(root / "docs.parquet", 10)
    (root / "schema.json").write_text(json.dumps(SCHEMA))
    (root / "engine.yaml").write_text(yaml.safe_dump({
        "model": str(model_dir), "dtype": "auto", "max_model_len": 1024, "kv_cache_memory_bytes": 256 << 20,
        "max_num_seqs": 4, "block_size": 32, "enforce_eager": True, "in_process": True,
        "speculative": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}}))
    (root / "job.yaml").write_text(yaml.safe_dump({
        "name": "real", "input": {"path": "docs.parquet", "id_column": "id", "text_column": "text",
                                  "system_prompt_column": "system_prompt"},
        "output_schema": "schema.json", "engine": {"config": "engine.yaml"},
        "sampling": {"temperature": 0, "max_tokens": 64}, "output": {"database": "results.sqlite", "commit_every_rows": 2, "max_failed_fraction": 1.0}}))
    done = subprocess.run(runner_cmd("run", "--quiet", root / "job.yaml"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return root / "results.sqlite"


@pytest.mark.vllm
def test_samples_were_recorded_during_the_run(real_db):
    con = sqlite3.connect(real_db)
    samples = con.execute("SELECT elapsed_s, rows_done FROM run_samples ORDER BY elapsed_s").fetchall()
    assert len(samples) >= 2
    assert [r for _, r in samples] == sorted(r for _, r in samples) and samples[-1][1] == 10


@pytest.mark.vllm
def test_stats_table_of_a_real_run(real_db):
    out = CliRunner().invoke(cli, ["stats", "1", "--db", str(real_db)])
    assert out.exit_code == 0, out.output
    assert "rows by status" in out.output and "plan bound" in out.output and "vllm" in out.output
    con = sqlite3.connect(real_db)
    ok = con.execute("SELECT count(*) FROM results WHERE status='ok'").fetchone()[0]
    assert f"ok {ok}" in out.output


@pytest.mark.vllm
def test_report_renders_in_headless_chromium(real_db, tmp_path):
    page = tmp_path / "report.html"
    out = CliRunner().invoke(cli, ["report", "1", "--db", str(real_db), "-o", str(page)])
    assert out.exit_code == 0, out.output
    text = page.read_text()
    assert "<script" not in text and "http" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # self-contained
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium package is needed (installed by .ci/run)"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    for section in SECTIONS:
        assert f'id="{section}"' in dom.stdout, section
    assert dom.stdout.count("<svg") >= 5  # throughput, cache, status, two histograms
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, *flags, f"--screenshot={shot}", "--window-size=900,1800", page.as_uri()],
                   capture_output=True, timeout=120)
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    colors = img.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 20  # text and plots, not a blank page
    blue = sum(n for n, (r, g, b) in colors if b > 150 and r < 80)
    assert blue > 500  # the bars and the curve were drawn


@pytest.mark.vllm
@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl"])
def test_export_flattens_extraction_fields(real_db, tmp_path, fmt):
    target = tmp_path / f"out.{fmt}"
    out = CliRunner().invoke(cli, ["export", "1", "--db", str(real_db), "--format", fmt, "-o", str(target)])
    assert out.exit_code == 0, out.output
    if fmt == "parquet":
        rows = pq.read_table(target).to_pylist()
    elif fmt == "csv":
        rows = list(csv.DictReader(target.open()))
    else:
        rows = [json.loads(line) for line in target.read_text().splitlines()]
    con = sqlite3.connect(real_db)
    stored = dict(con.execute("SELECT row_id, extraction_json FROM results"))
    assert sorted(r["row_id"] for r in rows) == sorted(stored)
    for r in rows:
        if stored[r["row_id"]]:
            value = json.loads(stored[r["row_id"]])
            assert r["extraction_sentiment"] == value["sentiment"] and r["extraction_summary"] == value["summary"]
        else:
            assert r["extraction_summary"] in (None, "")


def test_flat_fields_tell_scalars_from_structures():
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array"},
                                                "c": {"type": ["integer", "null"]}, "d": {"enum": ["x", "y"]}}}
    assert flat_fields(schema) == {"a": True, "b": False, "c": True, "d": True}
    # a field's $ref is resolved as the schema's own check resolves it: percent-escapes too
    ref = {"type": "object", "$defs": {"a b": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/a%20b"}}}
    assert flat_fields(ref) == {"x": True}


@pytest.mark.vllm
def test_report_of_a_missing_run_is_an_error(real_db, tmp_path):
    out = CliRunner().invoke(cli, ["report", "99", "--db", str(real_db), "-o", str(tmp_path / "x.html")])
    assert out.exit_code == 7 and out.output.startswith("Error: ") and "no run 99" in out.output


def test_one_sample_is_not_called_a_short_run():
    """A run killed after its first sample ran longer than the interval: the note says how samples
    are taken, not that the run was short."""
    from runner.collect import SAMPLE_EVERY_S
    from runner.report import line_chart

    note = line_chart([3.0], [1.5], "seconds since start", "documents/s")
    assert "<svg" not in note and "shorter" not in note and f"every {SAMPLE_EVERY_S:g} s" in note
    assert "<svg" in line_chart([3.0, 6.0], [1.5, 2.0], "seconds since start", "documents/s")
