"""Benchmark models shaped like the ones users run, without their weights.

vLLM's `load_format: dummy` fills random weights from config.json alone, so a folder with a config
and a tokenizer measures a model's compute and memory cost (not its answers). The tokenizer and
chat template are copied from a real model folder, so prompts and prefixes are the real ones.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

# Llama layouts. `8b`: hidden 4096, 32 layers, 8 KV heads, like the 7-8B models users run;
# `tiny`: small enough for the CPU tests.
SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, tie_word_embeddings=True),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def write_dummy_model(source: Path, out: Path, shape: str) -> Path:
    """A config-only Llama folder of `shape`, with `source`'s tokenizer, vocabulary and chat template."""
    config = json.loads((Path(source) / "config.json").read_text())
    config.update(SHAPES[shape])
    config.pop("_model_name_or_path", None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copy(Path(source) / name, out / name)
    return out


def kv_bytes_per_token(shape: str, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token takes: keys and values of every layer."""
    s = SHAPES[shape]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * dtype_bytes
