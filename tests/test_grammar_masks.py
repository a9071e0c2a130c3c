"""The token-mask tuning of vLLM's StructuredOutputManager (runner/engines/grammar_masks.py),
against a stand-in with the shape of vLLM 0.26's and 0.32's manager; real vLLM: tests/test_vllm_cpu.py."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from runner.engine_config import EngineConfig
from runner.engines import grammar_masks


class Buffer:
    """A mask buffer; pin_memory() as torch's: a pinned copy, or the buffer itself if pinned already."""

    def __init__(self, rows: int, pinned: bool = False):
        self.np, self.pinned = np.zeros((rows, 4), dtype=np.int32), pinned

    def pin_memory(self):
        return self if self.pinned else copy(self)


def copy(buffer: Buffer) -> Buffer:
    b = Buffer(len(buffer.np), pinned=True)
    b.np[:] = buffer.np
    return b


def manager_class():
    class Manager:
        """vLLM's manager in brief: a fixed threshold of 128, a buffer allocated on the first step,
        rows [0, n) filled every step, threads only above the threshold."""

        pinned = False  # llguidance's and outlines' buffers are pinned already, xgrammar's not

        def __init__(self, max_num_seqs: int = 256, executor: str = "uni", drafts: bool = False,
                     vllm_workers: int = 8):
            self.vllm_config = SimpleNamespace(
                scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs), max_concurrent_batches=2,
                parallel_config=SimpleNamespace(distributed_executor_backend=executor),
                speculative_config={"method": "ngram"} if drafts else None)
            self._grammar_bitmask = None
            self.fill_bitmask_parallel_threshold = 128
            if self.fill_bitmask_parallel_threshold < max_num_seqs:
                self.fill_bitmask_parallel_batch_size = 16
                self.executor_for_fillmask = SimpleNamespace(_max_workers=vllm_workers, shutdown=lambda wait: None)
            self.paths = []

        def _async_submit_fill_bitmask(self, batch):
            raise AssertionError("not called by the stand-in")

        def grammar_bitmask(self, requests, ids, spec_tokens):
            if self._grammar_bitmask is None:
                self._grammar_bitmask = Buffer(self.vllm_config.scheduler_config.max_num_seqs, self.pinned)
            self.paths.append("threads" if len(ids) > self.fill_bitmask_parallel_threshold else "serial")
            for i, rid in enumerate(ids):
                self._grammar_bitmask.np[i] = requests[rid]
            return self._grammar_bitmask.np[: len(ids)]

    return Manager


@pytest.fixture
def cls(monkeypatch):
    monkeypatch.delenv(grammar_masks.ENV, raising=False)
    c = manager_class()
    assert grammar_masks.wrap(c) and grammar_masks.wrap(c)  # once only: a second wrap changes nothing
    return c


def setting(monkeypatch, threads_from, pinned=False, report=None):
    monkeypatch.setenv(grammar_masks.ENV, grammar_masks.environment(threads_from, pinned, report)[grammar_masks.ENV])


def step(m, n: int, base: int = 0):
    ids = [f"r{i}" for i in range(n)]
    return m.grammar_bitmask({rid: base + i for i, rid in enumerate(ids)}, ids, {})


def test_unset_leaves_vllm_as_it_ships(cls):
    m = cls(max_num_seqs=64)
    assert m.fill_bitmask_parallel_threshold == 128 and not hasattr(m, "executor_for_fillmask")
    step(m, 40)
    assert m.paths == ["serial"] and not hasattr(m, "_runner_seen")


def test_threads_from_a_small_batch_with_a_pool_of_the_runners_own(cls, monkeypatch, tmp_path):
    report = tmp_path / "masks.json"
    setting(monkeypatch, 16, report=report)
    m = cls(max_num_seqs=64)  # vLLM made no pool: 64 is under its 128
    assert m.fill_bitmask_parallel_threshold == 16 and m.fill_bitmask_parallel_batch_size == grammar_masks.BATCH
    assert m.executor_for_fillmask._max_workers >= 2
    step(m, 16)
    step(m, 17)
    assert m.paths == ["serial", "threads"]
    # the core wrote its counts on its first step; the runner reads them whole
    assert grammar_masks.read_report(report) == {"threads_from": 16, "workers": m.executor_for_fillmask._max_workers,
                                                 "pinned_buffers": 0, "steps": 1, "threaded_steps": 0}
    m.executor_for_fillmask.shutdown()


def test_vllms_own_pool_is_kept_unless_it_has_one_thread(cls, monkeypatch):
    setting(monkeypatch, 16)
    m = cls(max_num_seqs=256)  # over 128: vLLM made a pool, of half the CPUs
    assert m.executor_for_fillmask._max_workers == 8 and m.fill_bitmask_parallel_threshold == 16
    one = cls(max_num_seqs=256, vllm_workers=1)  # two cores: vLLM's pool has one thread
    assert one.executor_for_fillmask._max_workers >= 2 and one.fill_bitmask_parallel_threshold == 16
    one.executor_for_fillmask.shutdown()


def test_a_batch_never_over_the_threshold_and_drafts_are_left(cls, monkeypatch):
    setting(monkeypatch, 16)
    small = cls(max_num_seqs=8)  # never more than 8 requests a step: nothing to spread
    assert small.fill_bitmask_parallel_threshold == 128 and not hasattr(small, "executor_for_fillmask")
    drafting = cls(max_num_seqs=64, drafts=True)  # vLLM fills serially whenever there are drafts
    assert drafting.fill_bitmask_parallel_threshold == 128 and not hasattr(drafting, "executor_for_fillmask")
    setting(monkeypatch, None)
    assert cls(max_num_seqs=256).fill_bitmask_parallel_threshold == 128


