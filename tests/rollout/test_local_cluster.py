"""``cluster="local"``: the same workers as in-process asyncio tasks, sharing one live engine
(what a single machine without Ray runs); the manager pauses, updates and resumes that engine."""

from __future__ import annotations

import pytest
from rollout_helpers import calc_rows

from palaestra.agents import AgentSpec
from palaestra.errors import ConfigError
from palaestra.rollout.config import EngineSpec, RolloutConfig, WorkerConfig
from palaestra.rollout.data import DataSource
from palaestra.rollout.manager import RolloutManager
from palaestra.engine import SamplingParams
from palaestra.engines.clients.scripted import ScriptedEngine
from palaestra.rollout.testing import CalculatorPolicy


async def test_local_workers_share_one_live_engine(tokenizer_dir):
    engine = ScriptedEngine(CalculatorPolicy(tokenizer_dir), latency_s=0.01)
    wc = WorkerConfig(engine=EngineSpec(), agent=AgentSpec(tokenizer_dir),
                      sampling=SamplingParams(max_new_tokens=64), seed_sampling=True)
    cfg = RolloutConfig(batch_size=8, group_size=4, num_workers=2,
                        filters=("nonzero_variance",), over_sampling=2.0)
    async with RolloutManager(DataSource(calc_rows(50)), wc, cfg, cluster="local",
                              engine=engine) as m:
        first = await m.generate_batch(0)
        timing = await m.update_weights()
        assert engine.weight_version == 1 and set(timing) == {"pause_s", "push_s", "resume_s"}
        second = await m.generate_batch(1)
        stats = await m.worker_stats()
    assert len(first.group_ids) == 8 and len(second.group_ids) == 8
    assert {s.versions_T[-1] for s in first.samples} == {0}
    assert max(s.versions_T[-1] for s in second.samples) == 1
    assert all(w["episodes"] > 0 for w in stats)
    assert first.metrics["ledger/unaccounted"] == second.metrics["ledger/unaccounted"] == 0
    assert not engine._paused  # left running for whoever uses it next


def test_a_live_engine_cannot_go_to_ray_workers(tokenizer_dir):
    wc = WorkerConfig(engine=EngineSpec(), agent=AgentSpec(tokenizer_dir))
    with pytest.raises(ConfigError, match="cannot be shared with Ray workers"):
        RolloutManager(DataSource(calc_rows(4)), wc, cluster="ray",
                       engine=ScriptedEngine([1, 2]))
    with pytest.raises(ConfigError, match="invalid rollout config") as err:
        RolloutConfig(batch_size=0, mode="fast", over_sampling=0.5)
    assert "batch_size" in str(err.value) and "mode" in str(err.value)
