"""Prompts byte-identical to transformers' apply_chat_template, for every template a user may bring.

Templates: the embedded model's; real ones read from installed packages (vLLM's, transformers'
Llama 4 template with strftime_now and tojson, mistral_common's Mistral templates with their
system-prompt placement and role checks); and two written here (the list form of several named
templates, a tojson-escaped user message).
Each is rendered by the runner and by transformers itself on the same tokenizer folder.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from runner.prompting import Document, PromptBuilder

STRFTIME_TOJSON = (
    "{{ bos_token }}{% if not date_string is defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "<|im_start|>system\nToday: {{ date_string }}\n{{ system }}{% if tools %}\n{{ tools | tojson(indent=2) }}{% endif %}"
    "<|im_end|>\n{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | tojson }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def vllm_templates() -> dict[str, str]:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None:
        return {}
    folder = Path(list(spec.submodule_search_locations)[0]) / "transformers_utils" / "chat_templates"
    return {p.stem: p.read_text() for p in sorted(folder.glob("template_*.jinja"))}


def real_templates() -> dict[str, str]:
    """Chat templates of real models that installed packages carry."""
    out = {}
    import ast
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    llama4 = Path(list(spec.submodule_search_locations)[0]) / "models" / "llama4" / "processing_llama4.py" if spec else None
    if llama4 is not None and llama4.is_file():  # read, not imported: importing it costs seconds
        for node in ast.parse(llama4.read_text()).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "chat_template":
                out["llama4"] = ast.literal_eval(node.value)
    # mistral_common imports cv2, which edits LD_LIBRARY_PATH for every process started after it
    # (the suite's own runs, whose memory it changed): put it back.
    saved = os.environ.get("LD_LIBRARY_PATH")
    try:
        from mistral_common.integrations.chat_templates.chat_templates import generate_chat_template
        from mistral_common.tokens.tokenizers.base import TokenizerVersion
    except ImportError:
        return out
    finally:
        if saved is None:
            os.environ.pop("LD_LIBRARY_PATH", None)
        else:
            os.environ["LD_LIBRARY_PATH"] = saved
    for v in ("v3", "v7", "v11"):
        out[f"mistral_{v}"] = generate_chat_template(
            spm=False, tokenizer_version=TokenizerVersion(v), image_support=False, audio_support=False,
            thinking_support=False, default_system_prompt=None, plain_thinking_support=False,
            use_special_token_variables=True, model_settings_fields=None, reasoning_effort_values=None,
            reasoning_effort_default=None)
    return out


def folder_with(template, tiny_model_dir: Path, tmp_path: Path, name: str) -> Path:
    """The tiny tokenizer with another chat template (a string, or the list form)."""
    d = tmp_path / name
    d.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template}))
    return d


def transformers_render(folder: Path, messages: list[dict], **kwargs) -> str:
    # The fast-tokenizer class AutoTokenizer resolves these folders to (or its base class, whose
    # apply_chat_template it inherits); imported directly, without the seconds `AutoTokenizer` costs.
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


SYSTEM = 'Extract <fields> as JSON: "name", café & naïve — quotes \'single\' too.'
USER = "Déjà vu <b>bold</b> & {braces} \\ backslash\n  indented line"
EXAMPLES = [{"role": "user", "content": "Example <in>"}, {"role": "assistant", "content": '{"name": "é"}'}]


def test_real_templates_are_found():
    assert {"llama4", "mistral_v3", "mistral_v7"} <= set(real_templates()) and "template_chatml" in vllm_templates()


@pytest.mark.parametrize("name", ["strftime_tojson", "list_form", *real_templates(), *vllm_templates()])
def test_prompts_are_byte_identical_to_transformers(name, tiny_model_dir, tmp_path):
    template = {"strftime_tojson": STRFTIME_TOJSON,
                "list_form": [{"name": "default", "template": STRFTIME_TOJSON},
                              {"name": "tool_use", "template": NO_SYSTEM}],
                **real_templates()}.get(name) or vllm_templates()[name]
    folder = folder_with(template, tiny_model_dir, tmp_path, name)
    b = PromptBuilder(folder, examples=EXAMPLES)
    rendered = 0
    for system in (SYSTEM, None):
        messages = ([{"role": "system", "content": system}] if system else []) + EXAMPLES + [{"role": "user", "content": USER}]
        try:
            expected = transformers_render(folder, messages)
        except Exception as exc:  # the template refuses these messages: the runner must refuse them too
            with pytest.raises(Exception, match="(?i)" + str(exc).split(":")[-1].strip()[:20].replace("(", ".")):
                b.render(system, USER)
            continue
        assert b.render(system, USER) == expected, name
        assert b.prompt_ids(system, USER) == b.encode(expected)  # the fast path, or the fallback where it cannot be exact
        rendered += 1
    assert rendered or name == "template_deepseek_ocr", f"{name} refused every conversation"


def test_the_embedded_models_template_matches_transformers(model_dir):
    b = PromptBuilder(model_dir, examples=EXAMPLES)
    for system in (SYSTEM, None):
        messages = ([{"role": "system", "content": system}] if system else []) + EXAMPLES + [{"role": "user", "content": USER}]
        assert b.render(system, USER) == transformers_render(model_dir, messages)


def test_a_template_file_and_template_kwargs_override_the_models(tiny_model_dir, tmp_path):
    folder = folder_with(STRFTIME_TOJSON, tiny_model_dir, tmp_path, "m")
    override = tmp_path / "mine.jinja"
    override.write_text("{{ greeting }}|{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
                        "{{ date_string }}")
    b = PromptBuilder(folder, chat_template=override.read_text(), chat_template_kwargs={"greeting": "hi",
                                                                                        "date_string": "1 Jan 2026"})
    assert b.render("S", "U") == "hi|system:S;user:U;1 Jan 2026"
    b = PromptBuilder(folder, chat_template_kwargs={"date_string": "1 Jan 2026"})
    expected = transformers_render(folder, [{"role": "user", "content": "U"}], date_string="1 Jan 2026")
    assert b.render(None, "U") == expected and "Today: 1 Jan 2026" in expected


def test_prompt_ids_still_equal_encoding_the_rendered_prompt(tiny_model_dir, tmp_path):
    folder = folder_with(STRFTIME_TOJSON, tiny_model_dir, tmp_path, "ids")
    b = PromptBuilder(folder, "{title}: {text}", examples=EXAMPLES)
    doc = Document("r", "some text <here>", SYSTEM, {"title": "T"})
    assert b.prompt_ids(SYSTEM, b.user_text(doc)) == b.encode(b.render(SYSTEM, b.user_text(doc)))


def test_prompt_ids_match_transformers_on_a_metaspace_tokenizer(tmp_path):
    """SentencePiece-style tokenizers (Metaspace, prepend_scheme "first", as transformers converts
    Llama and Mistral ones) mark a word's start at the start of every encoded part: ids built in
    two parts must not differ from one encode of the whole prompt."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    alphabet = ["▁", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?:\"'<>&{}\\\né\t"]
    tok.train_from_iterator(["You are careful. Summarize the review.", "hello world the blender broke"] * 50,
                            trainers.BpeTrainer(vocab_size=200, initial_alphabet=alphabet))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("[INST]", "[/INST]", "<s>", "</s>")])
    folder = tmp_path / "metaspace"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
                "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% else %}{{ m['content'] }}\n\n"
                "{% endif %}{% endfor %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}))
    hf = PreTrainedTokenizerFast.from_pretrained(str(folder))
    b = PromptBuilder(folder)
    for user in ("hello world", " leading space", "\nnewline first", "plain"):
        expected = hf.apply_chat_template([{"role": "system", "content": "You are careful."},
                                           {"role": "user", "content": user}], tokenize=True, add_generation_prompt=True)
        expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
        assert b.prompt_ids("You are careful.", user) == list(expected), user
        assert b.prompt_ids_batch("You are careful.", [user])[0] == list(expected)


def test_a_template_that_cuts_the_users_text_is_rendered_whole_not_spliced(tiny_model_dir, tmp_path):
    """The document is spliced into a template's render only where the template places it verbatim;
    one that cuts it (`m.content[:300]`) is rendered for every prompt, as transformers would."""
    folder = folder_with(STRFTIME_TOJSON, tiny_model_dir, tmp_path, "cut")
    cut = "{% for m in messages %}{{ m['role'] }}:{{ m['content'][:300] }};{% endfor %}"
    b = PromptBuilder(folder, chat_template=cut)
    long = "word " * 200
    assert b.prompt_ids("S", long) == b.encode(b.render("S", long)) == b.encode("system:S;user:" + long[:300] + ";")
