"""Batched sampling and the logprob convention shared by the engines and the trainers.

**Logprob convention.** The logprob an engine reports for a sampled token is
``log_softmax(logits / T)[token]`` where ``logits`` are the model's raw float32 logits (plus any
``logit_bias``), ``T`` is the request's temperature (``T = 1`` for greedy requests), and top-k /
top-p filtering is **not** applied. This is SGLang's default (its sampler scales by temperature
before the softmax that yields ``output_token_logprobs``; top-k/top-p only restrict which token is
drawn) and what slime and verl compute on the training side: the trainer scales its logits by the
same rollout temperature and calls `token_logprobs` below, so the two sides agree to float
precision (the tests check 1e-4 against a full forward pass).

Sampling draws one uniform number per row and inverts the CDF of the filtered, renormalised
distribution. Rows with a seed draw it from their own generator, so a seeded request samples the
same tokens whichever batch it shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Logprobs of ``token_ids`` under ``softmax(logits / temperature)`` (``[..., V] -> [...]``).

    The trainer-side twin of the engines' sampling logprobs: call it on the policy's logits of the
    positions that predicted each sampled token, with the rollout's temperature (0 means greedy and
    is treated as 1).
    """
    import torch

    t = temperature if temperature > 1e-6 else 1.0
    logp = torch.log_softmax(logits.float() / t, dim=-1)
    return logp.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


def sampling_log_probs(logits: torch.Tensor, temperatures: torch.Tensor, *, invariant: bool
                       ) -> torch.Tensor:
    """The full distribution each row of float32 ``logits [B, V]`` samples from, as
    ``log_softmax(logits / T)`` with ``temperatures [B]`` (1 for greedy rows): the batch-invariant
    log-softmax in bitwise mode (``invariant``), torch's otherwise. `RowSampler.sample` and the
    engine's full-vocabulary parity request (`palaestra.engines.local.parity`) both call it, so
    the distribution a parity check reads is the one sampling drew from."""
    import torch

    if invariant:
        from palaestra.engines.bitwise.invariant import divide_by_temperature, log_softmax

        return log_softmax(divide_by_temperature(logits, temperatures))
    return torch.log_softmax(logits / temperatures[:, None].to(logits.dtype), dim=-1)


