"""CUDA graphs for `LocalEngine`'s decode step: one graph per (batch bucket, key-length bucket).

A decode step of a small model launches a few hundred kernels; replaying a captured graph turns
that into one launch, which is most of the gap to the memory-bandwidth bound at small sizes.
The batch is padded up to a bucket (padding rows decode token 0 at position 0 in free slots) and
the attended key length up to a multiple of ``key_granularity``, so a few graphs cover a whole
run. Graphs capture tensor addresses: weights are updated in place (graphs stay valid); a KV
cache reallocation or a device move drops them and they are captured again on demand.
Capture and replay run on the engine's own stream (the current one when `run` is called), in
thread-local capture mode, so a training thread on the same GPU can keep launching kernels.

`run_sampled` replays a graph that also samples (`RowSampler.sample` captured after the forward
pass, keyed by the sampler's `structure` too): a decode step is then one replay and a few
input copies, with no sampling kernels launched from the host. The batch's per-row settings are
copied into the graph's static `RowSampler` once per batch (not per step) and its uniforms once
per step; the sampled tokens and logprobs are those of the same ops run eagerly, up to the float
rounding of reductions whose kernels depend on the row count (the graph runs the padded batch).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from palaestra.engines.local.kv_cache import SlotKVCache
    from palaestra.engines.local.model import Decoder
    from palaestra.engines.local.sampling import RowSampler

#: Held while a decode graph is captured. A device-wide synchronize (a profiler starting or
#: stopping, `palaestra.benchmarks.perf.idle`) from another thread during a capture fails with
#: "operation not permitted when stream is capturing" and invalidates the capture, so such a
#: caller takes this lock first.
CAPTURE_LOCK = threading.Lock()

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class _Graph:
    """One captured decode step: its static inputs and outputs."""

    def __init__(self, graph: Any, tokens: Any, positions: Any, out: Any,
                 sampler: RowSampler | None = None, uniforms: Any = None) -> None:
        self.graph = graph
        self.tokens = tokens
        self.positions = positions
        self.out = out  # logits [bp, V], or (tokens [bp], logprobs [bp]) for a sampling graph
        self.sampler = sampler  # static settings a sampling graph reads
        self.uniforms = uniforms  # [bp] float32, None for an all-greedy sampler
        self.loaded: RowSampler | None = None  # whose settings `sampler` holds now


class DecodeGraphs:
    """Lazily captured decode graphs keyed by (padded batch, padded key length, sampler
    structure or None for graphs that return logits)."""

    #: `LocalEngine` samples inside the graphs when no logit bias or processor needs the logits
    sample_in_graph = True

    def __init__(self, decoder: Decoder, cache: SlotKVCache, max_batch: int,
                 key_granularity: int = 64, max_graphs: int = 96) -> None:
        self.decoder = decoder
        self.cache = cache
        self.buckets = [b for b in _BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.key_granularity = key_granularity
        self.max_graphs = max_graphs
        self._graphs: dict[tuple[Any, ...], _Graph] = {}
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

    def supports(self, b: int, key_len: int, sampler: RowSampler | None = None) -> bool:
        bucket = self._bucket(b, key_len)
        if bucket is None:
            return False
        self.cache.ensure(*bucket)
        if self.cache.generation != self._generation:
            self.reset()
        key = (*bucket, None if sampler is None else sampler.structure)
        return key in self._graphs or len(self._graphs) < self.max_graphs

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, key_len: int) -> torch.Tensor:
        """Replay for device tensors ``tokens`` and ``positions`` (no host sync); logits [B, V]."""
        entry = self._replay(tokens, positions, key_len, None, None)
        return entry.out[: positions.shape[0]]

    def run_sampled(self, tokens: torch.Tensor, positions: torch.Tensor, key_len: int,
                    sampler: RowSampler, uniforms: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay a graph that decodes and samples with ``sampler`` (this batch's `RowSampler`)
        and ``uniforms`` ``[B]`` (None when every row is greedy); (tokens [B], logprobs [B])."""
        b = positions.shape[0]
        entry = self._replay(tokens, positions, key_len, sampler, uniforms)
        # copies: the next replay of this graph overwrites its outputs, and the engine keeps
        # every step's tokens until its one host sync
        return entry.out[0][:b].clone(), entry.out[1][:b].clone()

    def _replay(self, tokens: torch.Tensor, positions: torch.Tensor, key_len: int,
                sampler: RowSampler | None, uniforms: torch.Tensor | None) -> _Graph:
        b = positions.shape[0]
        bucket = self._bucket(b, key_len)
        assert bucket is not None
        key = (*bucket, None if sampler is None else sampler.structure)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(*bucket, sampler)
        if b < bucket[0]:  # padding rows: token 0 at position 0 of free slots
            entry.tokens[b:].zero_()
            entry.positions[b:].zero_()
        entry.tokens[:b].copy_(tokens)
        entry.positions[:b].copy_(positions)
        if sampler is not None and entry.sampler is not None:
            if entry.loaded is not sampler:  # once per batch: its settings are fixed
                entry.sampler.load(sampler)
                entry.loaded = sampler
            if entry.uniforms is not None and uniforms is not None:
                entry.uniforms[:b].copy_(uniforms)
        entry.graph.replay()
        self.replays += 1
        return entry

    def _capture(self, bp: int, lp: int, sampler: RowSampler | None = None) -> _Graph:
        import torch

        dev = self.decoder.device
        tok_buf = torch.zeros(bp, dtype=torch.long, device=dev)
        pos_buf = torch.zeros(bp, dtype=torch.long, device=dev)
        static = None if sampler is None else sampler.static_copy(bp)
        u_buf = None
        if static is not None and not static.all_greedy:
            u_buf = torch.full((bp,), 0.5, dtype=torch.float32, device=dev)

        def step() -> Any:
            logits = self.decoder.decode(tok_buf, pos_buf, self.cache, lp)
            return logits if static is None else static.sample(logits, u_buf)

        # The warm-up really runs: it writes position lp - 1 of every slot, which no live request
        # has filled yet (all of them are shorter than lp - 1 before this step). Padding rows of
        # replays write position 0 of free slots (slots >= b hold no live request).
        pos_buf.fill_(lp - 1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        pos_buf.zero_()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread-local capture: CUDA calls of other threads (a trainer stepping in async mode)
        # neither fail nor invalidate this capture
        with CAPTURE_LOCK, torch.cuda.graph(graph, pool=self._pool,
                                            capture_error_mode="thread_local"):
            out = step()
        self.captures += 1
        return _Graph(graph, tok_buf, pos_buf, out, static, u_buf)


__all__ = ["CAPTURE_LOCK", "DecodeGraphs"]
