"""Mixture-of-experts pieces of the embedded engine: Qwen3-MoE sparse blocks and routed-expert capture.

`Decoder` (`palaestra.engines.local.model`) runs a ``qwen3_moe`` checkpoint with the same fused
attention as the dense models; the MLP of a sparse layer is `moe_forward`: a softmax router, its
top-k (renormalised when ``norm_topk_prob``), then the experts batched per expert: the (token,
slot) pairs are sorted by expert and each active expert runs one gate+up GEMM and one down GEMM
over its rows; the weighted outputs are scattered back with one ``index_add_``. The maths is the
transformers ``Qwen3MoeSparseMoeBlock``'s (tests compare logits and greedy tokens).

Routed experts (routing replay, "R3"): every forward writes each token's chosen expert ids per
layer into the `SlotRouteKVCache`, next to its K/V at the same (slot, position), so prefix reuse
and slot moves carry them like KV does. A finished request's ``Generation.meta["routed_experts"]``
is an int16 tensor ``[prompt + output - 1, num_layers, top_k]`` (every token the model ran on;
-1 on dense layers), SGLang's ``return_routed_experts`` layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from palaestra.engines.bitwise.decoder_config import MoEConfig
from palaestra.engines.local.kv_cache import SlotKVCache
from palaestra.errors import EngineError

if TYPE_CHECKING:
    import torch

#: placeholder expert id of dense layers and unknown positions
NO_EXPERT = -1


def route(x: torch.Tensor, router_w: torch.Tensor, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids ``[N, K]`` and their gate weights (x's dtype) of tokens ``x [N, H]``."""
    import torch
    import torch.nn.functional as F

    probs = torch.softmax(F.linear(x, router_w), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(x.dtype)


def experts_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``sum_k weights[n, k] * expert_{ids[n, k]}(x[n])``, batched per expert (sorted tokens).

    ``gate_up [E, 2I, H]`` (gate rows first) and ``down [E, H, I]`` are the transformers
    ``Qwen3MoeExperts`` tensors. One host read of the per-expert counts per call.
    """
    import torch
    import torch.nn.functional as F

    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token_of = order // k
    rows = x[token_of]  # [N * K, H], grouped by expert
    row_w = weights.reshape(-1)[order].unsqueeze(-1)
    out = torch.empty_like(rows)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        g, u = F.linear(rows[start:end], gate_up[e]).chunk(2, dim=-1)
        out[start:end] = F.linear(F.silu(g) * u, down[e])
        start = end
    result = torch.zeros_like(x)
    result.index_add_(0, token_of, out * row_w)
    return result


def encode_routed_experts(routes: torch.Tensor) -> str:
    """SGLang's ``meta_info["routed_experts"]``: base64 of the int32 ``[positions, layers,
    top_k]`` array, row-major (`decode_routed_experts` reverses it)."""
    import base64

    import torch

    data = routes.to(torch.int32).contiguous().numpy().tobytes()
    return base64.b64encode(data).decode("ascii")


def decode_routed_experts(payload: str, num_layers: int, top_k: int) -> torch.Tensor:
    """An SGLang ``routed_experts`` payload as an int16 tensor ``[positions, layers, top_k]``."""
    import base64

    import numpy as np
    import torch

    flat = np.frombuffer(base64.b64decode(payload), dtype=np.int32)
    if flat.size % (num_layers * top_k):
        raise EngineError(
            f"routed_experts has {flat.size} ids, not a multiple of num_layers * top_k = "
            f"{num_layers} * {top_k}; pass the served model's layer count and top-k"
        )
    return torch.from_numpy(flat.astype(np.int16)).view(-1, num_layers, top_k)


class RoutedKV(tuple):  # type: ignore[type-arg]
    """An extracted ``(k, v)`` pair that also carries the positions' routed experts (``routes``).

    Unpacks like the plain pair, so the prefix cache stores and hands it back unchanged.
    """

    routes: Any = None


class SlotRouteKVCache(SlotKVCache):
    """`SlotKVCache` plus ``routes [slots, length, num_layers, top_k]`` (int16, -1 = none)."""

    def __init__(self, *args: Any, route_layers: int, top_k: int, **kwargs: Any) -> None:
        self.route_layers = route_layers
        self.top_k = top_k
        self.routes: Any = None
        super().__init__(*args, **kwargs)

    def ensure(self, slots: int, length: int) -> None:
        import torch

        super().ensure(slots, length)
        old = self.routes
        if old is not None and tuple(old.shape[:2]) == (self.slots, self.length):
            return
        fresh = torch.full((self.slots, self.length, self.route_layers, self.top_k), NO_EXPERT,
                           dtype=torch.int16, device=self.device)
        if old is not None and old.numel():
            fresh[: old.shape[0], : old.shape[1]] = old
        self.routes = fresh

    def release(self) -> None:
        super().release()
        self.routes = None

    def move(self, src: int, dst: int, length: int) -> None:
        super().move(src, dst, length)
        if src != dst and length > 0:
            self.routes[dst, :length] = self.routes[src, :length]

    def move_many(self, moves: list[tuple[int, int]], length: int) -> None:
        import torch

        super().move_many(moves, length)
        moves = [(s, d) for s, d in moves if s != d]
        if len(moves) > 1 and length > 0:  # one move was done by `move` above
            src = torch.tensor([s for s, _ in moves], device=self.routes.device)
            dst = torch.tensor([d for _, d in moves], device=self.routes.device)
            self.routes[dst, :length] = self.routes[src, :length]

    def extract(self, slot: int, length: int) -> RoutedKV:  # type: ignore[override]
        kv = RoutedKV(super().extract(slot, length))
        kv.routes = self.routes[slot, :length].clone()
        return kv

    def load(self, slot: int, kv: tuple[torch.Tensor, torch.Tensor], length: int) -> None:
        super().load(slot, kv, length)
        routes = getattr(kv, "routes", None)
        if routes is None:
            self.routes[slot, :length] = NO_EXPERT
        else:
            self.routes[slot, :length] = routes[:length]

    def write(self, slot_ids: torch.Tensor, positions: torch.Tensor,
              layer_ids: list[torch.Tensor | None]) -> None:
        """Store one forward's choices: ``layer_ids[i]`` is ``[N, K]`` (None on dense layers)."""
        import torch

        n = positions.shape[0]
        full = torch.full((n, self.route_layers, self.top_k), NO_EXPERT, dtype=torch.int16,
                          device=positions.device)
        for i, ids in enumerate(layer_ids):
            if ids is not None:
                full[:, i] = ids.to(torch.int16)
        self.routes[slot_ids, positions] = full

    def routes_of(self, slot: int, length: int) -> torch.Tensor:
        """A CPU copy of the slot's first ``length`` positions' routes."""
        return self.routes[slot, :length].to("cpu", copy=True)


__all__ = [
    "NO_EXPERT",
    "MoEConfig",
    "RoutedKV",
    "SlotRouteKVCache",
    "decode_routed_experts",
    "encode_routed_experts",
    "experts_forward",
    "route",
]
