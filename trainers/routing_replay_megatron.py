"""MoE routing replay for the Megatron-core backend, through megatron-core's own ``RouterReplay``.

megatron-core (``megatron/core/transformer/moe/router_replay.py``) gives every MoE router a
``RouterReplay`` when the model's ``TransformerConfig(moe_enable_routing_replay=True)``: with the
action ``REPLAY_FORWARD`` the router takes its ``target_topk_idx`` instead of its own top-k and
gathers their probabilities from its scores (so the router still gets gradients), and with
``REPLAY_BACKWARD`` a recomputation in the backward pass pops the ids of the forwards in order
(what a pipeline schedule needs: its backwards run in forward order).

`MegatronRoutingReplay` feeds those instances from a micro-batch's ``routed_experts`` (``[1, W,
layers, top_k]``, the packed row of `palaestra.trainers.batching`): per MoE layer the column of
its global layer index, padded like the row, and cut to this rank's sequence-parallel chunk.
Ids of -1 (tokens the engine never ran: the last token, a trailing observation) become experts
``0..k-1``: those tokens' outputs feed no trained logprob.

Use around `MegatronBackend._forward`: ``before_forward(mb.routed_experts, width)``, the model
call, ``after_forward()``; and ``finish()`` once the schedule returned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError

if TYPE_CHECKING:
    import torch


def config_overrides() -> dict[str, Any]:
    """``TransformerConfig`` fields routing replay needs (the fused router bypasses it)."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    if "moe_enable_routing_replay" not in names:
        raise ConfigError("this megatron-core has no moe_enable_routing_replay; routing replay "
                          "with the megatron backend needs megatron-core 0.15 or newer")
    out: dict[str, Any] = {"moe_enable_routing_replay": True}
    if "moe_router_fusion" in names:
        out["moe_router_fusion"] = False
    return out


def _replays(model: torch.nn.Module) -> list[tuple[int, Any]]:
    """(global 0-based layer index, RouterReplay) of this pipeline stage's MoE layers."""
    found = []
    for module in model.modules():
        mlp = getattr(module, "mlp", None)
        router = getattr(mlp, "router", None)
        replay = getattr(router, "router_replay", None)
        number = getattr(module, "layer_number", None)
        if replay is not None and number is not None:
            found.append((int(number) - 1, replay))
    return sorted(found, key=lambda item: item[0])


class MegatronRoutingReplay:
    """Drives megatron-core's per-router ``RouterReplay`` from rollout routes."""

    def __init__(self, model: torch.nn.Module, *, sequence_parallel: bool = False, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        try:
            from megatron.core.transformer.moe.router_replay import RouterReplayAction
        except ImportError as exc:  # megatron-core before router replay
            raise ConfigError(
                "routing replay with the megatron backend needs a megatron-core with "
                "megatron.core.transformer.moe.router_replay (0.15 or newer)"
            ) from exc
        self._action = RouterReplayAction
        self.replays = _replays(model)
        if not self.replays:
            raise ConfigError(
                "routing_replay = 'rollout' found no RouterReplay in the Megatron model: build "
                "it with config_overrides() (moe_enable_routing_replay=True) and an MoE policy"
            )
        self.split = sequence_parallel and tp_size > 1
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._armed: list[Any] = []

    def before_forward(self, routes: torch.Tensor | None, width: int) -> None:
        """Set each MoE router's target ids for the next forward of a ``width``-token row."""
        import torch

        self._armed = []
        if routes is None:
            for _, replay in self.replays:
                replay.clear_router_replay_action()
            return
        flat = routes.reshape(-1, *routes.shape[2:])  # [W, layers, k]
        k = flat.shape[-1]
        if flat.shape[0] > width:
            raise ConfigError(f"routing replay: {flat.shape[0]} routed tokens for a {width}-token row")
        for layer, replay in self.replays:
            if layer >= flat.shape[1]:
                raise ConfigError(
                    f"routing replay: the routes have {flat.shape[1]} layers, the model's MoE "
                    f"layer {layer} has none; the engine must serve the trained architecture"
                )
            ids = flat[:, layer].long()
            if flat.shape[0] < width:
                ids = torch.cat([ids, ids.new_full((width - flat.shape[0], k), -1)])
            fallback = torch.arange(k, device=ids.device).expand_as(ids)
            ids = torch.where((ids < 0).any(-1, keepdim=True), fallback, ids)
            if self.split:
                chunk = width // self.tp_size
                ids = ids[self.tp_rank * chunk : (self.tp_rank + 1) * chunk]
            replay.set_target_indices(ids.to(torch.cuda.current_device()
                                             if torch.cuda.is_available() else "cpu"))
            replay.set_router_replay_action(self._action.REPLAY_FORWARD)
            self._armed.append(replay)

    def after_forward(self) -> None:
        """A recomputation in the backward pass pops the ids this forward used."""
        for replay in self._armed:
            replay.set_router_replay_action(self._action.REPLAY_BACKWARD)
        self._armed = []

    def finish(self) -> None:
        """Drop every target and action (after a whole forward-backward schedule)."""
        for _, replay in self.replays:
            replay.clear_indices()
            replay.clear_router_replay_action()


__all__ = ["MegatronRoutingReplay", "config_overrides"]
