"""State that outlives one run in a process: a second run must not trip on what the first left
(the collector tuning of rollout workers, the registry of named trajectory buffers)."""

from __future__ import annotations

import gc

import pytest
from rollout_helpers import worker_config

from palaestra.errors import ConfigError
from palaestra.rollout.worker import RolloutWorker


async def test_a_worker_undoes_its_gc_tuning_at_shutdown(tokenizer_dir):
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's default, which the worker tunes
    gc.unfreeze()
    try:
        for _ in range(2):  # a second run in the same process starts from the same state
            worker = RolloutWorker(worker_config(tokenizer_dir))
            await worker.warmup()
            assert gc.get_threshold() == (10_000, 20, 100) and gc.get_freeze_count() > 0
            await worker.shutdown()
            assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
        gc.set_threshold(1000, 5, 5)  # a process that tuned its GC itself keeps its setting
        worker = RolloutWorker(worker_config(tokenizer_dir))
        await worker.warmup()
        assert gc.get_threshold() == (1000, 5, 5)
        await worker.shutdown()
        assert gc.get_threshold() == (1000, 5, 5)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_dropped_buffer_leaves_the_name_registry():
    from palaestra.rollout.gateway.buffer import TrajectoryBuffer

    first = TrajectoryBuffer(vocab_size=100, name="run-buffer")
    assert TrajectoryBuffer.named("run-buffer") is first
    del first
    gc.collect()
    with pytest.raises(ConfigError, match="no trajectory buffer named 'run-buffer'"):
        TrajectoryBuffer.named("run-buffer")
    second = TrajectoryBuffer(vocab_size=100, name="run-buffer")
    assert TrajectoryBuffer.named("run-buffer") is second
