"""The torch backend's full next-token distributions at chosen positions (the trainer side of
the full-vocabulary parity check, `palaestra.run.parity`).

The sequences run as one micro-batch through the policy's own forward, in eval mode, without
autograd, with the weights and adapter the next train step starts from: in bitwise mode the
batch-invariant forward the training loss uses (`bitwise.full_logprobs`, the engine's bits), in
the default mode the model's forward under the backend's autocast and the output layer on the
chosen positions' hidden states, ``log_softmax(logits / T)`` in float32 as the default logprob
path computes it (`logprobs.token_logprobs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch

    from palaestra.trainers.micro_batches import MicroBatch
    from palaestra.trainers.torch_backend.bitwise import BitwiseForward


def full_logprobs(token_ids: Sequence[Sequence[int]], positions: Sequence[Sequence[int]], *,
                  model: torch.nn.Module, device: torch.device, pack: bool, temperature: float,
                  bitwise: BitwiseForward | None,
                  hidden_states: Callable[[MicroBatch], torch.Tensor],
                  autocast: Callable[[], AbstractContextManager[object]]) -> torch.Tensor:
    """Float32 ``[P, V]`` on the CPU, P the number of positions in all, sequence after
    sequence (see `TorchBackend.full_logprobs`, which passes its model, its forward to the last
    hidden states and its autocast)."""
    import torch

    from palaestra.trainers.micro_batches import build_micro_batch

    if len(token_ids) != len(positions):
        raise ValueError("one list of positions per sequence")
    for ids, pos in zip(token_ids, positions):
        if any(not 1 <= p < len(ids) for p in pos):
            raise ValueError(f"positions {list(pos)} outside 1..{len(ids) - 1}")
    seqs = [torch.tensor(list(ids), dtype=torch.long) for ids in token_ids]
    mb = build_micro_batch(seqs, list(range(len(seqs))), pack=pack).to(device)
    width = mb.input_ids.shape[1]
    # the hidden state that predicts token t of a sequence sits one position before it
    flat = [row * width + start + p - 1
            for (row, start, _), pos in zip(mb.spans, positions) for p in pos]
    rows = torch.tensor(flat, dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        if bitwise is not None:
            out = bitwise.full_logprobs(model, mb, rows, temperature=temperature)
        else:
            head = model.get_output_embeddings()  # type: ignore[operator]
            with torch.no_grad():
                hidden = hidden_states(mb)
                with autocast():
                    logits = head(hidden.reshape(-1, hidden.shape[-1])[rows])
            t = temperature if temperature > 1e-6 else 1.0
            out = torch.log_softmax(logits.float() / t, dim=-1)
    finally:
        if was_training:
            model.train()
    return out.float().cpu()


__all__ = ["full_logprobs"]
