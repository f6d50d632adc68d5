"""The sampling step of `LocalEngine`'s batches: logit biases, logits processors, and the
uniform numbers each row draws, prepared once per compute call (`BatchSampler.plan`).

The per-row math (temperature, top-k, top-p, the logprob convention) is `sampling.RowSampler`;
this module decides what a batch of requests feeds it: which rows get a bias, which draw from
their own seeded generator, and how ``k`` decode steps share one host-to-device copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from palaestra.engines.local.sampling import RowSampler

if TYPE_CHECKING:
    import torch

    from palaestra.engines.local.request import LocalRequest, LogitsProcessor


@dataclass(frozen=True)
class SamplingPlan:
    """Per-call sampling inputs of a batch (see `BatchSampler.plan`)."""

    biases: list[tuple[Any, Any, Any]]  # (row, token ids, values) on the device
    sampler: RowSampler  # the batch's per-row settings, on the device once per call
    uniforms: Any  # [k, B] float32 on the device, None when every row is greedy


class BatchSampler:
    """Samples the next token of every row of a batch; ``logits_processors`` edit the logits
    first (the engine's `LocalEngine.logits_processors` is this same list)."""

    def __init__(self, vocab_size: int, device: torch.device | str, seed: int) -> None:
        import torch

        self.vocab_size = vocab_size
        self.device = device
        self.logits_processors: list[LogitsProcessor] = []
        #: bitwise on-policy mode: logprobs from the batch-invariant log-softmax
        self.invariant = False
        self._rng = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, reqs: list[LocalRequest]
               ) -> tuple[list[list[int]], list[list[float]]]:
        """One step for every row, on the host: ([[token]] per row, [[logprob]] per row)."""
        import torch

        tokens, logprobs = self.sample_device(logits, reqs, self.plan(reqs, 1), 0)
        both = torch.stack((tokens.to(torch.float32), logprobs)).cpu()
        return [[int(t)] for t in both[0].tolist()], [[lp] for lp in both[1].tolist()]

    def plan(self, reqs: list[LocalRequest], k: int) -> SamplingPlan:
        """What ``k`` sampling steps of this batch need, built once per decode call.

        The per-row Python (logit biases, per-request generators) runs once per call, not once
        per step: a seeded row draws its ``k`` uniforms in one call, which gives the numbers
        ``k`` single draws would (as does the shared generator's ``[k, B]`` draw), so a seeded
        request samples the same tokens whatever ``k`` and its batch are.
        """
        import torch

        dev = self.device
        biases = []
        for row, req in enumerate(reqs):
            if req.sampling.logit_bias:  # rare: the loop is cheap Python when unused
                pairs = req.sampling.logit_bias
                biases.append((row, torch.tensor([t for t, _ in pairs], device=dev),
                               torch.tensor([v for _, v in pairs], device=dev)))
        params = [r.sampling for r in reqs]
        uniforms = None
        if not all(p.greedy for p in params):
            uniforms = torch.rand(k, len(reqs), generator=self._rng)
            seeded = [(row, r.generator) for row, r in enumerate(reqs) if r.generator is not None]
            if seeded:
                rows = torch.tensor([row for row, _ in seeded])
                uniforms[:, rows] = torch.stack([torch.rand(k, generator=g) for _, g in seeded],
                                                dim=1)
            uniforms = uniforms.to(dev)  # one host-to-device copy per call
        sampler = RowSampler([p.temperature for p in params], [p.top_p for p in params],
                             [p.top_k for p in params], self.vocab_size, dev,
                             invariant=self.invariant)
        return SamplingPlan(biases, sampler, uniforms)

    def sample_device(self, logits: torch.Tensor, reqs: list[LocalRequest],
                      plan: SamplingPlan, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step`` of ``plan``: tokens and logprobs stay on the device."""
        for row, ids, vals in plan.biases:
            logits[row].index_add_(0, ids, vals)
        for proc in self.logits_processors:
            proc(logits, reqs)
        return plan.sampler.sample(logits, None if plan.uniforms is None else plan.uniforms[step])


__all__ = ["BatchSampler", "SamplingPlan"]
