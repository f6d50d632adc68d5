"""The engine protocol: token ids in, token ids + logprobs out (engines know no tokenizer).

Every engine (embedded `LocalEngine`, `SGLangEngine` over HTTP, the `Router` over several
engines, scripted engines for tests and benchmarks) implements `Engine`. ``session_id`` lets a
router keep an episode on one engine across turns (prefix-cache reuse); ``request_id`` lets a
caller abort one request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (SGLang's ``sampling_params`` names where they exist)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def to_sglang(self) -> dict[str, Any]:
        """The ``sampling_params`` object of SGLang's ``/generate``."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            out["stop"] = list(self.stop)
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out


@dataclass(frozen=True)
class Generation:
    """What an engine returns for one request.

    ``finish_reason`` is ``"stop"`` (EOS or a stop token/string), ``"length"`` (max_new_tokens or
    context), or ``"abort"`` (aborted; the tokens so far are valid and can be resumed).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    weight_version: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    meta: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """Token-in/token-out generation with weight updates and request control."""

    @property
    def weight_version(self) -> int: ...

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> Generation: ...

    async def update_weights(
        self,
        state_dict: Mapping[str, Any] | None = None,
        *,
        path: str | None = None,
        version: int | None = None,
    ) -> None: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def abort(self, request_ids: Sequence[str] | None = None) -> None: ...

    async def flush_cache(self) -> None: ...

    async def health(self) -> bool: ...

    async def close(self) -> None: ...
