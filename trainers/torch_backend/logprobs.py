"""Per-token logprobs and entropies from logits, aligned with token positions.

``logits[:, t]`` predicts token ``t + 1``, so the logprob of token ``t`` comes from
``logits[:, t - 1]``; position 0 of every sequence (and of every packed sub-sequence, whose
first logit would come from the previous sequence) gets 0 and is never trained on.

Everything is computed in float32 (bf16 log-softmax loses ~2 digits), in chunks of rows, so the
float32 copy of a ``[tokens, vocab]`` logit matrix never exists whole (the backward recomputes
each chunk). `palaestra.trainers.torch_backend.fused_logprobs` goes one step further and skips
the logits themselves.
"""

from __future__ import annotations

import torch

#: rows per chunk of the float32 work (4096 x 152k vocab x 4 bytes = 2.5 GB)
NO_GRAD_CHUNK = 4096


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / temperature)[target]`` (and entropy) over the last dim.

    Shapes: ``logits [..., V]``, ``targets [...]``; results ``[...]`` in float32. The float32
    work runs in chunks of rows, with or without a gradient: the Megatron backend's one-rank
    `vocab_parallel_logprobs`, whose backward recomputes each chunk's softmax instead of
    keeping float32 ``[tokens, V]`` copies.
    """
    from palaestra.trainers.megatron.logprobs import vocab_parallel_logprobs

    if temperature != 1.0:
        logits = logits / temperature
    return vocab_parallel_logprobs(logits, targets, with_entropy=with_entropy,
                                   chunk_rows=NO_GRAD_CHUNK)


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
