"""Sampling for every client through one embedded engine (`LocalEngine`) with named adapters.

Each sampler (a training client's saved weights) is a LoRA adapter loaded into the engine
under its own name (low-rank mode: never merged, so rows of one batch can run different
adapters); the base model is the engine with no adapter. `sample` turns the SDK's sampling
parameters into the engine's, runs ``num_samples`` requests at once (continuous batching) and,
when asked, scores the prompt with the same adapter (`LocalEngine.full_logprobs`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from palaestra.engine import SamplingParams
from palaestra.tinker_api.errors import ApiError
from palaestra.tinker_api.wire import SampledOut, SampleOut

if TYPE_CHECKING:
    import torch

    from palaestra.engines.local.local import LocalEngine


@dataclass(frozen=True)
class SampleSpec:
    """The SDK's ``SamplingParams`` and prompt-logprob options of one request."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None


def engine_params(spec: SampleSpec, index: int) -> SamplingParams:
    """The engine's parameters for sample ``index`` (a seed gives every sample its own seed).

    ``stop=None`` stops at EOS; a given stop (a string, strings or token ids) replaces EOS, and
    ``[]`` stops at nothing but ``max_tokens``, as the SDK documents."""
    stop_strs: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    if isinstance(spec.stop, str):
        stop_strs = (spec.stop,)
    elif spec.stop is not None:
        items = list(spec.stop)
        strs = [s for s in items if isinstance(s, str)]
        ints = [s for s in items if isinstance(s, int) and not isinstance(s, bool)]
        if len(strs) == len(items):
            stop_strs = tuple(strs)
        elif len(ints) == len(items):
            stop_ids = tuple(ints)
        else:
            raise ApiError("stop must be a string, a list of strings or a list of token ids")
    seed = None if spec.seed is None else (spec.seed + index) % (1 << 63)
    try:
        return SamplingParams(
            max_new_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p,
            top_k=spec.top_k, stop_token_ids=stop_ids, stop=stop_strs, seed=seed,
            ignore_eos=spec.stop is not None)
    except ValueError as exc:  # ConfigError from SamplingParams' checks
        raise ApiError(f"bad sampling_params: {exc}") from exc


class SamplerEngine:
    """The engine and the adapters loaded into it."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine

    @classmethod
    def build(cls, model_dir: str, device: str, max_running: int) -> SamplerEngine:
        from palaestra.engines.local.local import LocalEngine

        return cls(LocalEngine(model_dir, device=device, lora_mode="lowrank",
                               max_running=max_running, seed=0))

    @property
    def vocab_size(self) -> int:
        return int(self.engine.decoder.config.vocab_size)

    @property
    def max_context(self) -> int:
        return int(self.engine.max_model_len)

    async def load(self, name: str, state: Mapping[str, torch.Tensor],
                   config: Mapping[str, Any]) -> None:
        """Serve an adapter (peft tensors and config) as ``name``."""
        from palaestra.engines.local.lora import LoraAdapter

        adapter = LoraAdapter.from_peft(name, state, config)
        await self.engine.load_lora_adapter(name, adapter=adapter)

    async def load_folder(self, name: str, path: str) -> None:
        """Serve a peft adapter folder as ``name`` (no-op when already loaded)."""
        if name not in self.engine.lora_adapters:
            await self.engine.load_lora_adapter(name, path)

    async def unload(self, name: str) -> bool:
        """Stop serving ``name``; False while a request still uses it."""
        from palaestra.errors import EngineError

        try:
            await self.engine.unload_lora_adapter(name)
        except EngineError:
            return False
        return True

    async def sample(self, prompt: Sequence[int], num_samples: int, spec: SampleSpec,
                     lora: str | None) -> SampleOut:
        """``num_samples`` sequences (and prompt logprobs when asked) from adapter ``lora``."""
        gens = await asyncio.gather(*(
            self.engine.generate(list(prompt), engine_params(spec, i), lora=lora)
            for i in range(num_samples)))
        out = SampleOut([SampledOut(list(g.token_ids), list(g.logprobs),
                                    "stop" if g.finish_reason == "stop" else "length")
                         for g in gens])
        if spec.prompt_logprobs or spec.topk_prompt_logprobs > 0:
            await self._score_prompt(prompt, spec, lora, out)
        return out

    async def _score_prompt(self, prompt: Sequence[int], spec: SampleSpec, lora: str | None,
                            out: SampleOut) -> None:
        """Fill ``out``'s prompt logprobs (NaN at position 0 and before the last n)."""
        from palaestra.engines.local.parity import FullLogprobsRequest

        n = len(prompt)
        first = 1 if spec.prompt_logprobs_last_n is None else n - spec.prompt_logprobs_last_n
        if n < 2 or first < 1:
            raise ApiError(f"prompt logprobs need a prompt of 2+ tokens and last_n within "
                           f"1..{max(n - 1, 1)}")
        positions = list(range(first, n))
        dist = await self.engine.full_logprobs(FullLogprobsRequest.of(prompt, positions),
                                               lora=lora)
        idx = np.asarray(prompt[first:], dtype=np.int64)
        values = dist.numpy()[np.arange(len(positions)), idx]
        out.prompt_logprobs = [math.nan] * first + values.astype(float).tolist()
        k = spec.topk_prompt_logprobs
        if k > 0:
            top = dist.topk(min(k, dist.shape[1]), dim=-1)
            ids = np.zeros((n, k), dtype=np.int32)
            lps = np.full((n, k), -99999.0, dtype=np.float32)
            ids[first:, :top.indices.shape[1]] = top.indices.numpy()
            lps[first:, :top.values.shape[1]] = top.values.numpy()
            out.topk_ids, out.topk_logprobs = ids, lps

    async def close(self) -> None:
        await self.engine.close()


__all__ = ["SampleSpec", "SamplerEngine", "engine_params"]
