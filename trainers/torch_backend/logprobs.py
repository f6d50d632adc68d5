"""Per-token logprobs and entropies from logits, aligned with token positions.

``logits[:, t]`` predicts token ``t + 1``, so the logprob of token ``t`` comes from
``logits[:, t - 1]``; position 0 of every sequence (and of every packed sub-sequence, whose
first logit would come from the previous sequence) gets 0 and is never trained on.

Everything is computed in float32 (bf16 log-softmax loses ~2 digits), in chunks of rows when no
gradient is needed so the float32 copy of a ``[tokens, vocab]`` logit matrix stays small.
"""

from __future__ import annotations

import torch

#: tokens per chunk of the no-grad path (4096 x 152k vocab x 4 bytes = 2.5 GB)
NO_GRAD_CHUNK = 4096


def _logprobs_entropy(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / temperature)[target]`` (and entropy) over the last dim.

    Shapes: ``logits [..., V]``, ``targets [...]``; results ``[...]`` in float32.
    """
    if temperature != 1.0:
        logits = logits / temperature
    if torch.is_grad_enabled() and logits.requires_grad:
        return _logprobs_entropy(logits, targets, with_entropy)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    parts = [
        _logprobs_entropy(flat_logits[i : i + NO_GRAD_CHUNK], flat_targets[i : i + NO_GRAD_CHUNK],
                          with_entropy)
        for i in range(0, flat_targets.shape[0], NO_GRAD_CHUNK)
    ]
    logp = torch.cat([p[0] for p in parts]).reshape(targets.shape)
    entropy = (
        torch.cat([p[1] for p in parts if p[1] is not None]).reshape(targets.shape)
        if with_entropy else None
    )
    return logp, entropy


def shifted_token_logprobs(
    logits_RLV: torch.Tensor,
    input_ids_RL: torch.Tensor,
    valid_RL: torch.Tensor,
    *,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob (and entropy) of each token given the tokens before it, ``[R, L]``.

    ``valid_RL`` is False at padding and at the first token of every sequence; those
    positions are 0.
    """
    logp, entropy = token_logprobs(
        logits_RLV[:, :-1], input_ids_RL[:, 1:], with_entropy=with_entropy,
        temperature=temperature,
    )
    zeros = torch.zeros_like(logp[:, :1])
    logp = torch.where(valid_RL, torch.cat([zeros, logp], dim=1), 0.0)
    if entropy is not None:
        entropy = torch.where(valid_RL, torch.cat([zeros, entropy], dim=1), 0.0)
    return logp, entropy


def shift_values(values_RL: torch.Tensor, valid_RL: torch.Tensor) -> torch.Tensor:
    """Critic outputs moved one position right: the value of token ``t`` is read before it."""
    zeros = torch.zeros_like(values_RL[:, :1])
    return torch.where(valid_RL, torch.cat([zeros, values_RL[:, :-1]], dim=1), 0.0)


__all__ = ["shift_values", "shifted_token_logprobs", "token_logprobs"]
