"""The Tinker API's built-in losses, per datum, summed over tokens (Tinker's convention).

Every loss reads ``logp``, the trainer's logprobs of ``target_tokens`` (with gradient), and the
datum's other ``loss_fn_inputs`` (aligned with the tokens), and returns the element-wise loss;
the datum's loss is its sum and the batch's ``loss:sum`` metric the sum over datums. With
``ratio = exp(logp - logprobs)`` (``logprobs``: the sampler's):

- ``cross_entropy``: ``-weights * logp`` (``weights`` default 1; targets may be ``[T]`` or
  ``[T, K]`` with weights of the same shape).
- ``importance_sampling``: ``-ratio * advantages``.
- ``ppo``: ``-min(ratio * A, clip(ratio, clip_low_threshold, clip_high_threshold) * A)``
  (config defaults 0.8 and 1.2).
- ``cispo``: ``-sg(clip(ratio, low, high)) * logp * A`` (same clip config).
- ``dro``: ``-(logp * A - beta / 2 * (logp - logprobs)^2)`` (config ``beta``, default 0.05).
- ``gspo``: PPO on the sequence ratio ``exp(mean(logp - logprobs))`` over the datum's
  response tokens (``sequence_ratio_mask`` if given, else those with a non-zero advantage or
  sampler logprob), spread over its tokens
  as ``sg(seq_ratio) * exp(logp - sg(logp))``; clip config defaults ``1 - 3e-4`` and
  ``1 + 4e-4``.

``stable_reinforce`` (needs the sampler's recorded stability data) and ``custom`` (server-side
custom losses) are refused; ``forward_backward_custom`` still works, since the SDK runs it on
the client with ``cross_entropy`` as the surrogate. torch is imported only when a loss runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: loss -> the loss_fn_inputs it needs besides target_tokens
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages"),
}
#: losses the SDK names that are refused, with the reason
REFUSED: dict[str, str] = {
    "stable_reinforce": "it needs stability information recorded by the sampler "
                        "(record_stability_info), which this server does not record",
    "custom": "server-side custom losses are not stored; forward_backward_custom runs the loss "
              "on the client (the server's client config says custom_loss_server_side=false)",
}
#: per-token inputs a loss may also read (a clip range per token instead of the config's)
OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
    "gspo": ("clip_low_threshold", "clip_high_threshold", "sequence_ratio_mask"),
}
#: the loss_fn_config keys each loss reads
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
    "gspo": ("clip_low_threshold", "clip_high_threshold"),
    "dro": ("beta",),
}
Config = Mapping[str, float | str]


def _num(config: Config, key: str, default: float) -> float:
    value = config.get(key, default)
    return float(value)


def _ratio(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    import torch

    return torch.exp(logp - inputs["logprobs"])


def _clip(config: Config, inputs: Mapping[str, torch.Tensor], low: float, high: float
          ) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """The clip range: per-token ``loss_fn_inputs`` if given, else the config, else defaults."""
    lo = inputs.get("clip_low_threshold")
    hi = inputs.get("clip_high_threshold")
    return (_num(config, "clip_low_threshold", low) if lo is None else lo,
            _num(config, "clip_high_threshold", high) if hi is None else hi)


def _clamp(x: torch.Tensor, low: float | torch.Tensor, high: float | torch.Tensor
           ) -> torch.Tensor:
    import torch

    lo = torch.as_tensor(low, dtype=x.dtype, device=x.device)
    hi = torch.as_tensor(high, dtype=x.dtype, device=x.device)
    return torch.minimum(torch.maximum(x, lo), hi)


def _gspo(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Config
          ) -> torch.Tensor:
    import torch

    adv, old = inputs["advantages"], inputs["logprobs"]
    mask = inputs.get("sequence_ratio_mask")
    if mask is None:
        mask = ((adv != 0) | (old != 0)).to(logp.dtype)
    count = mask.sum().clamp(min=1.0)
    seq_ratio = torch.exp(((logp - old) * mask).sum() / count)
    token_ratio = seq_ratio.detach() * torch.exp(logp - logp.detach())
    low, high = _clip(config, inputs, 1.0 - 3e-4, 1.0 + 4e-4)
    clipped = _clamp(token_ratio, low, high)
    return -torch.minimum(token_ratio * adv, clipped * adv) * mask / count


def elementwise_loss(loss_fn: str, logp: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                     config: Config) -> torch.Tensor:
    """The element-wise loss of one datum (same shape as ``logp``)."""
    import torch

    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        return -logp if weights is None else -(weights * logp)
    adv = inputs["advantages"]
    if loss_fn == "importance_sampling":
        return -_ratio(logp, inputs) * adv
    if loss_fn == "ppo":
        ratio = _ratio(logp, inputs)
        low, high = _clip(config, inputs, 0.8, 1.2)
        return -torch.minimum(ratio * adv, _clamp(ratio, low, high) * adv)
    if loss_fn == "cispo":
        low, high = _clip(config, inputs, 0.8, 1.2)
        weight = _clamp(_ratio(logp, inputs), low, high).detach()
        return -weight * logp * adv
    if loss_fn == "dro":
        beta = _num(config, "beta", 0.05)
        return -(logp * adv - 0.5 * beta * (logp - inputs["logprobs"]) ** 2)
    if loss_fn == "gspo":
        return _gspo(logp, inputs, config)
    raise ValueError(f"unknown loss {loss_fn!r}")  # validation refuses these first


__all__ = ["CONFIG_KEYS", "OPTIONAL_INPUTS", "REFUSED", "REQUIRED_INPUTS", "elementwise_loss"]
