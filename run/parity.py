"""The full-vocabulary parity check: the engine's and the trainer's whole next-token
distributions, compared on a sample of positions every RL step (``trainer.parity_positions``).

``rollout/logprob_max_abs_diff`` compares the sampled token's logprob only. Here, at
``trainer.parity_positions`` trained positions drawn at random from the step's batch, both
sides give the full ``log_softmax(logits / T)`` over the vocabulary with the weights that
sampled the batch (before the step's update):

- the engine's: `palaestra.engines.local.parity` (the embedded engine re-runs its forward on the
  sequence and applies its sampler's log-softmax; in bitwise mode those are the bits it sampled
  from, see there);
- the trainer's: `TorchBackend.full_logprobs` (the torch backend's own forward).

Logged per step: ``rollout/full_vocab_logprob_max_abs_diff`` (the largest
``|log p_engine - log p_trainer|`` over the positions and the vocabulary),
``rollout/full_vocab_tv`` (the largest total-variation distance ``1/2 sum |p_engine -
p_trainer|`` over the positions; its mean is ``rollout/full_vocab_tv_mean``),
``rollout/full_vocab_positions`` (how many were compared), ``time/parity_s`` (what the two
forwards cost) and, in sync mode,
``rollout/full_vocab_replay_max_abs_diff``: how far the engine's re-run is from the logprob it
reported for the sampled token while sampling (0.0 in bitwise mode: the re-run is the sampling
forward; in the default mode the rounding of a one-sequence prefill against a batched decode
step). In bitwise mode the first two are exactly 0.0 (`tests/run/test_bitwise_run.py`).

Runs where both sides are in this process: the embedded engine (``engine.kind = "local"``, no
``[placement]``) and the torch backend; off elsewhere.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from palaestra.engines.local.parity import FullLogprobsRequest
    from palaestra.run.config import TrainConfig
    from palaestra.trainers.batching import TrainBatch
    from palaestra.types import Sample

MAX_ABS_DIFF = "rollout/full_vocab_logprob_max_abs_diff"
TV = "rollout/full_vocab_tv"
TV_MEAN = "rollout/full_vocab_tv_mean"
POSITIONS = "rollout/full_vocab_positions"
REPLAY_MAX_ABS_DIFF = "rollout/full_vocab_replay_max_abs_diff"
#: what the check cost this step (both forwards)
SECONDS = "time/parity_s"


@runtime_checkable
class FullLogprobsEngine(Protocol):
    """An engine that answers `FullLogprobsRequest` (the embedded engine)."""

    async def full_logprobs(self, request: FullLogprobsRequest) -> torch.Tensor: ...


@runtime_checkable
class FullLogprobsTrainer(Protocol):
    """A trainer backend with the policy's full next-token distributions (the torch one)."""

    def full_logprobs(self, token_ids: Sequence[Sequence[int]],
                      positions: Sequence[Sequence[int]]) -> torch.Tensor: ...


def choose_positions(loss_mask: Sequence[torch.Tensor], count: int, rng: random.Random
                     ) -> dict[int, list[int]]:
    """Up to ``count`` trained positions (``loss_mask > 0``, never a sequence's first token)
    drawn uniformly without replacement: {sequence: sorted positions}."""
    trained = [(i, int(t)) for i, mask in enumerate(loss_mask)
               for t in (mask > 0).nonzero().flatten().tolist() if t >= 1]
    chosen: dict[int, list[int]] = {}
    for i, t in rng.sample(trained, min(count, len(trained))):
        chosen.setdefault(i, []).append(t)
    return {i: sorted(ts) for i, ts in sorted(chosen.items())}


def compare(engine_logp: torch.Tensor, trainer_logp: torch.Tensor) -> tuple[float, list[float]]:
    """(the largest ``|difference|`` of two ``[P, V]`` log-distributions, each position's
    total-variation distance), in float64. Equal entries count 0 (both ``-inf`` included)."""
    import torch

    if engine_logp.shape != trainer_logp.shape:
        raise ValueError(f"engine {tuple(engine_logp.shape)} vs trainer "
                         f"{tuple(trainer_logp.shape)}: the two sides disagree on the "
                         "positions or the vocabulary")
    a, b = engine_logp.double(), trainer_logp.double()
    diff = torch.where(a == b, 0.0, (a - b).abs())
    tv = 0.5 * (a.exp() - b.exp()).abs().sum(dim=-1)
    return float(diff.max()) if diff.numel() else 0.0, tv.tolist()