class RowSampler:
    """What sampling a batch needs, built once per batch and reused for every decode step.

    The per-row Python (which rows are greedy, which filter, their temperatures, top-k and
    top-p) and its host-to-device copies run once per engine call instead of once per step: at
    a batch of 256 they cost more host time than the sampling kernels take on the GPU.
    ``temperatures[b] == 0`` (or ``top_ks[b] == 1``) picks the argmax.
    """

    def __init__(self, temperatures: Sequence[float], top_ps: Sequence[float],
                 top_ks: Sequence[int], vocab: int, device: torch.device | str,
                 dtype: torch.dtype | None = None, *, invariant: bool = False) -> None:
        import torch

        #: bitwise on-policy mode: the logprobs from the batch-invariant log-softmax
        #: (`palaestra.engines.bitwise.invariant`), the trainer's in the same mode
        self.invariant = invariant
        greedy = [t < 1e-6 or k == 1 for t, k in zip(temperatures, top_ks)]
        self.vocab = vocab
        self.all_greedy = all(greedy)
        self.any_greedy = any(greedy)
        self.needs_filter = any(
            not g and (0 < k < vocab or p < 1.0) for g, k, p in zip(greedy, top_ks, top_ps))
        dtype = dtype or torch.float32
        self.temps = torch.tensor([1.0 if g else t for g, t in zip(greedy, temperatures)],
                                  dtype=dtype).to(device, non_blocking=True)
        self.greedy_mask = torch.tensor(greedy).to(device) if self.any_greedy else None
        self.ks = self.ps = None
        if self.needs_filter:
            self.ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks]).to(device)
            self.ps = torch.tensor(list(top_ps), dtype=dtype).to(device)

    @property
    def structure(self) -> tuple[bool, bool, bool]:
        """What decides which kernels `sample` launches (a captured graph holds one of them)."""
        return self.all_greedy, self.any_greedy, self.needs_filter

    def static_copy(self, rows: int) -> RowSampler:
        """A sampler of this one's `structure` over ``rows`` (>= its own) rows whose tensors are
        its own buffers, the static inputs of a CUDA graph that samples inside it; `load` fills
        them. Rows never loaded keep neutral settings (T = 1, no top-k/top-p, greedy where the
        structure has greedy rows): padding rows of a graph sample harmlessly."""
        import copy

        import torch

        out = copy.copy(self)
        dev = self.temps.device
        out.temps = torch.ones(rows, dtype=self.temps.dtype, device=dev)
        if self.greedy_mask is not None:
            out.greedy_mask = torch.ones(rows, dtype=torch.bool, device=dev)
        if self.ks is not None and self.ps is not None:
            out.ks = torch.full((rows,), self.vocab, dtype=self.ks.dtype, device=dev)
            out.ps = torch.ones(rows, dtype=self.ps.dtype, device=dev)
        return out

    def load(self, batch: RowSampler) -> None:
        """Copy the per-row settings of ``batch`` (same `structure`, at most as many rows) into
        the first rows of this `static_copy`."""
        b = batch.temps.shape[0]
        self.temps[:b].copy_(batch.temps)
        for mine, theirs in ((self.greedy_mask, batch.greedy_mask), (self.ks, batch.ks),
                             (self.ps, batch.ps)):
            if mine is not None and theirs is not None:
                mine[:b].copy_(theirs)

    def sample(self, logits: torch.Tensor, uniforms: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row of ``logits`` ``[B, V]`` (float32); returns (tokens, logprobs).

        ``uniforms`` holds one number in [0, 1) per row (ignored for greedy rows; may be None
        when every row is greedy).
        """
        import torch

        vocab = self.vocab
        if self.invariant:
            from palaestra.engines.bitwise.invariant import log_softmax as invariant_log_softmax

            if self.all_greedy:
                tokens = logits.argmax(dim=-1)
                return tokens, invariant_log_softmax(logits).gather(1, tokens[:, None]).squeeze(1)
        if self.all_greedy:
            tokens = logits.argmax(dim=-1)
            # logit - logsumexp: one read of the logits, no [B, V] log_softmax written
            logp = logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
            return tokens, logp
        logp_all = sampling_log_probs(logits, self.temps, invariant=self.invariant)
        probs = logp_all.exp()
        assert uniforms is not None, "uniforms are required when a row samples"
        u = uniforms.to(device=logits.device, dtype=logits.dtype)
        if self.needs_filter:
            assert self.ks is not None and self.ps is not None
            sorted_p, order = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=logits.device)
            keep = ranks[None, :] < self.ks[:, None]
            # top-p: keep the smallest prefix whose mass reaches p (the first token always stays)
            before = sorted_p.cumsum(dim=-1) - sorted_p
            keep &= before < self.ps[:, None].to(logits.dtype)
            cdf = torch.where(keep, sorted_p, torch.zeros_like(sorted_p)).cumsum(dim=-1)
            pos = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
            # ``keep`` is a prefix of the sorted order: never step past its last token (rounding)
            pos = torch.minimum(pos, keep.sum(dim=-1, keepdim=True) - 1)
            sampled = order.gather(1, pos).squeeze(1)
        else:
            cdf = probs.cumsum(dim=-1)
            pos = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(
                max=vocab - 1)
            sampled = pos.squeeze(1)
        if self.greedy_mask is not None:
            sampled = torch.where(self.greedy_mask, logits.argmax(dim=-1), sampled)
        return sampled, logp_all.gather(1, sampled[:, None]).squeeze(1)


def sample_rows(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    top_ks: Sequence[int],
    uniforms: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` ``[B, V]`` (float32); returns (tokens, logprobs).

    One step of `RowSampler` (see there); an engine that samples the same batch for several
    steps builds the sampler once.
    """
    return RowSampler(temperatures, top_ps, top_ks, logits.shape[-1], logits.device,
                      logits.dtype).sample(logits, uniforms)


__all__ = ["RowSampler", "sample_rows", "sampling_log_probs", "token_logprobs"]
