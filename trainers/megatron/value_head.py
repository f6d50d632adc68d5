"""A critic's value head for a megatron `GPTModel`: it takes the place of the LM output layer.

`GPTModel` calls ``output_layer(hidden, weight=..., runtime_gather_output=...)`` and expects
``(logits, bias)``; this head answers with one value per token, ``[s, b, 1]``. Every TP rank holds
it whole (its input, the final hidden states, is already replicated), and it is initialised from a
fixed seed so all data-parallel replicas start equal. HF's counterpart is the ``score`` linear of
``*ForTokenClassification`` with ``num_labels = 1``.
"""

from __future__ import annotations

from typing import Any

import torch


class ValueHead(torch.nn.Module):
    """``hidden -> 1`` linear with bias, shaped like megatron's output layer call."""

    def __init__(self, hidden_size: int, *, init_std: float, dtype: torch.dtype,
                 device: torch.device | str | None = None, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        weight = torch.empty(1, hidden_size).normal_(0.0, init_std, generator=generator)
        self.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype))

    def forward(self, hidden_states: torch.Tensor, weight: Any = None,
                runtime_gather_output: Any = None) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


__all__ = ["ValueHead"]
