"""Evaluation during training, as the run sees it: the ``[benchmark_eval]`` config section and
the `TrainingEvaluation` protocol the training loop calls.

The implementation (`palaestra.benchmarks.training.TrainingEvaluator`, which runs benchmarks)
sits above the run in the dependency direction, so the run never imports it: the loop calls
`training_evaluator(...)`, which loads the implementation named in `_IMPLEMENTATION` (the one
entry point the run keeps for it) and returns it typed as the protocol.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import pydantic

from palaestra.config import Section

if TYPE_CHECKING:
    from palaestra.contracts import Tokenizer
    from palaestra.engine import Engine

#: the benchmarks' evaluator, loaded on first use (benchmarks depend on the run, not back)
_IMPLEMENTATION = ("palaestra.benchmarks.training", "TrainingEvaluator")


class EvalConfig(Section):
    """Periodic evaluation during training (the ``[eval]`` section of a training config)."""

    benchmarks: list[str] = pydantic.Field(default_factory=list)
    """Benchmark names (see `palaestra eval list`); empty = no evaluation."""
    interval: int = 0
    """Evaluate every this many training steps (0 = never)."""
    at_start: bool = False
    """Also evaluate before the first step (step 0), as a baseline."""
    limit: int | None = 100
    """First N tasks of each benchmark (None = all)."""
    n: int = 1
    """Samples per task (pass@k for every k <= n)."""
    temperature: float = 0.0
    """Sampling temperature (0 = greedy, the least noisy estimate for a fixed n)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    max_new_tokens: int | None = None
    """Tokens per turn (None = each benchmark's own)."""
    concurrency: int = 64
    """Episodes in flight."""
    seed: int = 0
    """Base of the per-sample seeds."""
    env_kwargs: dict[str, dict[str, Any]] = pydantic.Field(default_factory=dict)
    """Extra env kwargs per benchmark name."""
    save_samples: bool = True
    """Write each evaluation's samples under RUN_DIR/eval/step_N/."""
    keep_best: str | None = None
    """A metric of these evaluations to select the policy on, e.g.
    ``"eval/multihop_validation/pass@1"`` (higher is better): each time it beats every earlier
    evaluation the policy is exported to ``<out>/best-model`` (`palaestra.run.best_model`). Select
    on a validation benchmark, never on the held-out set you report."""

    @pydantic.model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.interval < 0:
            raise ValueError("eval.interval must be >= 0")
        if self.interval and not self.benchmarks:
            raise ValueError("eval.interval is set but eval.benchmarks is empty")
        if self.n < 1:
            raise ValueError("eval.n must be >= 1")
        if self.keep_best is not None:
            parts = self.keep_best.split("/")
            if len(parts) != 3 or parts[0] != "eval" or parts[1] not in self.benchmarks:
                raise ValueError(
                    f"keep_best = {self.keep_best!r} is not a metric of these evaluations: name "
                    "one as eval/<benchmark>/<metric> with <benchmark> one of "
                    f"{self.benchmarks}, e.g. 'eval/{(self.benchmarks or ['NAME'])[0]}/pass@1'")
            if not self.interval:
                raise ValueError("keep_best needs evaluations during training: set interval")
        return self


class TrainingEvaluation(Protocol):
    """What the training loop calls on an evaluator built from an `EvalConfig`."""

    def due(self, step: int) -> bool:
        """Whether step ``step`` (0 = before the first) is evaluated."""
        ...

    async def evaluate(self, engine: Engine, step: int) -> dict[str, float]:
        """Evaluate the weights ``engine`` serves now; flat metrics for the training log."""
        ...


def training_evaluator(
    config: EvalConfig,
    *,
    tokenizer: Tokenizer,
    family: str,
    max_context: int,
    tools_in_prompt: bool,
    run_dir: str | Path | None,
) -> TrainingEvaluation:
    """The benchmarks' evaluator for ``config`` (unknown benchmark names fail here, at start)."""
    module, name = _IMPLEMENTATION
    factory = getattr(importlib.import_module(module), name)
    return cast(TrainingEvaluation, factory(config, tokenizer=tokenizer, family=family,
                                            max_context=max_context,
                                            tools_in_prompt=tools_in_prompt, run_dir=run_dir))


__all__ = ["EvalConfig", "TrainingEvaluation", "training_evaluator"]
