"""Turning a document into the exact prompt tokens the engine sees.

The planner and the engine share this code so that the plan's token counts are the real ones.
It uses the `tokenizers` library and the model's own Jinja chat template directly, which loads
in milliseconds (transformers would cost seconds on every `runner plan`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Optional, Sequence

from runner import chat_template as templates
from runner.errors import ModelError, TemplateError


@dataclass(frozen=True)
class Document:
    """One input row, as the job sees it."""

    row_id: str
    text: str
    system_prompt: Optional[str]
    fields: dict
    problem: Optional[str] = None  # input.on_bad_row: store: why this row is stored failed, not run


def render_user(user_template: str, doc: Document) -> str:
    """The user turn of a row: prompts.user_template filled with its columns ({text}: the document)."""
    return user_template.format_map({**doc.fields, "text": doc.text})


class PromptBuilder:
    """Renders (system, examples, user) with the model's chat template and counts tokens."""

    def __init__(self, model_dir: Path, user_template: str = "{text}", *, examples: Sequence[dict] = (),
                 chat_template: Optional[str] = None, chat_template_kwargs: Optional[dict] = None):
        self.model_dir = Path(model_dir)
        self.user_template = user_template
        self.examples = [dict(e) for e in examples]  # user/assistant turns after the system prompt
        tok_file = self.model_dir / "tokenizer.json"
        if not tok_file.is_file():
            from runner.models import missing_model

            raise ModelError(missing_model(self.model_dir, "no tokenizer.json"))
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(tok_file))
        self._special_strings = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        self._heads: dict[Optional[str], tuple[list[int], Optional[str], str]] = {}
        cfg_file = self.model_dir / "tokenizer_config.json"
        self._tok_cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self._template_override = chat_template
        self._special_tokens = templates.special_tokens(self.model_dir, self._tok_cfg)
        # transformers: the special tokens, then the caller's kwargs over them
        self._variables = {**self._special_tokens, **(chat_template_kwargs or {})}

    @cached_property
    def _template(self):
        return templates.compile_template(
            templates.template_source(self.model_dir, self._tok_cfg, self._template_override))

    def compile_template(self) -> None:
        """Compile the chat template now (TemplateError), not at the first row."""
        self._template

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (its vocabulary's longest entry, added tokens
        included; a byte-level entry's characters are bytes, at least the text's characters)."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def capped(self, doc: Document, max_model_len: int) -> Document:
        """The document, its text cut to the most characters a prompt of max_model_len tokens can
        hold (4x: a normalizer may merge characters): a longer text is too long whatever it says,
        and tokenizing all of it cost gigabytes (a 10.8 MB row: 2.97 GB and 22 s, to store it failed)."""
        most = (max_model_len + 1) * self.max_token_chars * 4
        return doc if len(doc.text) <= most else replace(doc, text=doc.text[:most])

    def check_the_document_reaches_the_model(self, where: str) -> None:
        """TemplateError where two different user texts render the same prompt: a chat template that
        drops the user's turn would send every row the same prompt (and store its answer for each).
        A template that refuses these probes is left to the rows (some refuse what others take)."""
        try:
            a, b = (self.render("s", text) for text in ("first document", "second document"))
        except TemplateError:
            return
        if a == b:
            raise TemplateError(f"{where}: the rendered prompt leaves out the user's turn (the document): every "
                                "row would get the same prompt")

    def user_text(self, doc: Document) -> str:
        return render_user(self.user_template, doc)

    def messages(self, system: Optional[str], user: str) -> list[dict]:
        """The conversation a prompt renders: system prompt, few-shot turns, the document."""
        head = [{"role": "system", "content": system}] if system else []
        return head + self.examples + [{"role": "user", "content": user}]  # the sandbox cannot change them

    def render(self, system: Optional[str], user: str) -> str:
        """The prompt text, ending where the assistant's answer starts: what transformers'
        apply_chat_template(..., add_generation_prompt=True) gives for the same conversation."""
        return templates.render(self._template, self.messages(system, user), self._variables)

    def prompt_ids(self, system: Optional[str], user: str) -> list[int]:
        """Token ids of the rendered prompt, the same as encode(render(system, user)), but faster.

        The part up to the last special token before the user's text depends only on the system
        prompt: it is encoded once per system prompt. Splitting right after a special token is exact,
        since the tokenizer cuts added tokens out before it tokenizes the text between them. A
        template that changes the user's text (tojson, trim, escaping) is rendered whole each time.
        """
        ids, middle, tail = self._head(system)
        if middle is None:
            return self.encode(self.render(system, user))
        return ids + self.encode(middle + user + tail)

    def _head(self, system: Optional[str]) -> tuple[list[int], Optional[str], str]:
        """(ids of the shared head, text between it and the user's text, text after it); the
        middle is None when the template does not place the user's text verbatim."""
        head = self._heads.get(system)
        if head is None:
            rendered = self.render(system, _SENTINEL)
            cut = rendered.find(_SENTINEL)
            if cut < 0:  # the template drops or rewrites the user's text: render every prompt whole
                cut = len(rendered)
            found = ((rendered.rfind(t, 0, cut), t) for t in self._special_strings)
            split = max((at + len(t) for at, t in found if at >= 0), default=0)
            before, after = rendered[:cut], rendered[cut + len(_SENTINEL):]
            head_ids = self.encode(rendered[:split]) if split else []
            # Exact only if the template places the text verbatim and encoding in two parts gives
            # what one encode does (a Metaspace tokenizer adds a word mark at a part's start),
            # whatever the text starts with.
            verbatim = rendered.count(_SENTINEL) == 1
            for probe in (_PROBE, "w" + _PROBE, "\n" + _PROBE, _PROBE * 64) if verbatim else ():
                whole = self.render(system, probe)
                if whole != before + probe + after or \
                        head_ids + self.encode(rendered[split:cut] + probe + after) != self.encode(whole):
                    verbatim = False
                    break
            if len(self._heads) > 1024:  # bounded: a job with countless system prompts keeps working
                self._heads.clear()
            head = self._heads[system] = (head_ids, rendered[split:cut] if verbatim else None, after)
        return head

    def head_tokens(self, system: Optional[str]) -> int:
        """Tokens every prompt with this system prompt starts with (0 until one was built)."""
        head = self._heads.get(system)
        return len(head[0]) if head else 0

    def prompt_ids_batch(self, system: Optional[str], users: list[str]) -> list[list[int]]:
        """prompt_ids for many user texts under one system prompt; the tokenizer runs them in parallel."""
        if not users:
            return []
        ids, middle, tail = self._head(system)
        if middle is None:
            return self.encode_batch([self.render(system, u) for u in users])
        return [ids + r for r in self.encode_batch([middle + u + tail for u in users])]

    def fit(self, system: Optional[str], doc: Document, ids: list[int], max_model_len: int, max_tokens: int,
            truncate: bool) -> tuple[list[int], Optional[str], int]:
        """The prompt-length rule: prompt tokens plus max_tokens must fit in max_model_len. With
        `truncate`, the document's text is cut to fit (8 tokens of slack: the cut text can
        re-tokenize a little longer); otherwise, or if cutting cannot make it fit, the reason.
        Returns the prompt's ids, the reason or None, and the document's tokens cut."""
        over = len(ids) + max_tokens - max_model_len
        cut_tokens = 0
        if over > 0 and truncate:
            text_ids = self.encode(doc.text)
            kept = max(len(text_ids) - over - 8, 0)
            cut = Document(doc.row_id, self.decode(text_ids[:kept]), doc.system_prompt, doc.fields)
            ids = self.prompt_ids(system, self.user_text(cut))
            over = len(ids) + max_tokens - max_model_len
            cut_tokens = len(text_ids) - kept
        if over > 0:
            # cutting helps only where the document is longer than the excess (8 tokens of slack)
            savable = not truncate and len(self.encode(doc.text)) > over + 8
            how = ("set input.on_too_long: truncate to cut the document" if savable else
                   "the prompt's other parts (system prompt, few-shot turns, template) do not fit even with "
                   "the document cut: shorten them, raise max_model_len or lower max_tokens")
            return ids, (f"prompt is {len(ids)} tokens; with max_tokens={max_tokens} it exceeds "
                         f"max_model_len={max_model_len} ({how})"), cut_tokens
        return ids, None, cut_tokens

    def eos_token_id(self) -> Optional[int]:
        """The token that ends an answer (the chat template's end of turn)."""
        return self._tok.token_to_id(self._special_tokens.get("eos_token", ""))

    def encode(self, text: str) -> list[int]:
        # The template already wrote the special tokens; adding more would break prefix sharing.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.20) skips the offsets nobody reads: a third faster.
        fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def system_prefix_tokens(self, system: Optional[str]) -> int:
        """Tokens every prompt with this system prompt shares (the cacheable prefix)."""
        a = self.encode(self.render(system, "a"))
        b = self.encode(self.render(system, "b"))
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n


