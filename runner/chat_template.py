"""A model's chat template, rendered exactly as transformers' apply_chat_template renders it.

The runner renders prompts itself (and sends vLLM token ids), so the environment must be the one
transformers builds: the same Jinja options, its `tojson` (no HTML escaping, non-ASCII kept),
`strftime_now`, `raise_exception`, the `{% generation %}` tag, and the tokenizer's special tokens
as variables. Importing transformers for this would cost seconds on every `runner plan`.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from runner.errors import ModelError, TemplateError

# transformers' SPECIAL_TOKENS_ATTRIBUTES: each is a template variable when the tokenizer sets it.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def template_source(model_dir: Path, tok_cfg: dict, override: Optional[str]) -> str:
    """The template text: the job's own (prompts.chat_template), else the model folder's
    chat_template.jinja, else tokenizer_config.json's (a string, or a list of named templates of
    which transformers takes "default")."""
    if override:
        return override
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    source = tok_cfg.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if "default" not in named:
            raise ModelError(f"{model_dir}: the tokenizer has several chat templates ({', '.join(map(str, named))}) "
                             "and none named default; set prompts.chat_template to a template file")
        source = named["default"]
    if not source or not isinstance(source, str):
        raise ModelError(f"{model_dir}: the tokenizer has no chat template (set prompts.chat_template to a file)")
    return source


def special_tokens(model_dir: Path, tok_cfg: dict) -> dict[str, str]:
    """The named special tokens as strings, as transformers passes them to the template."""
    extra_file = model_dir / "special_tokens_map.json"
    extra = json.loads(extra_file.read_text()) if extra_file.is_file() else {}
    out = {}
    for name in SPECIAL_TOKENS:
        value = tok_cfg.get(name, extra.get(name))
        if isinstance(value, dict):  # older files store AddedToken dicts
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def compile_template(source: str):
    """The Jinja template in transformers' environment."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; it
        renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        line = f"line {exc.lineno}: " if getattr(exc, "lineno", None) else ""
        raise TemplateError(f"chat template: {line}{exc.__class__.__name__}: {exc}") from None


def render(template, messages: list[dict], variables: dict[str, Any]) -> str:
    """The prompt text, ending where the assistant's answer starts; template errors as ModelError."""
    import jinja2

    try:
        return template.render(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                               **variables)
    except ModelError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise TemplateError(f"chat template: {exc.__class__.__name__}: {exc}") from None


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: Jinja's own filter escapes <, >, & and ' for HTML
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise TemplateError(f"chat template: {message}")
