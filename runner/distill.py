"""`runner distill`: a small draft model for the job's model, trained on the job's own outputs.

Sequence-level distillation: the inputs are the prompts the runner built for the job's stored `ok`
rows, the targets the outputs the job's model generated for them (its own greedy answers). The
draft is the target's embeddings, head and first few layers (the same tokenizer, as vLLM's
draft_model method needs), fine-tuned with torch (embeddings and head frozen). Rows held back
from training measure how often the draft's guesses would be accepted, position by position.
The folder is a Hugging Face model; the database records what it was trained on, and
`calibration.candidates: [{method: draft_model, model: distilled}]` measures it.
"""
from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from runner.engines import Request
from runner.errors import ModelError, RunnerError
from runner.fingerprint import result_fingerprint
from runner.lock import JobLock
from runner.models import model_fingerprint
from runner.plan import Group, group_key
from runner.prompting import PromptBuilder, builder_for
from runner.readers import LocalReader
from runner.requests import RequestBuilder
from runner.spec import Job
from runner.store import Store

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


MEASURE_ROWS = 64  # held-out rows whose acceptance is measured: one generate call per 4 output tokens


class DistillError(RunnerError):
    exit_code = 2


@dataclass
class DistillOptions:
    layers: int = 4  # of the target's, kept in the draft
    epochs: int = 2
    learning_rate: float = 3e-4
    holdout: float = 0.2  # share of rows held back to measure acceptance
    max_rows: Optional[int] = None  # at most this many ok rows (newest fingerprint first)
    draft_tokens: int = 4  # the draft length acceptance is measured for
    seed: int = 0


@dataclass
class Example:
    row_id: str
    prompt: list[int]
    output: list[int]


def examples(job: Job, store: Store, builder: PromptBuilder, max_rows: Optional[int]) -> list[Example]:
    """The job's ok rows as (prompt ids, output ids), read back from the input."""
    fingerprint = result_fingerprint(job)[0]
    # The generated token ids, not the text: under a JSON grammar the model writes `{` and `"` as
    # tokens of their own where the text's tokenization merges them, from the first token on.
    outputs = {r: json.loads(ids) for r, _, ids in store.ok_results(job.name, fingerprint) if ids}
    if not outputs:
        raise DistillError(f"{job.database_path}: job {job.name} has no ok rows with their generated token ids "
                           f"(rows stored by runner 0.2 and later have them: run the job again)")
    eos = builder.eos_token_id()
    out = []
    reader = LocalReader(job.input_path, job.spec.input)
    # The prompt the run sent: built as a run builds it (a document cut by on_too_long: truncate
    # is cut here too), or the output would be paired with a prompt the model never saw.
    requests = RequestBuilder(job, builder)
    for doc in reader.documents(job.system_source, reader.scan().skip):  # rejected rows made no output
        ids = outputs.get(doc.row_id)
        if ids is None or doc.problem:
            continue
        built = requests.build_many(Group(group_key(doc.system_prompt), doc.system_prompt), [doc])[0]
        if not isinstance(built, Request):  # no prompt (a template error): the run stored no ok row for it
            continue
        prompt = built.prompt_token_ids
        out.append(Example(doc.row_id, prompt, ids + ([eos] if eos is not None and (not ids or ids[-1] != eos) else [])))
        if max_rows and len(out) >= max_rows:
            break
    return out


