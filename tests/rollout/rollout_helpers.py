"""Helpers of the rollout tests: calculator task rows and worker configs around the scripted
engine (a module with a unique name, so it never collides with another folder's conftest)."""

from __future__ import annotations

import functools


def calc_rows(n: int, env_id: str = "palaestra/Calculator-v0") -> list[dict]:
    return [
        {"env_id": env_id, "id": f"t{i}", "question": f"What is {i} + {3 * i + 1}?",
         "answer": str(4 * i + 1)}
        for i in range(n)
    ]


def worker_config(tokenizer_dir: str, *, p_correct: float = 0.5, latency_s: float = 0.0,
                  **kwargs):
    from palaestra.agents import AgentSpec
    from palaestra.rollout.config import EngineSpec, WorkerConfig
    from palaestra.engine import SamplingParams
    from palaestra.engines.clients.scripted import ScriptedEngine
    from palaestra.rollout.testing import CalculatorPolicy

    factory = functools.partial(
        ScriptedEngine, CalculatorPolicy(tokenizer_dir, p_correct=p_correct), latency_s=latency_s
    )
    kwargs.setdefault("sampling", SamplingParams(max_new_tokens=64))
    kwargs.setdefault("seed_sampling", True)
    return WorkerConfig(engine=EngineSpec.from_factory(factory), agent=AgentSpec(tokenizer_dir),
                        **kwargs)
