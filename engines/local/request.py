"""A request inside `LocalEngine` (`LocalRequest`), the chunks a streaming one yields
(`StreamChunk`), and the logits-processor hook that sees both (`LogitsProcessor`).

The scheduler, the KV slots, the sampler and the model runner all read these records; they hold
no behaviour beyond the one derived length (`LocalRequest.kv_len`), so every module of the engine
can import them without importing each other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from palaestra.engine import Generation, SamplingParams
from palaestra.engines.local.prefix_cache import PrefixEntry

if TYPE_CHECKING:
    import torch

#: logits processor: called with the float32 logits ``[B, V]`` of a step (edit them in place) and
#: the B requests (`LocalRequest`: ``request_id``, ``input_ids``, ``output_ids``, ``sampling``).
LogitsProcessor = Callable[["torch.Tensor", Sequence["LocalRequest"]], None]


@dataclass(eq=False)
class LocalRequest:
    """One request inside `LocalEngine` (read-only for logits processors)."""

    request_id: str
    input_ids: list[int]
    sampling: SamplingParams
    session_id: str | None
    future: asyncio.Future[Generation]
    stream: asyncio.Queue[Any] | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    entry: PrefixEntry | None = None
    slot: int = -1
    abort_message: str | None = None
    stop_ids: frozenset[int] = frozenset()
    generator: Any = None
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    share_prompt: bool = False  # keep the prompt's KV after prefill: others wait for it
    routed_experts: Any = None  # MoE: int16 [kv_len, layers, top_k], set when it retires
    lora: str | None = None  # the LoRA adapter it names (None: the engine's default adapter)
    created: float = field(default_factory=time.perf_counter)

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is in the cache (all but the last sampled one)."""
        return len(self.input_ids) + max(len(self.output_ids) - 1, 0)


@dataclass(frozen=True)
class StreamChunk:
    """Tokens a streaming request gained in one step; ``generation`` is set on the last chunk."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    generation: Generation | None = None


__all__ = ["LocalRequest", "LogitsProcessor", "StreamChunk"]
