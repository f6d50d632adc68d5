"""Evaluation during training: every ``eval.interval`` steps, run the configured benchmarks on the
engine that serves the current weights and return flat metrics for the training log.

The training loop owns the schedule and the logging; this module only needs the engine::

    evaluator = TrainingEvaluator(config.eval, tokenizer=tok, family="qwen", run_dir=run_dir)
    ...
    if evaluator.due(step):
        metrics.update(await evaluator.evaluate(engine, step))   # {"eval/gsm8k/pass@1": ..}

Samples of each evaluation go to ``RUN_DIR/eval/step_000100/`` (samples.jsonl, summary.json) when
a run directory is given, so a long run's evaluation history can be compared afterwards with
``palaestra eval compare``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.engine import Engine
from palaestra.run.evaluation import EvalConfig

if TYPE_CHECKING:
    from palaestra.contracts import Tokenizer


def flatten(summaries: Mapping[str, Mapping[str, Any]], prefix: str = "eval") -> dict[str, float]:
    """``{"eval/gsm8k/pass@1": .., "eval/gsm8k/mean_reward": .., ...}`` for a training logger."""
    out: dict[str, float] = {}
    for name, s in summaries.items():
        n = int(s.get("n") or 1)
        keys = {
            "pass@1": "pass@1",
            f"pass@{n}": f"pass@{n}",
            f"maj@{n}": f"maj@{n}",
            "mean": "mean_reward",
            "mean_completion_tokens": "response_tokens",
            "mean_turns": "turns",
        }
        for key, label in keys.items():
            value = s.get(key)
            if isinstance(value, (int, float)):
                out[f"{prefix}/{name}/{label}"] = float(value)
        samples = int(s.get("samples") or 0)
        if samples:
            out[f"{prefix}/{name}/error_rate"] = float(s.get("errors", 0)) / samples
    return out


class TrainingEvaluator:
    """Runs the ``[eval]`` benchmarks on a live engine at the configured steps."""

    def __init__(
        self,
        config: EvalConfig,
        *,
        tokenizer: Tokenizer,
        family: str = "qwen",
        max_context: int = 4096,
        tools_in_prompt: bool = True,
        run_dir: str | Path | None = None,
        progress: bool = False,
    ) -> None:
        from palaestra.benchmarks.registry import resolve

        self.config = config
        # unknown names fail at start-up; the agents are the run's (tool schemas in the prompt?)
        self.benchmarks = [
            b.with_overrides(agent={**b.agent, "tools_in_prompt": tools_in_prompt})
            for b in resolve(config.benchmarks)
        ]
        self.tokenizer = tokenizer
        self.family = family
        self.max_context = max_context
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.progress = progress
        self.history: list[tuple[int, dict[str, float]]] = []

    def due(self, step: int) -> bool:
        c = self.config
        if not c.benchmarks or c.interval <= 0:
            return False
        if step == 0:
            return c.at_start
        return step % c.interval == 0

    async def evaluate(self, engine: Engine, step: int) -> dict[str, float]:
        """Evaluate the weights ``engine`` serves now; returns the flat metrics (also kept)."""
        from palaestra.benchmarks.policies import TokenPolicy
        from palaestra.benchmarks.runner import EvalSettings, evaluate

        c = self.config
        policy = TokenPolicy(
            engine,
            self.tokenizer,
            model=f"step-{step}",
            family=self.family,
            max_context=self.max_context,
        )
        settings = EvalSettings(
            n=c.n,
            temperature=c.temperature,
            top_p=c.top_p,
            max_new_tokens=c.max_new_tokens,
            limit=c.limit,
            concurrency=c.concurrency,
            seed=c.seed,
        )
        out_dir = None
        if self.run_dir is not None and c.save_samples:
            out_dir = self.run_dir / "eval" / f"step_{step:06d}"
        summaries = await evaluate(
            self.benchmarks,
            policy,
            settings,
            out_dir=out_dir,
            env_kwargs=c.env_kwargs,
            progress=self.progress,
            report=False,
        )
        metrics = flatten(summaries)
        self.history.append((step, metrics))
        return metrics

    def evaluate_sync(self, engine: Engine, step: int) -> dict[str, float]:
        """`evaluate` for synchronous training loops."""
        from palaestra.asyncio_utils import run_sync

        return run_sync(self.evaluate(engine, step))


__all__ = ["EvalConfig", "TrainingEvaluator", "flatten"]