@pytest.mark.parametrize("vllm_pins", [False, True], ids=["xgrammar", "llguidance"])
def test_pinned_buffers_are_filled_in_turn_so_a_step_in_flight_keeps_its_masks(cls, monkeypatch, tmp_path, vllm_pins):
    """xgrammar's buffer is not pinned, llguidance's is: either way the turns are buffers of their own."""
    monkeypatch.setattr(grammar_masks, "_cuda", lambda: True)
    monkeypatch.setattr(grammar_masks, "pinned_copy", copy)
    cls.pinned = vllm_pins
    report = tmp_path / "masks.json"
    setting(monkeypatch, None, pinned=True, report=report)
    m = cls(max_num_seqs=8)
    first = step(m, 3, base=100)
    vllms = m._grammar_bitmask
    outs = [step(m, 3, base=10 * k) for k in range(grammar_masks.PINNED_BUFFERS + 2)]
    buffers = m._runner_pool
    assert len(buffers) == grammar_masks.PINNED_BUFFERS and all(b.pinned for b in buffers)
    assert len({id(b) for b in buffers} | {id(vllms)}) == grammar_masks.PINNED_BUFFERS + 1
    # each step's masks stay as filled until PINNED_BUFFERS - 1 later steps have been filled
    latest = outs[-(grammar_masks.PINNED_BUFFERS - 1):]
    for k, out in zip(range(len(outs) - len(latest), len(outs)), latest):
        assert out[:, 0].tolist() == [10 * k, 10 * k + 1, 10 * k + 2]
    assert first[:, 0].tolist() == [100, 101, 102]  # vLLM's own buffer is no longer written
    assert json.loads(report.read_text())["pinned_buffers"] == grammar_masks.PINNED_BUFFERS


def test_more_buffers_where_vllm_keeps_more_steps_in_flight(cls, monkeypatch):
    monkeypatch.setattr(grammar_masks, "_cuda", lambda: True)
    monkeypatch.setattr(grammar_masks, "pinned_copy", copy)
    setting(monkeypatch, None, pinned=True)
    m = cls(max_num_seqs=8)
    m.vllm_config.max_concurrent_batches = 5  # pipeline parallelism
    step(m, 2)
    step(m, 2)
    assert len(m._runner_pool) == 7


@pytest.mark.parametrize("cuda, executor", [(False, "uni"), (True, "mp"), (True, "ray")])
def test_no_pinned_memory_without_cuda_or_where_the_worker_is_another_process(cls, monkeypatch, cuda, executor):
    monkeypatch.setattr(grammar_masks, "_cuda", lambda: cuda)
    monkeypatch.setattr(grammar_masks, "pinned_copy", lambda b: pytest.fail("pinned"))
    setting(monkeypatch, None, pinned=True)
    m = cls(max_num_seqs=8, executor=executor)
    step(m, 2)
    step(m, 2)
    assert m._runner_pool is None and not m._grammar_bitmask.pinned


def test_a_pin_that_fails_leaves_vllms_buffer(cls, monkeypatch):
    monkeypatch.setattr(grammar_masks, "_cuda", lambda: True)
    monkeypatch.setattr(grammar_masks, "pinned_copy", lambda b: (_ for _ in ()).throw(RuntimeError("no accelerator")))
    setting(monkeypatch, None, pinned=True)
    m = cls(max_num_seqs=8)
    step(m, 2)
    out = step(m, 2, base=5)
    assert m._runner_pool is None and m._runner_pin is False and out[:, 0].tolist() == [5, 6]


def test_a_manager_of_another_shape_is_left_as_it_is(monkeypatch):
    class Other:
        def __init__(self):
            self.ran = True

        def grammar_bitmask(self, requests, ids, spec_tokens):
            return len(ids)

    setting(monkeypatch, 4, pinned=True)
    assert grammar_masks.wrap(Other)
    o = Other()
    assert o.grammar_bitmask({}, ["a", "b"], {}) == 2 and not hasattr(o, "_runner_seen")
    assert not grammar_masks.wrap(type("NoMasks", (), {}))


def test_the_plugin_acts_only_where_the_runner_set_the_variable(monkeypatch):
    calls = []
    monkeypatch.setattr(grammar_masks, "install", lambda: calls.append(1) or True)
    monkeypatch.delenv(grammar_masks.ENV, raising=False)
    grammar_masks.register()
    assert calls == []
    setting(monkeypatch, 16)
    grammar_masks.register()
    assert calls == [1]
    monkeypatch.setenv(grammar_masks.ENV, "not json")
    assert grammar_masks.settings() is None


def test_engine_settings_and_their_defaults():
    cfg = EngineConfig(model="m")
    assert cfg.grammar_threads_from == 16 and cfg.grammar_mask_pinned is True
    assert EngineConfig(model="m", grammar_threads_from=None).grammar_threads_from is None
    with pytest.raises(ValueError):
        EngineConfig(model="m", grammar_threads_from=0)
    with pytest.raises(ValueError):
        EngineConfig(model="m", grammar_threads_from=True)  # YAML's yes


def test_without_an_accelerator_a_pinned_copy_raises_what_the_manager_catches():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine can pin memory")
    with pytest.raises(RuntimeError):
        grammar_masks.pinned_copy(torch.zeros(2, 3, dtype=torch.int32))
