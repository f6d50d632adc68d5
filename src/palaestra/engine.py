"""The engine contract every component shares: token ids in, token ids + logprobs out.

Core holds it so that agents (which consume a `Generation`), rollout (which drives an `Engine`)
and trainers (which push weights into one) depend on this module, never on each other. Every
engine (embedded `LocalEngine`, `SGLangEngine` over HTTP, the `Router` over several engines,
scripted engines for tests and benchmarks) implements `Engine`; engines know no tokenizer.
``session_id`` lets a router keep an episode on one engine across turns (prefix-cache reuse);
``request_id`` lets a caller abort one request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from palaestra.errors import ConfigError, EngineError

if TYPE_CHECKING:
    import torch


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
    ignore_eos: bool = False  # keep generating past EOS (benchmarks); stop_token_ids still stop
    # token id -> additive bias on the raw logits (OpenAI/SGLang ``logit_bias``)
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        # Accept lists and dicts from callers; store hashable tuples.
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(
                self, "logit_bias", tuple((int(k), float(v)) for k, v in self.logit_bias.items())
            )
        elif not isinstance(self.logit_bias, tuple):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias))
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        """Temperature 0 or top_k 1: the argmax token (SGLang's convention)."""
        return self.temperature < 1e-6 or self.top_k == 1

    @classmethod
    def from_sglang(cls, params: Mapping[str, Any] | None) -> SamplingParams:  # type: ignore[explicit-any]
        """Parse SGLang's ``sampling_params`` object (unknown keys are an error, None = default).

        The one ``Any`` of this module: a request's JSON, passed on as it came and checked by
        ``__post_init__`` (which raises `ConfigError` for a bad value)."""
        params = dict(params or {})
        unknown = sorted(set(params) - _SGLANG_SAMPLING_KEYS)
        if unknown:
            raise ConfigError(
                f"unsupported sampling_params {unknown}; supported: {sorted(_SGLANG_SAMPLING_KEYS)}"
            )
        ignored = {k: v for k, v in params.items() if k in _SGLANG_NEUTRAL and v not in _SGLANG_NEUTRAL[k]}
        if ignored:
            raise ConfigError(
                f"sampling_params {sorted(ignored)} are not implemented by this engine; "
                "leave them at their defaults"
            )
        kw: dict[str, Any] = {}  # type: ignore[explicit-any]
        for key in ("max_new_tokens", "temperature", "top_p", "top_k"):
            if params.get(key) is not None:
                kw[key] = params[key]
        if kw.get("top_k", -1) >= 1 << 30:
            kw["top_k"] = -1
        stop = params.get("stop")
        if stop:
            kw["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        if params.get("stop_token_ids"):
            kw["stop_token_ids"] = tuple(int(t) for t in params["stop_token_ids"])
        if params.get("sampling_seed") is not None:
            kw["seed"] = int(params["sampling_seed"])
        if params.get("ignore_eos"):
            kw["ignore_eos"] = True
        if params.get("logit_bias"):
            kw["logit_bias"] = tuple((int(k), float(v)) for k, v in params["logit_bias"].items())
        return cls(**kw)

    def to_sglang(self) -> dict[str, object]:
        """The ``sampling_params`` object of SGLang's ``/generate``."""
        out: dict[str, object] = {
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
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.logit_bias:
            out["logit_bias"] = {str(k): v for k, v in self.logit_bias}
        return out


# Keys of SGLang's SamplingParams (python/sglang/srt/sampling/sampling_params.py) we accept; the
# ones in _SGLANG_NEUTRAL are accepted only at their neutral value.
_SGLANG_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
        "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
        "logit_bias", "sampling_seed", "stream_interval", "json_schema", "regex", "ebnf",
        "structural_tag", "custom_params", "stop_regex",
    }
)
_SGLANG_NEUTRAL: dict[str, tuple[object, ...]] = {
    "min_p": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_new_tokens": (None, 0),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "stop_regex": (None, "", ()),
}


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
    meta: Mapping[str, object] = field(default_factory=dict)


class EngineUnavailableError(EngineError):
    """The engine could not be reached or failed on its side (connection error, HTTP 5xx).

    Retryable: a router sends the request to another engine. Bad requests raise `EngineError`.
    """


@runtime_checkable
class TokenGenerator(Protocol):
    """What an episode needs from an engine: token-in/token-out generation (a worker hands its
    episodes a gate over the engine that implements only this)."""

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


@runtime_checkable
class Engine(TokenGenerator, Protocol):
    """Token-in/token-out generation with weight updates and request control."""

    async def update_weights(
        self,
        state_dict: Mapping[str, torch.Tensor] | None = None,
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


# ---------------------------------------------------------------------- capabilities
# What an engine can do beyond `Engine`, checked once with ``isinstance`` where a run is built
# (e.g. `palaestra.run.fleet.weight_pushes.build_push`), never probed with ``hasattr`` per call.


@runtime_checkable
class AdapterHost(Protocol):
    """Applies a trainer's LoRA adapter in process (the embedded engine)."""

    async def update_adapter(self, state: Mapping[str, torch.Tensor], config: Mapping[str, object], *,
                             name: str = "policy", version: int | None = None) -> None: ...


@runtime_checkable
class AdapterServing(Protocol):
    """Loads and unloads named LoRA adapters from folders (SGLang's ``/load_lora_adapter``);
    ``default_lora`` is the adapter a request without one is served with."""

    default_lora: str | None

    async def load_lora_adapter(self, name: str, path: str) -> object: ...

    async def unload_lora_adapter(self, name: str) -> object: ...


@runtime_checkable
class MemoryReleasing(Protocol):
    """Frees its GPU memory while a colocated trainer trains and takes it back afterwards."""

    async def release_memory(self, tags: Sequence[str] | None = None) -> None: ...

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None: ...


@runtime_checkable
class DeviceMemory(Protocol):
    """Reports the device memory it holds in this process (the embedded engine: its KV cache
    and the weights it keeps on the GPU), measured by a colocated run at each phase switch."""

    def device_bytes(self) -> int: ...


@runtime_checkable
class EngineStats(Protocol):
    """Counts its scheduler's work (seconds, steps, tokens since start), which a run logs per
    step as ``engine/*`` (the embedded engine; servers report through their own endpoints)."""

    @property
    def stats(self) -> Mapping[str, float]: ...


@runtime_checkable
class UpdatesInPlace(Protocol):
    """Applies ``update_weights`` between two decode steps while requests keep running (the
    embedded engine): a rollout manager need not park in-flight episodes around a push, they
    go on and record the version change in their tokens' spans."""

    updates_in_place: bool


@runtime_checkable
class OnDevice(Protocol):
    """Computes in this process on ``device`` in ``dtype`` (the embedded engine): a weight
    push hands it tensors there."""

    device: torch.device
    dtype: torch.dtype


__all__ = [
    "AdapterHost",
    "AdapterServing",
    "DeviceMemory",
    "Engine",
    "EngineStats",
    "EngineUnavailableError",
    "Generation",
    "MemoryReleasing",
    "OnDevice",
    "SamplingParams",
    "TokenGenerator",
    "UpdatesInPlace",
]
