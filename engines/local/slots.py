"""KV slot management of `LocalEngine`: which slot each running request holds, and the prefix
cache behind the slots.

The running batch always occupies slots ``0..B-1`` of the `SlotKVCache` (a decode step attends
over a plain view, no gather). A prefill copies each request's cached prefix into its slot; a
request that retires leaves its KV to the `PrefixCache` and the survivors are compacted into the
holes; a prompt that others in line share is kept right after its prefill. The scheduler decides
when; this module moves the KV. Callers run these on the engine's stream (`ModelRunner.on_stream`)
under ``torch.inference_mode``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from palaestra.engines.bitwise.decoder_config import DecoderConfig
    from palaestra.engines.local.kv_cache import SlotKVCache
    from palaestra.engines.local.prefix_cache import PrefixCache
    from palaestra.engines.local.request import LocalRequest


def new_slot_cache(cfg: DecoderConfig, *, dtype: Any, device: Any, max_length: int,
                   max_running: int) -> SlotKVCache:
    """The KV cache of a decoder: one slot per running request (8 to start with on CPU)."""
    from palaestra.engines.local.kv_cache import SlotKVCache

    cache_kw: dict[str, Any] = {}
    cache_cls: type[SlotKVCache] = SlotKVCache
    if cfg.moe is not None:  # MoE: routed experts are kept per position next to the KV
        from palaestra.engines.local.moe import SlotRouteKVCache

        cache_cls, cache_kw = SlotRouteKVCache, {"route_layers": cfg.num_layers,
                                                 "top_k": cfg.moe.top_k}
    return cache_cls(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device,
        max_length=max_length, slots=max_running if device.type == "cuda" else 8,
        **cache_kw,
    )


class KVSlots:
    """The slots of the running batch in ``cache`` and the reusable KV in ``prefix_cache``."""

    def __init__(self, cache: SlotKVCache, prefix_cache: PrefixCache | None) -> None:
        self.cache = cache
        self.prefix_cache = prefix_cache

    def load_prefixes(self, reqs: list[LocalRequest]) -> None:
        """Make room for a prefill of ``reqs`` and copy each one's cached prefix into its slot."""
        need_len = max(len(r.input_ids) for r in reqs) + 1
        self.cache.ensure(reqs[0].slot + len(reqs), need_len)
        for r in reqs:
            if r.entry is not None:
                self.cache.load(r.slot, r.entry.kv, r.cached_tokens)
                r.entry = None

    def share_prompts(self, reqs: list[LocalRequest]) -> None:
        """Keep the prompt KV of prefilled requests that others are waiting to share."""
        if self.prefix_cache is None:
            return
        for r in reqs:
            if r.share_prompt:
                r.share_prompt = False
                self.prefix_cache.insert(tuple(r.input_ids),
                                         self.cache.extract(r.slot, len(r.input_ids)),
                                         r.session_id)

    def keep_finished(self, finished: list[LocalRequest]) -> None:
        """Copy the KV of retiring requests into the prefix cache (a named adapter's KV is its
        own: not kept), and their routed experts (MoE) onto the requests."""
        cache = self.prefix_cache
        for req in finished:
            if cache is not None and req.kv_len >= cache.min_tokens and req.lora is None:
                n = req.kv_len
                tokens = tuple(req.input_ids + req.output_ids)[:n]
                cache.insert(tokens, self.cache.extract(req.slot, n), req.session_id)
        routes_of = getattr(self.cache, "routes_of", None)  # MoE: the routed experts
        if routes_of is not None:
            for req in finished:
                req.routed_experts = routes_of(req.slot, req.kv_len)

    def compact(self, running: list[LocalRequest], leaving: list[LocalRequest]) -> None:
        """Remove ``leaving`` from ``running`` (in place): tail survivors move into the holes.

        The survivors move in one batched slot move (two copy kernels for all of them), not one
        move per finished request: the GPU waits for this bookkeeping.
        """
        gone = {id(r) for r in leaving}
        keep = len(running) - sum(1 for r in running if id(r) in gone)
        holes = sorted(r.slot for r in running if id(r) in gone and r.slot < keep)
        movers = [r for r in running[keep:] if id(r) not in gone]
        compacted = list(running[:keep])
        moves = []
        for hole, req in zip(holes, movers):
            moves.append((req.slot, hole))
            compacted[hole] = req
            req.slot = hole
        if moves:
            self.cache.move_many(moves, max(r.kv_len for r in movers))
        running[:] = compacted
        for req in leaving:
            req.slot = -1

    def flush(self) -> None:
        """Drop the reusable KV (new weights or adapter: it was computed by the old ones)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()


__all__ = ["KVSlots", "new_slot_cache"]
