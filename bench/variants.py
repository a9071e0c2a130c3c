"""What each runner configuration of the benchmark changes: engine and job settings, and the
environment of its process. `runner` is the GPU config (configs/smollm2-h200.yaml) as shipped."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import yaml

ROOT = Path(__file__).resolve().parent.parent
NGRAM = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
FEW_GRAPH_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512]
# Past 512 tokens a step the GPU config's engine runs without CUDA graphs (in a profile of plain
# vLLM, sorted, more samples of steps that prefilled ran so than as piecewise graphs: 667 against
# 416). BIG_GRAPH_SIZES goes on to 2,048.
BIG_GRAPH_SIZES = FEW_GRAPH_SIZES + [640, 768, 1024, 1280, 1536, 2048]
# No torch.compile: its Dynamo pass and cache load took 3.5-6.4 s of every engine start on the H200,
# and a first start with new settings pays the whole compile (22.8 s at 62855f5). Steps that only
# decode run as whole CUDA graphs; the rest eagerly. (Whole graphs of every step, cudagraph_mode
# FULL, ran 1.27x faster at 62855f5 but broke outputs; the runner refuses that mode:
# runner/engine_config.py.)
NO_COMPILE = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
# Environment a configuration adds to the runner's process. breakable: vLLM 0.26 captures piecewise
# CUDA graphs without torch.compile, breaking the capture at attention at run time
# (vllm/compilation/breakable_cudagraph.py): no compile at start, graphs for the steps that prefill.
# Measured at 7e360a5 (bench/results/2026-12-01-nvidia-h200-breakable.json): sound outputs, but its
# capture took 15 s of LLM(...) against the compiled runner's 2 s; wall 1.16-1.19x the runner's.
BREAKABLE = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}
# v1runner: vLLM 0.26 runs Llama models on its V2 model runner by default, which pins each step's
# token masks anew (a profile of plain vLLM: 446 of 3,304 engine-core samples); V1 is the other.
VARIANT_ENV = {"breakable": BREAKABLE, "bigbreakable": BREAKABLE, "v1runner": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
               # the runner without its bytecode cache (runner/bytecode.py): imports as plain vLLM does
               "nobytecode": {"RUNNER_BYTECODE_CACHE": "0"}}


@functools.lru_cache(maxsize=None)  # asked under the scheduler's lock
def graph_sizes(config: str) -> Optional[tuple[int, ...]]:
    """The CUDA graph sizes a configuration gives vLLM on the GPU (None: vLLM's own list), as the
    runner decides them from the GPU config and the configuration's engine settings."""
    if config in ("plain", "sorted"):
        return None
    from runner.spec import load_engine_config

    path = ROOT / "configs" / "smollm2-h200.yaml"
    sizes = load_engine_config(path, runner_variant(config)[0], path).graph_sizes()
    return None if sizes is None else tuple(sizes)


def runner_variant(name: str) -> tuple[dict, dict]:
    """(engine overrides, job overrides) of a runner configuration."""
    variants = {
        "runner": ({}, {}), "runner_first": ({}, {}),
        "spec_off": ({"speculative": None}, {}),
        "no_warm": ({"speculative": None, "warm_prefix": False}, {}),
        "peaks_only": ({"speculative": None, "kv_projection": False}, {}),
        "no_pacing": ({"kv_pacing": False}, {}),
        "nowave": ({"admission_waves": False}, {}),
        # admission without the output lengths of the stored calibration's slice (as before they were kept)
        "noseed": ({"kv_lengths_from_calibration": False}, {}),
        "feedback": ({"kv_usage_feedback": True}, {}),
        "xgrammar": ({"structured_output_backend": "xgrammar"}, {}),
        # Token masks as vLLM ships them: filled one by one up to 128 requests a step, copied into
        # fresh pinned memory every step (runner/engines/grammar_masks.py); nopin: threads only.
        "vllmmasks": ({"grammar_threads_from": None, "grammar_mask_pinned": False}, {}),
        "nopin": ({"grammar_mask_pinned": False}, {}),
        "guidance": ({"structured_output_backend": "guidance"}, {}),
        # CUDA graphs at 20 batch sizes (the GPU config's since the lease of 76f8e42), or at vLLM's
        # own 51 up to 512 (capture took 4-8 s of every engine start on the H200).
        "fewgraphs": ({"cuda_graph_sizes": FEW_GRAPH_SIZES}, {}),
        "vllmgraphs": ({"cuda_graph_sizes": None}, {}),
        "biggraphs": ({"cuda_graph_sizes": BIG_GRAPH_SIZES}, {}),
        "nocompile_dec": ({"extra_args": {"compilation_config": NO_COMPILE}}, {}),
        # At most 512 (1,024) tokens a step, so that a step that prefills stays within the graphs
        # captured (the GPU config's go to 512): prefills spread over more steps, each one graphed.
        # The 8B shape at b6250f9: generation 0.97-1.02x the runner's (its steps decode-bound).
        "cap512": ({"max_num_batched_tokens": 512, "max_num_seqs": 512}, {}),  # vLLM: tokens >= seqs
        "cap1024": ({"max_num_batched_tokens": 1024, "cuda_graph_sizes": BIG_GRAPH_SIZES[:-3]}, {}),
        "breakable": ({}, {}),  # the GPU config, with VARIANT_ENV's
        "bigbreakable": ({"cuda_graph_sizes": BIG_GRAPH_SIZES}, {}),
        "v1runner": ({}, {}),  # the GPU config, with VARIANT_ENV's
        "nobytecode": ({}, {}),  # the GPU config, with VARIANT_ENV's
        # vLLM's engine core in the runner's process (the CPU config's setting): no core process to
        # fork, connect and shut down at exit; the driver's loop and the core's steps then share a thread.
        "inproc": ({"in_process": True}, {}),
        "no_grouping": ({"speculative": None, "warm_prefix": False}, {"plan_window_rows": 1}),
        "ray1": ({"speculative": None}, {"executor": "ray", "ray": {"replicas": 1, "gpus_per_replica": 1}}),
        "ray2": ({"speculative": None}, {"executor": "ray", "ray": {"replicas": 2, "gpus_per_replica": 1}}),
    }
    # rayNip / rayNmp / rayNsp: replicas whose vLLM engine core runs in the actor's process, or in a
    # process of its own, forked (the default), or spawned as vLLM would in a Ray actor (a second
    # import of vLLM and torch).
    for n in (1, 2):
        for suffix, inproc, start in (("ip", True, "fork"), ("mp", False, "fork"), ("sp", False, "spawn")):
            engine, job = variants[f"ray{n}"]
            ray = job["ray"] | {"engine_in_process": inproc, "engine_core_start": start}
            variants[f"ray{n}{suffix}"] = (engine | {"in_process": inproc}, job | {"ray": ray})
    if name.startswith("vq"):  # vLLM's own admission and preemption, at most N requests queued: vq192
        return {"speculative": None, "kv_admission": False, "max_in_flight": int(name[2:])}, {}
    if name.startswith("spec_k"):
        return {"speculative": NGRAM | {"num_speculative_tokens": int(name[6:])}}, {}
    return variants[name]


def engine_settings(a) -> dict:
    """--engine-set KEY=VALUE pairs (values read as YAML) for every runner configuration."""
    pairs = [item.split("=", 1) for item in getattr(a, "engine_set", [])]
    return {k.strip(): yaml.safe_load(v) for k, v in pairs}
