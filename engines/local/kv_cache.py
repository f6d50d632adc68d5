"""The KV cache of `LocalEngine`: one slot per running request, running slots kept contiguous.

Layout: one tensor each for K and V, ``[layers, slots, kv_heads, length, head_dim]``, so
``k[layer]`` is a contiguous ``[slots, kv_heads, length, head_dim]`` view. The running batch
always occupies slots ``0..B-1``, so a decode step attends over the plain view
``k[layer][:B, :, :L]`` with no gather; when a request leaves, the last running slot is moved into
its place. Moving, extracting or loading a slot touches every layer at once: two copy kernels
(K and V), not two per layer (at 28 layers that was ~112 launches per finished request, paid
while the GPU waited for the scheduler). Capacity grows on demand (rounded up, zero
filled: masked positions must hold finite numbers, since ``0 * nan`` is ``nan``).

Finished requests' KV is copied out into a `PrefixCache` entry (see `prefix_cache`), so a next
turn that extends the same tokens copies it back instead of recomputing it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from palaestra.errors import EngineError

if TYPE_CHECKING:
    import torch


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class SlotKVCache:
    """Per-layer K/V tensors indexed by slot and position; grows by reallocation."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                 device: torch.device | str, max_length: int, slots: int = 8, length: int = 256,
                 length_granularity: int = 256) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.max_length = max_length
        self.granularity = length_granularity
        self.slots = 0
        self.length = 0
        self.k: torch.Tensor = self._empty()  # [layers, slots, kv_heads, length, head_dim]
        self.v: torch.Tensor = self._empty()
        self.generation = 0  # bumped on every reallocation (CUDA graphs capture addresses)
        self.ensure(slots, min(length, max_length))

    @property
    def bytes_per_token(self) -> int:
        import torch

        size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * size

    def num_bytes(self) -> int:
        return self.slots * self.length * self.bytes_per_token

    def ensure(self, slots: int, length: int) -> None:
        """Grow (never shrink) to hold ``slots`` slots of ``length`` positions."""
        import torch

        if length > self.max_length:
            raise EngineError(
                f"a sequence of {length} tokens exceeds the engine's max length {self.max_length}"
            )
        if slots <= self.slots and length <= self.length:
            return
        new_slots = max(slots, self.slots)
        if slots > self.slots:
            new_slots = max(slots, min(2 * self.slots, slots + 64)) if self.slots else slots
        new_len = max(self.length, min(_round_up(length, self.granularity), self.max_length))
        if length > self.length and self.length:  # grow geometrically: few reallocations
            new_len = max(new_len, min(2 * self.length, self.max_length))
        with torch.inference_mode():
            # K then V: the old K is freed before the new V is made (peak: old + one new)
            self.k = self._grown(self.k, new_slots, new_len)
            self.v = self._grown(self.v, new_slots, new_len)
        self.slots, self.length = new_slots, new_len
        self.generation += 1

    def _empty(self) -> torch.Tensor:
        import torch

        return torch.zeros(self.num_layers, 0, self.num_kv_heads, 0, self.head_dim,
                           dtype=self.dtype, device=self.device)

    def _grown(self, old: torch.Tensor, slots: int, length: int) -> torch.Tensor:
        import torch

        fresh = torch.zeros(self.num_layers, slots, self.num_kv_heads, length, self.head_dim,
                            dtype=self.dtype, device=self.device)
        fresh[:, : old.shape[1], :, : old.shape[3]] = old
        return fresh

    def _stores(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.slots == 0:
            raise EngineError("the KV cache was released: call ensure() before using it")
        return self.k, self.v

    def release(self) -> None:
        """Free the tensors (``release_memory_occupation``); `ensure` reallocates."""
        self.k, self.v = self._empty(), self._empty()
        self.slots = self.length = 0
        self.generation += 1

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions into slot ``dst``."""
        if src == dst or length <= 0:
            return
        for t in self._stores():
            t[:, dst, :, :length] = t[:, src, :, :length]

    def move_many(self, moves: list[tuple[int, int]], length: int) -> None:
        """Apply ``(src, dst)`` slot copies of the first ``length`` positions at once.

        The sources and destinations must be disjoint (a compaction: survivors from the tail
        move into holes), so one gather and one scatter per tensor do them all.
        """
        import torch

        moves = [(s, d) for s, d in moves if s != d]
        if not moves or length <= 0:
            return
        if len(moves) == 1:
            self.move(moves[0][0], moves[0][1], length)
            return
        k, _ = self._stores()
        src = torch.tensor([s for s, _ in moves], device=k.device)
        dst = torch.tensor([d for _, d in moves], device=k.device)
        for t in self._stores():
            t[:, dst, :, :length] = t[:, src, :, :length]

    def extract(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the slot's first ``length`` positions: two ``[layers, kv_heads, len, dim]``."""
        k, v = self._stores()
        return k[:, slot, :, :length].clone(), v[:, slot, :, :length].clone()

    def load(self, slot: int, kv: tuple[torch.Tensor, torch.Tensor], length: int) -> None:
        """Write the first ``length`` positions of an extracted entry into ``slot``."""
        k, v = kv
        store_k, store_v = self._stores()
        store_k[:, slot, :, :length] = k[:, :, :length]
        store_v[:, slot, :, :length] = v[:, :, :length]


__all__ = ["SlotKVCache"]