def held_out(row_id: str, share: float) -> bool:
    """A stable split: the same rows are held out every time."""
    return int(hashlib.sha256(row_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < share


def distill_job(job: Job, out: Path, opts: DistillOptions, progress: Optional[Callable[[int], object]] = None,
                wait: bool = False) -> dict:
    """Train, measure and save a draft; record it in the job's database. Returns the record."""
    builder = builder_for(job)
    with JobLock(job.database_path, job.name, wait=wait):
        store = Store(job.database_path)
        try:
            data = examples(job, store, builder, opts.max_rows)
            train = [e for e in data if not held_out(e.row_id, opts.holdout)]
            test = [e for e in data if held_out(e.row_id, opts.holdout)]
            if len(train) < 8 or not test:
                raise DistillError(f"{job.database_path}: {len(data)} ok rows of job {job.name}: too few to train a "
                                   f"draft and hold some back (run the job first)")
            record = _train_and_save(job, out, opts, train, test, progress)
            record["draft_id"] = store.save_draft(
                job_name=job.name, path=str(out), base_model=str(job.model_path),
                base_model_fingerprint=model_fingerprint(job.model_path), layers=opts.layers, rows_trained=len(train),
                rows_held_out=len(test), train_json=record)
            return record
        finally:
            store.close()


def _train_and_save(job: Job, out: Path, opts: DistillOptions, train: list[Example], test: list[Example],
                    progress) -> dict:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise ModelError(f"distilling a draft needs torch and transformers: {exc}") from None
    torch.manual_seed(opts.seed)
    target = AutoModelForCausalLM.from_pretrained(job.model_path, dtype=torch.float32)
    draft = truncated(target, opts.layers).to("cuda" if torch.cuda.is_available() else "cpu")
    del target
    t0 = time.perf_counter()
    losses = _fit(draft, train, opts, progress)
    train_s = time.perf_counter() - t0
    acceptance = acceptance_by_position(draft, test[:MEASURE_ROWS], opts.draft_tokens)
    _save(draft, job.model_path, out)
    return {"options": asdict(opts), "losses": losses, "train_s": round(train_s, 1),
            "held_out_rows": len(test), "measured_rows": min(len(test), MEASURE_ROWS),
            "held_out_acceptance_by_position": acceptance,
            "held_out_acceptance": round(sum(acceptance) / len(acceptance), 4) if acceptance else None}


def truncated(target, layers: int):
    """The target's embeddings, first `layers` layers, final norm and head, as a model of its own."""
    import copy

    if layers >= target.config.num_hidden_layers:
        raise DistillError(f"a draft of {layers} layers is no smaller than the model ({target.config.num_hidden_layers})")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if hasattr(config, "layer_types") and config.layer_types:
        config.layer_types = config.layer_types[:layers]
    draft = type(target)(config)
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    draft.load_state_dict(state, strict=False)
    draft.tie_weights()
    return draft


def _fit(draft, train: list[Example], opts: DistillOptions, progress) -> list[float]:
    """Teacher forcing on the target's outputs; the loss on output positions only (their logits
    only: the head is most of a small model's cost)."""
    import torch

    for p in draft.get_input_embeddings().parameters():
        p.requires_grad_(False)  # tied to the head: the vocabulary stays the target's
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=opts.learning_rate)
    rng = random.Random(opts.seed)
    bar = progress(len(train) * opts.epochs) if progress else None
    losses = []
    draft.train()
    for _ in range(opts.epochs):
        order = train[:]
        rng.shuffle(order)
        total = 0.0
        for ex in order:
            ids = _tensor(ex.prompt + ex.output, draft)
            hidden = draft.model(input_ids=ids[:, :-1]).last_hidden_state[:, len(ex.prompt) - 1:]
            logits = draft.lm_head(hidden)
            loss = torch.nn.functional.cross_entropy(logits[0], ids[0, len(ex.prompt):])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item()
            if bar is not None:
                bar.update(1)
        losses.append(round(total / len(order), 4))
    if bar is not None and hasattr(bar, "close"):
        bar.close()
    draft.eval()
    return losses


def _tensor(ids: list[int], model):
    import torch

    return torch.tensor([ids], device=model.device)


def acceptance_by_position(draft, test: list[Example], k: int, every: int = 4) -> list[float]:
    """How often the i-th of k greedy draft tokens would be accepted against the target's actual
    output (every `every`-th output position as a starting point): a draft token counts only if
    every earlier one in its step was right, as in speculative decoding."""
    import torch

    accepted, starts = [0] * k, 0
    with torch.no_grad():
        for ex in test:
            for t in range(0, len(ex.output) - 1, every):
                prefix = _tensor(ex.prompt + ex.output[:t], draft)
                guess = draft.generate(prefix, max_new_tokens=k, do_sample=False, pad_token_id=0)[0, prefix.shape[1]:]
                starts += 1
                for i, (g, truth) in enumerate(zip(guess.tolist(), ex.output[t:t + k])):
                    if g != truth:
                        break
                    accepted[i] += 1
    return [round(a / starts, 4) for a in accepted] if starts else []


def _save(draft, source: Path, out: Path) -> None:
    """A plain Hugging Face folder, written beside its place and renamed (never half written)."""
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    draft.to("cpu").save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, tmp / name)
    (tmp / "runner_draft.json").write_text(json.dumps({"base_model": str(source)}))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
