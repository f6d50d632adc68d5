"""CUDA graphs for `LocalEngine`'s decode step: one graph per (batch bucket, key-length bucket).

A decode step of a small model launches a few hundred kernels; replaying a captured graph turns
that into one launch, which is most of the gap to the memory-bandwidth bound at small sizes.
The batch is padded up to a bucket (padding rows decode token 0 at position 0 in free slots) and
the attended key length up to a multiple of ``key_granularity``, so a few graphs cover a whole
run. Graphs capture tensor addresses: weights are updated in place (graphs stay valid); a KV
cache reallocation or a device move drops them and they are captured again on demand.
Capture and replay run on the engine's own stream (the current one when `run` is called), in
thread-local capture mode, so a training thread on the same GPU can keep launching kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from palaestra.engines.local.kv_cache import SlotKVCache
    from palaestra.engines.local.model import Decoder

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    """Lazily captured decode graphs keyed by (padded batch, padded key length)."""

    def __init__(self, decoder: Decoder, cache: SlotKVCache, max_batch: int,
                 key_granularity: int = 64, max_graphs: int = 96) -> None:
        self.decoder = decoder
        self.cache = cache
        self.buckets = [b for b in _BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.key_granularity = key_granularity
        self.max_graphs = max_graphs
        self._graphs: dict[tuple[int, int], tuple[Any, Any, Any, Any]] = {}
        self._pool: Any = None
        self._generation = cache.generation
        self.captures = 0
        self.replays = 0

    def reset(self) -> None:
        # a pool whose graphs are all gone cannot take new captures: start a fresh one
        self._graphs.clear()
        self._pool = None
        self._generation = self.cache.generation

    def weights_changed(self) -> None:
        """Weights are copied in place, so captured graphs stay valid."""

    def _bucket(self, b: int, key_len: int) -> tuple[int, int] | None:
        bp = next((x for x in self.buckets if x >= b), None)
        if bp is None:
            return None
        g = self.key_granularity
        lp = min(-(-key_len // g) * g, self.cache.max_length)
        return bp, lp

    def supports(self, b: int, key_len: int) -> bool:
        key = self._bucket(b, key_len)
        if key is None:
            return False
        self.cache.ensure(*key)
        if self.cache.generation != self._generation:
            self.reset()
        return key in self._graphs or len(self._graphs) < self.max_graphs

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, key_len: int) -> torch.Tensor:
        """Replay for device tensors ``tokens`` and ``positions`` (no host sync); logits [B, V]."""
        b = positions.shape[0]
        key = self._bucket(b, key_len)
        assert key is not None
        if key not in self._graphs:
            self._graphs[key] = self._capture(*key)
        graph, tok_buf, pos_buf, out = self._graphs[key]
        if b < key[0]:  # padding rows: token 0 at position 0 of free slots
            tok_buf[b:].zero_()
            pos_buf[b:].zero_()
        tok_buf[:b].copy_(tokens)
        pos_buf[:b].copy_(positions)
        graph.replay()
        self.replays += 1
        return out[:b]

    def _capture(self, bp: int, lp: int) -> tuple[Any, Any, Any, Any]:
        import torch

        dev = self.decoder.device
        tok_buf = torch.zeros(bp, dtype=torch.long, device=dev)
        pos_buf = torch.zeros(bp, dtype=torch.long, device=dev)
        # The warm-up really runs: it writes position lp - 1 of every slot, which no live request
        # has filled yet (all of them are shorter than lp - 1 before this step). Padding rows of
        # replays write position 0 of free slots (slots >= b hold no live request).
        pos_buf.fill_(lp - 1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.decoder.decode(tok_buf, pos_buf, self.cache, lp)
        torch.cuda.current_stream().wait_stream(stream)
        pos_buf.zero_()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread-local capture: CUDA calls of other threads (a trainer stepping in async mode)
        # neither fail nor invalidate this capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.decoder.decode(tok_buf, pos_buf, self.cache, lp)
        self.captures += 1
        return graph, tok_buf, pos_buf, out


__all__ = ["DecodeGraphs"]
