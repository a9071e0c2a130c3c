"""Shared fixtures: real Parquet files, real SQLite files, the real embedded model's tokenizer."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["VLLM_NO_USAGE_STATS"] = "1"

ROOT = Path(__file__).resolve().parent.parent

SCHEMA = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "maxLength": 200},
        "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]},
    },
    "required": ["summary", "sentiment"],
    "additionalProperties": False,
}

# Long enough to fill whole KV blocks (32 tokens in the test config; vLLM's CPU default is 128).
SYSTEM_A = "You are a careful analyst of customer reviews. " * 24
SYSTEM_B = "You summarize incident reports for an on-call engineer. " * 24


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """A test that calls the command line's main() in this process (or stops a command with a
    signal) leaves the stop state and handlers of a process about to exit: put them back."""
    import signal

    from runner import signals

    stops = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None), signal.SIGINT) if s is not None]
    before = {s: signal.getsignal(s) for s in stops}
    yield
    signals.reset()
    for s, handler in before.items():
        if handler is not None:
            signal.signal(s, handler)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The embedded default model, converted once (CI prepares it before the tests)."""
    from runner.models import prepare_builtin_model

    path, _ = prepare_builtin_model()
    return path


def write_docs(path: Path, n: int = 12, systems=(SYSTEM_A, SYSTEM_B), **extra_cols) -> Path:
    """A Parquet file of n short documents whose system prompts alternate in blocks of three."""
    ids = [f"r{i:03d}" for i in range(n)]
    texts = [f"Document {i}: the blender number {i} broke after {i + 2} days. Very bad." for i in range(n)]
    sys_col = [systems[(i // 3) % len(systems)] for i in range(n)]
    cols = {"id": ids, "text": texts, "system_prompt": sys_col, **extra_cols}
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path, row_group_size=5)
    return path


CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A model folder for tests of the runner's own logic (the fake engine): a small byte-level
    BPE tokenizer trained here, a ChatML template, a Llama config, and an empty weights file.
    Tests that need no generation run without the embedded model being converted."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("tiny-model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [SYSTEM_A, SYSTEM_B, "Document 0: the blender number broke after days. Very bad.", "summary sentiment"]
    tok.train_from_iterator(corpus * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"")  # present, not loadable: the fake engine loads nothing
    return folder


@pytest.fixture
def make_job(tmp_path, request):
    """Write a complete job (Parquet, schema, engine config, job YAML) under tmp_path; returns its
    path. Tests marked `vllm` get the embedded model; the others a tiny tokenizer-only model."""
    real = request.node.get_closest_marker("vllm") is not None
    model_dir = request.getfixturevalue("model_dir" if real else "tiny_model_dir")
    # the fake engine writes no grammar: its runs need not measure one (tests of `measure` name it)
    grammar = {} if real else {"structured_output_backend": "xgrammar"}

    def make(rows: int = 12, job: dict | None = None, engine: dict | None = None, schema: dict | None = None,
             docs: Path | None = None) -> Path:
        if docs is None:
            docs = write_docs(tmp_path / "data" / "docs.parquet", rows)
        (tmp_path / "schemas").mkdir(exist_ok=True)
        (tmp_path / "schemas" / "out.json").write_text(json.dumps(schema or SCHEMA))
        cfg = {
            "model": str(model_dir), "dtype": "auto", "max_model_len": 1024,
            "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 8, "block_size": 32, "enforce_eager": True, "in_process": True,
            "speculative": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2},
        } | grammar | (engine or {})
        (tmp_path / "configs").mkdir(exist_ok=True)
        (tmp_path / "configs" / "engine.yaml").write_text(yaml.safe_dump(cfg))
        spec = {
            "name": "t",
            "input": {"path": str(docs.relative_to(tmp_path)), "id_column": "id", "text_column": "text",
                      "system_prompt_column": "system_prompt"},
            "output_schema": "schemas/out.json",
            "engine": {"config": "configs/engine.yaml"},
            "sampling": {"temperature": 0, "max_tokens": 64},
            # The 135M model cuts some rows off at max_tokens: tests of the exit code set their own.
            "output": {"database": "out/results.sqlite", "commit_every_rows": 4, "max_failed_fraction": 1.0},
        }
        for key, value in (job or {}).items():
            if isinstance(value, dict) and isinstance(spec.get(key), dict):
                spec[key] = spec[key] | value
            elif value is None:
                spec.pop(key, None)
            else:
                spec[key] = value
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return path

    return make
