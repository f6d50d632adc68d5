"""MoE routing replay ("R3"): the training forward uses the experts the rollout engine chose.

The rollout engine records, per token and MoE layer, the top-k expert ids it routed to
(``Sample.routed_experts``, ``[tokens, layers, top_k]``, -1 = not recorded). Different kernels
and batch shapes make the trainer's router pick other experts on near-ties, so its logprobs
drift from the sampled ones; replaying the recorded ids removes that source of mismatch.

`RoutingReplay` patches the forward of every Hugging Face top-k router of a model (transformers'
``Qwen3MoeTopKRouter`` and ``DeepseekV3TopkRouter``: ``weight``, ``top_k``, ``norm_topk_prob``).
While ``routes`` is set, a router runs as usual, then takes the recorded expert ids instead of
its own top-k; their gate weights are gathered from its scores (the softmax for Qwen3-MoE,
renormalised when ``norm_topk_prob``; DeepSeek-V3's sigmoid without the balancing bias, scaled
by ``routed_scaling_factor``), so the router keeps getting gradients through the probabilities
of the experts it is made to use. Tokens whose ids are -1 keep the router's own choice.

The routes stay set until the next micro-batch replaces them, so a recomputation of the forward
in the backward pass (activation checkpointing) replays the same ids.
"""

from __future__ import annotations

import re
import types
from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError

if TYPE_CHECKING:
    import torch

ROUTING_REPLAY_MODES = ("off", "rollout")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_routers(model: torch.nn.Module) -> dict[int, Any]:
    """Layer index -> top-k router module of an HF MoE model (empty for dense models)."""
    found: dict[int, Any] = {}
    for name, module in model.named_modules():
        if not all(hasattr(module, a) for a in ("weight", "top_k", "norm_topk_prob")):
            continue
        if not type(module).__name__.endswith("Router"):
            continue
        match = _LAYER.search(name)
        if match is not None:
            found[int(match.group(1))] = module
    return found


def _forced_weights(router: Any, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gate weights of the experts ``ids`` from the router's own scores (differentiable)."""
    import torch

    if hasattr(router, "e_score_correction_bias"):  # DeepSeek-V3: sigmoid scores, no bias
        weights = logits.float().sigmoid().gather(1, ids)
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * float(getattr(router, "routed_scaling_factor", 1.0))
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def _replayed_forward(router: Any, state: RoutingReplay, layer: int) -> Any:
    original = type(router).forward

    def forward(self: Any, hidden_states: torch.Tensor) -> tuple[Any, Any, Any]:
        import torch

        logits, weights, ids = original(self, hidden_states)
        forced = state.forced(layer, logits.shape[0], self.top_k, logits.device)
        if forced is None:
            return logits, weights, ids
        free = (forced < 0).any(dim=-1, keepdim=True)
        ids = torch.where(free, ids, forced)
        replayed = _forced_weights(self, logits, ids).to(weights.dtype)
        state.replayed_tokens += int((~free).sum())
        return logits, torch.where(free, weights, replayed), ids

    return types.MethodType(forward, router)


class RoutingReplay:
    """Forces recorded expert choices into a model's routers (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = find_routers(model)
        if not self.routers:
            raise ConfigError(
                "routing_replay = 'rollout' needs an MoE policy, but this model has no top-k "
                "router modules; set trainer.routing_replay = 'off' for dense models"
            )
        self.routes: torch.Tensor | None = None  # [rows * width, layers, top_k]
        self.replayed_tokens = 0
        for layer, router in self.routers.items():
            router.forward = _replayed_forward(router, self, layer)

    def set(self, routes: torch.Tensor | None) -> None:
        """The micro-batch's ``[R, L, layers, top_k]`` routes (None: every router is free)."""
        self.routes = None if routes is None else routes.reshape(-1, *routes.shape[2:])

    def forced(self, layer: int, tokens: int, top_k: int, device: torch.device | str) -> torch.Tensor | None:
        routes = self.routes
        if routes is None:
            return None
        if routes.shape[0] != tokens:
            raise ConfigError(
                f"routing replay: the router of layer {layer} sees {tokens} tokens but the "
                f"micro-batch carries routes of {routes.shape[0]}"
            )
        if layer >= routes.shape[1] or routes.shape[2] != top_k:
            raise ConfigError(
                f"routing replay: routes of shape [tokens, {routes.shape[1]}, {routes.shape[2]}] "
                f"do not fit layer {layer} with top_k={top_k}; the rollout engine must serve "
                "the same MoE architecture as the trainer"
            )
        return routes[:, layer].to(device=device, dtype=_long())


def _long() -> Any:
    import torch

    return torch.long


__all__ = ["ROUTING_REPLAY_MODES", "RoutingReplay", "find_routers"]
