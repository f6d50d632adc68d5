"""The KV cache of `LocalEngine`: one slot per running request, running slots kept contiguous.

Layout per layer: ``k[layer]`` and ``v[layer]`` of shape ``[slots, kv_heads, length, head_dim]``.
The running batch always occupies slots ``0..B-1``, so a decode step attends over the plain view
``k[layer][:B, :, :L]`` with no gather; when a request leaves, the last running slot is moved into
its place (one copy of that request's positions). Capacity grows on demand (rounded up, zero
filled: masked positions must hold finite numbers, since ``0 * nan`` is ``nan``).

Finished requests' KV is copied out into a `PrefixCache` entry (see `prefix_cache`), so a next
turn that extends the same tokens copies it back instead of recomputing it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from palaestra.errors import EngineError

if TYPE_CHECKING:
    import torch


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class SlotKVCache:
    """Per-layer K/V tensors indexed by slot and position; grows by reallocation."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, dtype: Any,
                 device: Any, max_length: int, slots: int = 8, length: int = 256,
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
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
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
            for store in (self.k, self.v):
                for i in range(self.num_layers):
                    fresh = torch.zeros(new_slots, self.num_kv_heads, new_len, self.head_dim,
                                        dtype=self.dtype, device=self.device)
                    if i < len(store):
                        old = store[i]
                        fresh[: old.shape[0], :, : old.shape[2]] = old
                        store[i] = fresh  # the old tensor is freed before the next is made
                    else:
                        store.append(fresh)
        self.slots, self.length = new_slots, new_len
        self.generation += 1

    def release(self) -> None:
        """Free the tensors (``release_memory_occupation``); `ensure` reallocates."""
        self.k, self.v = [], []
        self.slots = self.length = 0
        self.generation += 1

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions into slot ``dst``."""
        if src == dst or length <= 0:
            return
        for store in (self.k, self.v):
            for t in store:
                t[dst, :, :length] = t[src, :, :length]

    def extract(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the slot's first ``length`` positions: two ``[layers, kv_heads, len, dim]``."""
        import torch

        k = torch.stack([t[slot, :, :length] for t in self.k])
        v = torch.stack([t[slot, :, :length] for t in self.v])
        return k, v

    def load(self, slot: int, kv: tuple[torch.Tensor, torch.Tensor], length: int) -> None:
        """Write the first ``length`` positions of an extracted entry into ``slot``."""
        k, v = kv
        for i in range(self.num_layers):
            self.k[i][slot, :, :length] = k[i, :, :length]
            self.v[i][slot, :, :length] = v[i, :, :length]


__all__ = ["SlotKVCache"]
