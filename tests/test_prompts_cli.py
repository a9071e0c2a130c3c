"""Prompts and sampling as a user writes them in the job file, through the command line:
few-shot examples, system-prompt templates over row fields, a job's own chat template and its
variables, and vLLM's sampling settings (bounds checked before anything runs)."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from runner.cli import cli
from runner.prompting import builder_for
from runner.spec import load_job
from tests.conftest import write_docs


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def edit(job, **sections):
    spec = yaml.safe_load(job.read_text())
    for key, value in sections.items():
        spec[key] = (spec.get(key) or {}) | value if isinstance(value, dict) else value
    job.write_text(yaml.safe_dump(spec))
    return job


EXAMPLES = [{"role": "user", "content": "Document: the kettle leaks."},
            {"role": "assistant", "content": '{"summary": "Kettle leaks.", "sentiment": "negative"}'}]


def test_examples_sit_between_system_prompt_and_document_and_stay_in_the_shared_prefix(make_job, tmp_path):
    job = make_job()
    before = invoke("plan", job)
    edit(job, prompts={"examples": EXAMPLES})
    after = invoke("plan", job)
    assert before.exit_code == after.exit_code == 0, after.output
    share = [float(r.output.rsplit(" ", 1)[1].rstrip("%\n")) for r in (before, after)]
    assert share[1] > share[0]  # the examples are cached with the system prompt
    loaded = load_job(job)
    b = builder_for(loaded)
    text = b.render("SYS", "DOC")
    assert text.index("SYS") < text.index("the kettle leaks") < text.index("Kettle leaks.") < text.index("DOC")


def test_examples_must_end_with_an_assistant_turn(make_job):
    job = edit(make_job(), prompts={"examples": EXAMPLES[:1]})
    result = invoke("validate", job)
    assert result.exit_code == 2 and "prompts.examples: end with an assistant turn" in result.output


def test_a_system_template_groups_rows_by_the_prompt_it_renders(make_job, tmp_path):
    kinds = ["blenders", "kettles", "toasters"] * 4
    docs = write_docs(tmp_path / "data" / "docs.parquet", 12, kind=kinds)
    job = make_job(docs=docs, job={"input": {"system_prompt_column": None, "extra_columns": ["kind"]},
                                   "prompts": {"system_template": "You summarize reviews of {kind}."}})
    result = invoke("plan", job)
    assert result.exit_code == 0, result.output
    assert "3 groups, 12 rows" in result.output and "You summarize reviews of kettles." in result.output
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    assert sqlite3.connect(tmp_path / "out" / "results.sqlite").execute(
        "SELECT count(*) FROM results WHERE status = 'ok'").fetchone()[0] == 12


@pytest.mark.parametrize("prompts, expected", [
    ({"system_template": "About {brand}."}, "prompts.system_template: unknown field {brand}; list the column in input.extra_columns"),
    ({"system_template": "About {0}."}, "prompts.system_template: {0}: use a column name"),
    ({"system_template": "x", "system": "y"}, "prompts: give one of system, system_file and system_template"),
    ({"chat_template": "missing.jinja"}, "prompts.chat_template: cannot read"),
])
def test_prompt_mistakes_are_one_error_line_naming_the_field(make_job, prompts, expected):
    job = make_job(job={"input": {"system_prompt_column": None}, "prompts": prompts})
    result = invoke("validate", job)
    assert result.exit_code == 2 and expected in result.output and result.output.count("\n") == 1, result.output


def test_a_jobs_chat_template_and_its_variables_shape_every_prompt(make_job, tmp_path):
    (tmp_path / "mine.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n{{ prefill }}")
    job = make_job(job={"prompts": {"chat_template": "mine.jinja", "chat_template_kwargs": {"prefill": "Answer:"}}})
    text = builder_for(load_job(job)).render("S", "U")
    assert text.endswith("<|im_start|>assistant\nAnswer:")
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0
    edit(job, prompts={"chat_template_kwargs": {"prefill": "JSON:"}})  # another prompt: rows run again
    out = invoke("run", "--engine", "fake", job)
    assert out.exit_code == 0 and "running 12 stored rows again" in out.output, out.output
    assert "changed: prompts.chat_template_kwargs" in out.output
    (tmp_path / "mine.jinja").write_text((tmp_path / "mine.jinja").read_text() + " ")  # the file's text counts too
    out = invoke("run", "--engine", "fake", job)
    assert "running 12 stored rows again" in out.output and "prompts.chat_template_sha256" in out.output, out.output


def test_a_chat_template_that_leaves_out_the_document_is_refused_before_any_row_runs(make_job, tmp_path):
    """Every row would get the same prompt, and its one answer would be stored for each."""
    (tmp_path / "static.jinja").write_text("<|im_start|>system\nSummarize.<|im_end|>\n<|im_start|>assistant\n")
    job = make_job(job={"prompts": {"chat_template": "static.jinja"}})
    for command in (("validate",), ("run", "--engine", "fake", "--quiet")):
        result = invoke(*command, job)
        assert result.exit_code == 2 and result.output == (
            f"Error: {job}: prompts.chat_template (static.jinja): the rendered prompt leaves out the user's turn "
            "(the document): every row would get the same prompt\n"), result.output
    assert not (tmp_path / "out" / "results.sqlite").exists()
    # one that keeps the user's turn but not the system prompt still runs: each row differs
    (tmp_path / "static.jinja").write_text("{% for m in messages if m['role'] == 'user' %}{{ m['content'] }}{% endfor %}")
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0


@pytest.mark.parametrize("sampling, expected", [
    ({"repetition_penalty": 0}, "sampling.repetition_penalty: Input should be greater than 0"),
    ({"presence_penalty": 3}, "sampling.presence_penalty: Input should be less than or equal to 2"),
    ({"min_p": 1.5}, "sampling.min_p: Input should be less than or equal to 1"),
    ({"n": 3}, "sampling.n: Value error, one extraction is stored per row, so n must be 1"),
    ({"best_of": 2}, "sampling.best_of: unknown key"),
])
def test_sampling_settings_are_checked_before_anything_runs(make_job, sampling, expected):
    result = invoke("validate", make_job(job={"sampling": sampling}))
    assert result.exit_code == 2 and expected in result.output, result.output


def test_sampling_settings_reach_the_engine_and_the_fingerprint(make_job):
    from runner.fingerprint import result_fingerprint

    job = make_job()
    plain = load_job(job)
    edit(job, sampling={"repetition_penalty": 1.1, "stop": ["\n\n"], "extra_args": {"skip_special_tokens": False}})
    tuned = load_job(job)
    assert tuned.spec.sampling.vllm_kwargs() == {"repetition_penalty": 1.1, "stop": ["\n\n"],
                                                 "skip_special_tokens": False}
    assert plain.spec.sampling.vllm_kwargs() == {}
    a, b = result_fingerprint(plain)[1]["sampling"], result_fingerprint(tuned)[1]["sampling"]
    assert set(a) == {"temperature", "top_p", "max_tokens", "seed", "retry_max_tokens"}  # as before these fields
    assert b["repetition_penalty"] == 1.1 and json.dumps(b)


def test_set_overrides_the_job_and_the_engine_config_for_one_command(make_job, tmp_path):
    job = make_job()
    result = invoke("validate", "--set", "engine.max_num_seqs=0", job)
    assert result.exit_code == 2
    assert "engine.max_num_seqs: Input should be greater than or equal to 1 (with --set engine.max_num_seqs=0)" in result.output
    result = invoke("validate", "--set", "max_num_seqs", job)
    assert result.exit_code == 2 and "--set max_num_seqs: expected KEY=VALUE" in result.output
    result = invoke("validate", "--set", "name.first=x", job)
    assert result.exit_code == 2 and "name is not a section" in result.output
    for key in ("input.limit", "engine.max_num_seqs", "sampling.temperature"):  # YAML's yes is true, not 1
        result = invoke("validate", "--set", f"{key}=yes", job)
        assert result.exit_code == 2 and "expected a number, not true or false" in result.output, key
    assert invoke("validate", "--set", "engine.enforce_eager=yes", job).exit_code == 0  # a yes/no setting takes it
    assert invoke("run", "--engine", "fake", "--quiet", "--set", "engine.max_num_seqs=3",
                  "--set", "sampling.max_tokens=40", job).exit_code == 0
    config = json.loads(sqlite3.connect(tmp_path / "out" / "results.sqlite").execute(
        "SELECT config_json FROM runs").fetchone()[0])
    assert config["engine"]["max_num_seqs"] == 3 and config["job"]["sampling"]["max_tokens"] == 40
    assert yaml.safe_load(job.read_text())["sampling"]["max_tokens"] == 64  # the file is unchanged


def test_limit_makes_a_smoke_run_and_the_next_run_does_the_rest(make_job, tmp_path):
    job = make_job(rows=12)
    out = invoke("run", "--engine", "fake", "--limit", "5", job)
    assert out.exit_code == 0 and "5 taken from the input (limit 5)" in out.output, out.output
    db = sqlite3.connect(tmp_path / "out" / "results.sqlite")
    assert db.execute("SELECT count(*) FROM results").fetchone()[0] == 5
    out = invoke("run", "--engine", "fake", job)
    assert out.exit_code == 0 and "7 run, 5 already done, 12 in input" in out.output, out.output
    assert db.execute("SELECT count(DISTINCT row_id) FROM results").fetchone()[0] == 12
    assert invoke("run", "--limit", "0", job).exit_code == 2


def test_machine_readable_stats_and_whole_job_export_to_stdout(make_job, tmp_path):
    job = make_job(rows=12)
    assert invoke("run", "--engine", "fake", "--quiet", "--limit", "5", job).exit_code == 0
    assert invoke("run", "--engine", "fake", "--quiet", job).exit_code == 0  # the other 7, in a second run
    out = CliRunner().invoke(cli, ["stats", "--job", str(job), "--last", "2", "--json"])
    runs = json.loads(out.stdout)
    assert [r["run"]["id"] for r in runs] == [2, 1] and [r["rows_by_status"]["ok"] for r in runs] == [7, 5]
    assert runs[0]["stats"]["rows_total"] == 7 and isinstance(runs[0]["run"]["config_json"], dict)

    out = CliRunner().invoke(cli, ["export", "--job", str(job), "--format", "jsonl"])
    assert out.exit_code == 0, out.output
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert sorted(r["row_id"] for r in rows) == [f"r{i:03d}" for i in range(12)]  # both runs' rows
    assert "Exported 12 rows to stdout" in out.stderr and "extraction_summary" in rows[0]
    out = CliRunner().invoke(cli, ["export", "1", "--job", str(job), "--format", "csv", "-o", "-"])
    assert out.stdout.count("\n") == 6  # a header and run 1's 5 rows
    out = CliRunner().invoke(cli, ["export", "--db", str(tmp_path / "out" / "results.sqlite"), "--format", "csv"])
    assert out.exit_code == 2 and "give RUN_ID, or --job JOB" in out.output
    html = CliRunner().invoke(cli, ["report", "2", "--job", str(job)])
    assert html.exit_code == 0 and html.stdout.lstrip().lower().startswith("<!doctype html")


def test_a_template_given_with_set_stays_text_and_a_mapping_stays_a_mapping():
    """`--set prompts.user_template={text}` is a template (YAML would read a mapping with a key and
    no value, which no setting is); `{a: 1}` is a mapping."""
    from runner.overrides import apply_overrides

    got = apply_overrides({}, ["prompts.user_template={text}", "prompts.system_template={source} ",
                               "engine.extra_args={seed: 3}", "input.extra_columns=[title]"])
    assert got == {"prompts": {"user_template": "{text}", "system_template": "{source} "},
                   "engine": {"extra_args": {"seed": 3}}, "input": {"extra_columns": ["title"]}}
    # a format spec, as the unknown-field error suggests ({title:>20}): text, not {"title:>20": null}
    got = apply_overrides({}, ["prompts.user_template={text:>20}", "prompts.system_template={title:05d}",
                               "engine.extra_args={seed: 3, enforce_eager: true}", "sampling.extra_args={a: null}"])
    assert got == {"prompts": {"user_template": "{text:>20}", "system_template": "{title:05d}"},
                   "engine": {"extra_args": {"seed": 3, "enforce_eager": True}}, "sampling": {"extra_args": {"a": None}}}


def test_a_whole_section_given_with_set_merges_and_a_broken_list_is_refused():
    """`--set sampling={max_tokens: 100}` replaced the section (the job's other sampling settings
    gone without a word); `--set sampling.stop=[a, b` was the stop string "[a, b"."""
    import pytest

    from runner.errors import SpecError
    from runner.overrides import apply_overrides

    job = {"sampling": {"max_tokens": 160, "retry_repetition_penalty": 1.2},
           "engine": {"config": "c.yaml", "calibration": {"rows": 64, "max_draft_tokens": 6}}}
    got = apply_overrides(job, ["sampling={max_tokens: 100}", "engine={max_num_seqs: 4}"])
    assert got == {"sampling": {"max_tokens": 100, "retry_repetition_penalty": 1.2},
                   "engine": {"config": "c.yaml", "max_num_seqs": 4, "calibration": {"rows": 64, "max_draft_tokens": 6}}}
    # at any depth too; a speculative mapping naming its method is that method's whole setting
    job = {"engine": {"calibration": {"rows": 64, "max_draft_tokens": 6},
                      "speculative": {"method": "draft_model", "model": "d", "num_speculative_tokens": 4}}}
    got = apply_overrides(job, ["engine.calibration={rows: 16}", "engine.speculative={method: ngram}"])
    assert got == {"engine": {"calibration": {"rows": 16, "max_draft_tokens": 6}, "speculative": {"method": "ngram"}}}
    got = apply_overrides(got, ["engine.speculative={num_speculative_tokens: 3}"])
    assert got["engine"]["speculative"] == {"method": "ngram", "num_speculative_tokens": 3}
    # `{}` empties a section; `method` elsewhere is just a key
    got = apply_overrides({"engine": {"extra_args": {"seed": 3, "method": "x"}}, "sampling": {"max_tokens": 9}},
                          ["engine.extra_args={method: y}", "sampling={}"])
    assert got == {"engine": {"extra_args": {"seed": 3, "method": "y"}}, "sampling": {}}
    for broken in ("sampling.stop=[a, b", "engine.extra_args={seed: 3"):
        with pytest.raises(SpecError, match="not valid YAML"):
            apply_overrides({}, [broken])
    # text YAML cannot read, with its brackets closed, stays text
    assert apply_overrides({}, ["prompts.user_template=[INST] {text} [/INST]"]) == \
        {"prompts": {"user_template": "[INST] {text} [/INST]"}}


def test_an_error_names_limit_as_the_user_gave_it_and_limit_beside_set_input_limit_is_refused(make_job):
    """--limit N reached the loader as `--set input.limit=N`: an error said "(with --set input.limit=5)"
    to a user who never typed --set, and `--limit 5 --set input.limit=abc` ran with --limit winning."""
    job = make_job()
    text = Path(job).read_text().replace("text_column:", "txt_column:")
    Path(job).write_text(text)
    result = invoke("run", "--engine", "fake", "--limit", "5", "--set", "output.commit_every_rows=2", job)
    assert result.exit_code == 2
    assert result.output.rstrip().endswith("(with --set output.commit_every_rows=2 --limit 5)"), result.output
    result = invoke("run", "--engine", "fake", "--limit", "5", "--set", "input.limit=abc", job)
    assert result.exit_code == 2
    assert result.output.strip() == "Error: --limit and --set input.limit both give the input's limit: give one"


def test_a_hash_in_a_set_value_is_the_user_s_text_not_a_yaml_comment():
    """`--set 'prompts.system=Reply in English #1 priority'` set "Reply in English": YAML read the rest
    as a comment (the shell had passed it on quoted, so the user meant it); `#1` alone set null."""
    from runner.overrides import apply_overrides

    got = apply_overrides({}, ["prompts.system=Reply in English #1 priority", "prompts.user_template=#1 {text}",
                               "sampling.max_tokens=100 # tokens", "sampling.stop=[a, b] # two",
                               "prompts.system_template=a#b {x}", "sampling.seed=7"])
    assert got == {"prompts": {"system": "Reply in English #1 priority", "user_template": "#1 {text}",
                               "system_template": "a#b {x}"},
                   # not a number or a list, as written: validation names it, rather than dropping the rest
                   "sampling": {"max_tokens": "100 # tokens", "stop": "[a, b] # two", "seed": 7}}


def test_a_block_of_yaml_given_with_set_keeps_yaml_s_own_comment_lines():
    from runner.overrides import apply_overrides

    assert apply_overrides({}, ["prompts.system=|\n  line\n# a comment\n"]) == {"prompts": {"system": "line\n"}}