async def measure(engine: FullLogprobsEngine, trainer: FullLogprobsTrainer, batch: TrainBatch,
                  *, count: int, temperature: float, rng: random.Random, replay: bool
                  ) -> dict[str, float]:
    """The step's parity metrics (empty when the batch has no trained position); ``replay``:
    also compare the engine's re-run with the sampled tokens' reported logprobs (only when
    the engine still holds the weights that sampled every sequence: sync mode)."""
    import asyncio

    import torch

    from palaestra.engines.local.parity import FullLogprobsRequest

    chosen = choose_positions(batch.loss_mask, count, rng)
    if not chosen:
        return {}
    seqs = [[int(t) for t in batch.token_ids[i].tolist()] for i in chosen]
    positions = list(chosen.values())
    engine_parts = [await engine.full_logprobs(FullLogprobsRequest.of(ids, pos, temperature))
                    for ids, pos in zip(seqs, positions)]
    engine_logp = torch.cat(engine_parts)
    trainer_logp = await asyncio.to_thread(trainer.full_logprobs, seqs, positions)
    max_abs, tvs = compare(engine_logp, trainer_logp)
    out = {MAX_ABS_DIFF: max_abs, TV: max(tvs), TV_MEAN: sum(tvs) / len(tvs),
           POSITIONS: float(len(tvs))}
    if replay and batch.rollout_logprobs is not None:
        sampled = torch.tensor([ids[t] for ids, pos in zip(seqs, positions) for t in pos])
        rerun = engine_logp.gather(1, sampled[:, None]).squeeze(1).double()
        reported = torch.cat([batch.rollout_logprobs[i][pos].double()
                              for i, pos in chosen.items()])
        out[REPLAY_MAX_ABS_DIFF] = float(torch.where(rerun == reported, 0.0,
                                                     (rerun - reported).abs()).max())
    return out


class ParityCheck:
    """The check of one RL phase: `build` decides whether it runs, `step` measures a batch."""

    def __init__(self, engine: FullLogprobsEngine, trainer: FullLogprobsTrainer, *, count: int,
                 temperature: float, seed: int, replay: bool) -> None:
        self.engine, self.trainer = engine, trainer
        self.count, self.temperature, self.seed, self.replay = count, temperature, seed, replay

    @classmethod
    def build(cls, cfg: TrainConfig, engine: object, trainer: object) -> ParityCheck | None:
        """The run's check, or None: ``trainer.parity_positions = 0``, or a side that is not in
        this process (SGLang servers, engine actors, a Megatron, trainer-group or FSDP
        backend), or colocated phases (one side's weights are off the device during the other's)."""
        count = cfg.trainer.parity_positions
        if count == 0 or cfg.placement is not None:
            return None
        if not isinstance(engine, FullLogprobsEngine) or not isinstance(trainer,
                                                                         FullLogprobsTrainer):
            return None
        if getattr(trainer, "fsdp", False):  # sharded ranks: no one process holds the policy
            return None
        return cls(engine, trainer, count=count, temperature=cfg.rollout.temperature,
                   seed=cfg.seed, replay=cfg.rollout.mode == "sync")

    async def step(self, samples: Sequence[Sample], step: int) -> dict[str, float]:
        """The parity metrics of a step's batch, before the step's update (positions drawn
        from a generator of the run's seed and the step: the same on a resumed run)."""
        import time

        from palaestra.trainers.batching import TrainBatch

        if not samples:
            return {}
        start = time.perf_counter()
        rng = random.Random(f"parity-{self.seed}-{step}")
        out = await measure(self.engine, self.trainer, TrainBatch.from_samples(samples),
                            count=self.count, temperature=self.temperature, rng=rng,
                            replay=self.replay)
        out[SECONDS] = time.perf_counter() - start
        return out


__all__ = ["MAX_ABS_DIFF", "POSITIONS", "REPLAY_MAX_ABS_DIFF", "SECONDS", "TV", "TV_MEAN",
           "FullLogprobsEngine", "FullLogprobsTrainer", "ParityCheck", "choose_positions", "compare",
           "measure"]