_SENTINEL = "\uE000user-text\uE001"  # private-use characters: never in a template
# What escaping or trimming templates change: quotes, backslash, newline, markup, non-ASCII, edges;
# 64 of it (~1,300 characters): a template that cuts the user's text (`m.content[:500]`).
_PROBE = ' \t"q\' \\ <a&b> é\n{x} '


def template_where(job) -> str:
    """Where the job's chat template comes from, for its errors."""
    p = job.spec.prompts
    return (f"{job.path}: prompts.chat_template ({p.chat_template})" if p.chat_template
            else f"the chat template of {job.model_path}")


def check_first_prompt(job, builder: PromptBuilder, documents) -> Optional[str]:
    """Build the first row's prompt, as validate, plan and run all do before anything else: a chat
    template that refuses it (raise_exception), and also another document under the same system
    prompt, is the job's error (TemplateError), not every row's. Returns a note where only this
    row is refused, or it does not fit prompts.user_template: that is the row's failure (another
    row may fit), said so that a template no row fits is seen before the night."""
    doc = next(iter(documents), None)
    if doc is None or doc.problem:
        return None
    doc = builder.capped(doc, job.engine.max_model_len)  # a huge first row: no gigabytes to tokenize it
    try:
        user = builder.user_text(doc)
    except (KeyError, ValueError, TypeError, IndexError, AttributeError) as exc:
        from runner.summary import one_line

        return (f"the first row (id {doc.row_id!r}) does not fit prompts.user_template ({exc.__class__.__name__}: "
                f"{one_line(str(exc), 200)}): a run stores each such row failed; runner plan counts them")
    try:
        builder.prompt_ids(doc.system_prompt, user)
    except TemplateError as exc:
        why = str(exc).removeprefix("chat template: ")
        # another document, then another system prompt: a template that refuses some content (a
        # word, one group's system prompt) fails those rows only; one that refuses all is the job's
        for system in (doc.system_prompt, "a system prompt"):
            try:
                builder.prompt_ids(system, "a document")
            except TemplateError:
                continue
            return (f"the chat template refuses the first row's prompt (id {doc.row_id!r}: {why}), but not others: "
                    "a run stores each row it refuses failed")
        raise TemplateError(f"{template_where(job)}: refuses the first row's prompt (id {doc.row_id!r}): "
                            f"{why}") from None
    return None


def builder_for(job) -> PromptBuilder:
    """The PromptBuilder of a loaded job: its model, user template, few-shot turns and chat template."""
    p = job.spec.prompts
    builder = PromptBuilder(job.model_path, p.user_template, examples=[e.model_dump() for e in p.examples],
                            chat_template=job.chat_template, chat_template_kwargs=p.chat_template_kwargs)
    where = template_where(job)
    try:
        builder.compile_template()  # a template that cannot compile is the job's error, not every row's
    except TemplateError as exc:
        raise TemplateError(f"{where}: {str(exc).removeprefix('chat template: ')}") from None
    builder.check_the_document_reaches_the_model(where)
    return builder
