"""`LocalEngine`: the embedded engine (CPU, or CUDA where present) with continuous batching.

The engine is a facade over four parts, one job each: `scheduler` (requests in, admission,
the prefill/decode loop, each request's end), `slots` (the running batch's KV slots and the
prefix cache behind them), `batch_sampling` (the sampling step of a batch) and `runner` (the
compute calls on a worker thread and the engine's CUDA stream, CUDA graphs). Requests join and
leave the running batch between steps, and a weight update, pause or abort takes effect at the
next step boundary; the forward passes run in one worker thread (torch releases the GIL), so the
event loop (an HTTP server, the rollout's episodes) stays responsive while the model computes.

Everything a request gets back is token-exact: the sampled ids, ``log_softmax(logits / T)`` of
each (see `palaestra.engines.local.sampling`), the finish reason, the prompt tokens served from
the prefix cache, and the weight version (with spans when an update landed mid-generation).

    engine = LocalEngine("runs/tiny-model")
    gen = await engine.generate(ids, SamplingParams(max_new_tokens=32, temperature=0))
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.engine import Generation, SamplingParams
from palaestra.engines.local.batch_sampling import BatchSampler
from palaestra.engines.local.prefix_cache import PrefixCache
from palaestra.engines.local.request import LocalRequest, LogitsProcessor, StreamChunk
from palaestra.engines.local.runner import ModelRunner, choose_decode_attention
from palaestra.engines.local.scheduler import Scheduler
from palaestra.engines.local.slots import KVSlots, new_slot_cache
from palaestra.errors import ConfigError, EngineError

if TYPE_CHECKING:
    import torch

    from palaestra.contracts import Tokenizer
    from palaestra.engines.local.kv_cache import SlotKVCache
    from palaestra.engines.local.model import Decoder
    from palaestra.engines.local.parity import FullLogprobsRequest


def _device_and_dtype(device: str | None, dtype: torch.dtype | str | None
                      ) -> tuple[torch.device, torch.dtype]:
    """The engine's device (CUDA when there is one) and compute dtype (float32 on CPU, else
    bfloat16; a name such as "float16" is looked up in torch)."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        return dev, torch.float32 if dev.type == "cpu" else torch.bfloat16
    return dev, getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _checked_lora_mode(mode: str) -> str:
    """How the default LoRA adapter is applied (`palaestra.engines.local.lora`)."""
    from palaestra.engines.local.lora import LORA_MODES

    if mode not in LORA_MODES:
        raise ConfigError(f"lora_mode {mode!r}: use one of {', '.join(LORA_MODES)}")
    return mode


class LocalEngine:
    """Embedded engine over a Hugging Face Llama-family checkpoint (see the module docstring).

    ``max_running`` bounds the running batch (its KV slots); ``max_prefill_tokens`` the tokens one
    prefill step computes (at least one request is always admitted); ``prefix_cache_tokens`` the
    tokens whose KV is kept for reuse (0 disables prefix reuse); ``decode_steps`` how many decode
    steps run between two host syncs (default 32 on CUDA, 1 on CPU); ``logits_processors``
    (attribute) edit each step's logits, e.g. to script outputs in tests.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        hf_model: Any = None,
        device: str | None = None,
        dtype: torch.dtype | str | None = None,
        max_running: int = 64,
        max_model_len: int | None = None,
        max_prefill_tokens: int = 4096,
        prefix_cache_tokens: int = 32768,
        seed: int = 0,
        use_thread: bool = True,
        cuda_graphs: bool = True,
        decode_steps: int | None = None,
        tokenizer: Tokenizer | None = None,
        lora_mode: str = "merged",
        decode_attention: str = "auto",
        bitwise: bool = False,
    ) -> None:
        from palaestra.engines.local.loading import decoder_from_hf_model, load_decoder

        if (model_path is None) == (hf_model is None):
            raise ConfigError("pass exactly one of model_path or hf_model to LocalEngine")
        if max_running < 1 or max_prefill_tokens < 1:
            raise ConfigError("max_running and max_prefill_tokens must be >= 1")
        dev, dtype = _device_and_dtype(device, dtype)
        self.model_path = str(model_path) if model_path is not None else None
        self.device = dev
        self.dtype = dtype
        if hf_model is not None:
            self.decoder: Decoder = decoder_from_hf_model(hf_model, dev, dtype)
        else:
            self.decoder = load_decoder(model_path, dev, dtype)  # type: ignore[arg-type]
        cfg = self.decoder.config
        #: bitwise on-policy mode: batch-invariant forwards and logprobs (`bitwise_forward`);
        #: its decode step is graph-capturable (`invariant.decode_plan`)
        self.bitwise = bitwise
        if bitwise:
            self.decoder.enable_bitwise()
            decode_attention = "dense"
        self.decode_attention = choose_decode_attention(self.decoder, dev, dtype, decode_attention)
        self.max_model_len = min(max_model_len or cfg.max_positions, cfg.max_positions)
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        # decode steps per host sync: hides the per-step Python work behind the GPU (a call
        # whose rows have all stopped ends within 16 steps: runner._StopWatch)
        self.decode_steps = decode_steps or (32 if dev.type == "cuda" else 1)
        self.eos_token_ids = frozenset(cfg.eos_token_ids)
        if cfg.moe is not None:
            cuda_graphs = False  # the per-expert GEMMs read the expert counts on the host
        self.cache: SlotKVCache = new_slot_cache(cfg, dtype=dtype, device=dev,
                                                 max_length=self.max_model_len,
                                                 max_running=max_running)
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        self._tokenizer = tokenizer
        self._slots = KVSlots(self.cache, self.prefix_cache)
        self._sampler = BatchSampler(cfg.vocab_size, dev, seed)
        self._sampler.invariant = bitwise
        self.logits_processors: list[LogitsProcessor] = self._sampler.logits_processors
        # one dict: the scheduler counts requests and tokens out, the runner compute steps
        self.counters: dict[str, int] = dict.fromkeys(
            ("requests", "finished", "aborted", "prompt_tokens", "prefill_tokens",
             "cached_tokens", "generated_tokens", "prefill_steps", "decode_steps", "decode_calls",
             "decode_early_ends"), 0)
        self._runner = ModelRunner(
            self.decoder, self._slots, self._sampler, self.counters, device=dev,
            max_running=max_running, max_model_len=self.max_model_len,
            decode_steps=self.decode_steps, use_thread=use_thread, cuda_graphs=cuda_graphs)
        self.lora_mode = _checked_lora_mode(lora_mode)  # how the default LoRA adapter is applied (`lora.py`)
        self._scheduler = Scheduler(
            self._runner, self._slots, self.counters, max_running=max_running,
            max_prefill_tokens=max_prefill_tokens, max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids, tokenizer=lambda: self.tokenizer)
        self.timers = self._scheduler.timers

    # ---------------------------------------------------- parts that tests and benchmarks read
    @property
    def _graphs(self) -> Any:
        """The decode step's CUDA graphs (None without them)."""
        return self._runner.graphs

    @property
    def _running(self) -> list[LocalRequest]:
        return self._scheduler.running

    @property
    def _paused(self) -> bool:
        return self._scheduler.paused

    # ------------------------------------------------------------------------------- protocol
    #: `update_weights` applies between two decode steps while requests keep running, so a
    #: rollout manager need not park in-flight episodes around a push
    updates_in_place = True

    @property
    def weight_version(self) -> int:
        return self._scheduler.version

    @property
    def stats(self) -> dict[str, float]:
        """Counters (a copy): prefill_tokens are computed prompt tokens, cached_tokens reused ones;
        ``*_s`` the scheduler's seconds in prefill and decode calls, ``host_s`` the rest of the
        time it had work."""
        out: dict[str, float] = dict(self.counters)
        out.update(self.timers)
        out["host_s"] = max(0.0, self.timers["active_s"] - self.timers["prefill_s"]
                            - self.timers["decode_s"])
        out.update(
            running=len(self._scheduler.running),
            waiting=len(self._scheduler.waiting),
            weight_version=self._scheduler.version,
            prefix_cache_entries=len(self.prefix_cache) if self.prefix_cache else 0,
            prefix_cache_tokens=self.prefix_cache.num_tokens if self.prefix_cache else 0,
        )
        return out

    def request_ids(self) -> list[str]:
        """Ids of the waiting and running requests."""
        return list(self._scheduler.by_id)

    def set_weight_version(self, version: int) -> None:
        """Relabel the current weights (SGLang's ``/update_weight_version``)."""
        self._scheduler.version = int(version)

    @property
    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer (loaded on first use; only stop strings and serving need it)."""
        if self._tokenizer is None:
            if self.model_path is None:
                raise EngineError("this engine has no tokenizer; pass tokenizer= to LocalEngine")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        lora: str | None = None,
    ) -> Generation:
        """Generate; ``lora`` names a loaded adapter (None: the default adapter, if any)."""
        req = self._scheduler.submit(input_ids, sampling, request_id, session_id, stream=False,
                                     lora=lora)
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            # the caller gave up (timeout, cancelled episode): free the slot at the next step
            self._scheduler.request_abort(req, "the caller cancelled the request")
            raise

    async def stream(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        lora: str | None = None,
    ) -> AsyncGenerator[StreamChunk, None]:
        """Like `generate`, but yields the tokens of every step; the last chunk has the result."""
        req = self._scheduler.submit(input_ids, sampling, request_id, session_id, stream=True,
                                     lora=lora)
        assert req.stream is not None
        try:
            while True:
                chunk = await req.stream.get()
                if isinstance(chunk, BaseException):
                    raise chunk
                yield chunk
                if chunk.generation is not None:
                    return
        finally:
            if not req.future.done():
                self._scheduler.request_abort(req, "the stream was closed by the caller")

    def get_weight(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first ``truncate_size`` rows of the weight ``name`` (HF name) as float lists."""
        tensor = self.decoder.weight(name)
        if tensor is None:
            raise EngineError(f"no weight named {name!r}; names are the checkpoint's Hugging "
                              f"Face names, e.g. {self.decoder.weight_names[0]!r}")
        with self._runner.on_stream():
            return tensor[:max(truncate_size, 0)].float().cpu().tolist()  # type: ignore[no-any-return]

    async def update_weights(
        self,
        state_dict: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
        *,
        path: str | None = None,
        version: int | None = None,
    ) -> None:
        """Copy new weights in between two steps, flush the prefix cache, bump the version.

        ``state_dict`` maps Hugging Face names to tensors (a partial dict updates those tensors
        only, for bucketed syncs); ``path`` is a checkpoint directory or a safetensors file.
        Running requests continue with the new weights; their generations record both versions
        in ``meta["weight_version_spans"]``.
        """
        from palaestra.engines.weights.checkpoint_files import iter_safetensors, safetensors_files

        if (state_dict is None) == (path is None):
            raise EngineError("update_weights takes exactly one of state_dict or path")
        if path is not None:
            if not Path(path).exists():
                raise EngineError(f"no checkpoint at {path}")
            named: Iterable[tuple[str, Any]] = iter_safetensors(safetensors_files(path))
        elif isinstance(state_dict, Mapping):
            named = state_dict.items()
        else:
            named = state_dict  # type: ignore[assignment]
        async with self._scheduler.between_steps():
            await self._runner.compute(self._runner.load_weights, named)
            if self.decoder.lora is not None:  # merged adapters re-merge onto the new base
                await self._runner.compute(self.decoder.lora.base_weights_changed)
            self._runner.weights_changed()
            self._slots.flush()
            self._bump_version(version)

    def _bump_version(self, version: int | None) -> None:
        s = self._scheduler
        s.version = s.version + 1 if version is None else int(version)

    async def full_logprobs(self, request: FullLogprobsRequest, *, lora: str | None = None
                            ) -> torch.Tensor:
        """The full next-token log-distributions (float32 ``[positions, V]``, on the CPU) of a
        sequence at the request's positions, from this engine's forward and sampler
        (`palaestra.engines.local.parity`): in bitwise mode the bits it sampled from. Runs
        between two steps with the current weights; ``lora`` names a loaded adapter (None: the
        default adapter, if any)."""
        from palaestra.engines.local.parity import full_logprobs

        request.check(self.max_model_len)

        def run() -> torch.Tensor:
            return full_logprobs(self.decoder, request, invariant=self._sampler.invariant,
                                 lora=lora).cpu()

        async with self._scheduler.between_steps():
            out: torch.Tensor = await self._runner.compute(run)
            return out

    # ------------------------------------------------------------------------ LoRA adapters
    @property
    def lora_adapters(self) -> list[str]:
        """Names of the loaded LoRA adapters."""
        return [] if self.decoder.lora is None else self.decoder.lora.names

    async def load_lora_adapter(self, name: str, path: str | None = None, *, adapter: Any = None,
                                default: bool = False, version: int | None = None) -> None:
        """Serve a LoRA adapter as ``name`` (a peft folder at ``path``, or a parsed
        `LoraAdapter`); a loaded name is replaced. ``default``: requests that name no adapter
        run it (the in-process policy sync; bumps the weight version and flushes the prefix
        cache, whose KV was computed by the previous adapter)."""
        from palaestra.engines.local.lora import LoraAdapter, LoraRuntime

        if (path is None) == (adapter is None):
            raise EngineError("load_lora_adapter takes exactly one of path or adapter")
        if self.bitwise and not (default and self.lora_mode == "merged"):
            # the batch-invariant forward reads the fused weights: an adapter must be merged
            # into them (`lora.merged_weight`, as the trainer's bitwise forward merges it)
            raise EngineError("this engine runs in bitwise on-policy mode, which serves one "
                              "LoRA adapter, the default one, merged into the weights "
                              "(load_lora_adapter(..., default=True) with lora_mode = "
                              "'merged'); named or low-rank adapters need an engine without "
                              "bitwise")
        parsed = adapter if adapter is not None else await asyncio.to_thread(
            LoraAdapter.from_folder, name, str(path))
        parsed.name = name
        async with self._scheduler.between_steps():
            def load() -> None:
                if self.decoder.lora is None:
                    self.decoder.lora = LoraRuntime(self.decoder, self.lora_mode)
                self.decoder.lora.load(parsed, default=default)
            await self._runner.compute(load)
            self._runner.weights_changed()
            if default:
                self._slots.flush()
                self._bump_version(version)

    async def update_adapter(self, state: Mapping[str, Any], config: Mapping[str, Any], *,
                             name: str = "policy", version: int | None = None) -> None:
        """The trainer's adapter (peft state dict + config) as the default adapter."""
        from palaestra.engines.local.lora import LoraAdapter

        adapter = LoraAdapter.from_peft(name, state, config)
        await self.load_lora_adapter(name, adapter=adapter, default=True, version=version)

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving ``name``; refused while a request that names it waits or runs."""
        if self.decoder.lora is None or name not in self.decoder.lora.names:
            raise EngineError(f"no LoRA adapter named {name!r} is loaded "
                              f"(loaded: {self.lora_adapters or 'none'})")
        busy = [r.request_id for r in self._scheduler.by_id.values() if r.lora == name]
        if busy:
            raise EngineError(f"LoRA adapter {name!r} is in use by {len(busy)} request(s), e.g. "
                              f"{busy[0]!r}: unload it when they finish (or abort them)")
        async with self._scheduler.between_steps():
            runtime = self.decoder.lora
            was_default = runtime.default == runtime.id_of(name)
            await self._runner.compute(runtime.unload, name)
            self._runner.weights_changed()
            if was_default:
                self._slots.flush()

    # -------------------------------------------------------------------------------- control
    async def pause(self, mode: str = "in_place") -> None:
        """Stop scheduling steps (returns once the step in flight ended).

        ``mode`` is SGLang's: ``in_place`` keeps running requests for `resume`, ``abort`` aborts
        them (they return their tokens so far with finish reason ``abort``), ``retract`` is
        treated as ``in_place`` (the KV stays resident here).
        """
        if mode not in ("in_place", "abort", "retract"):
            raise ConfigError(f"pause mode must be in_place, abort or retract, not {mode!r}")
        await self._scheduler.pause(abort=mode == "abort")

    async def resume(self) -> None:
        self._scheduler.resume()

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """Abort the given requests (all when None): they finish with ``finish_reason="abort"``."""
        await self._scheduler.abort(request_ids)

    async def flush_cache(self) -> None:
        self._slots.flush()

    async def health(self) -> bool:
        s = self._scheduler
        if s.closed or s.fatal is not None:
            return False
        return s.task is None or not s.task.done()

    async def close(self) -> None:
        if self._scheduler.closed:
            return
        await self._scheduler.close()
        self._runner.close()

    # --------------------------------------------------------------------------------- memory
    def device_bytes(self) -> int:
        """Device memory this engine holds: its KV cache, and its weights while they sit off
        the CPU (on CPU: the KV cache alone, the only part a release frees there)."""
        total = int(self.cache.num_bytes())
        if self.device.type != "cpu" and self.decoder.embed.device.type != "cpu":
            total += int(self.decoder.num_bytes())
        return total

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free the KV cache (tag ``kv_cache``) and move weights off the GPU (tag ``weights``)."""
        tags = list(tags or ("kv_cache", "weights"))
        unknown = set(tags) - {"kv_cache", "weights"}
        if unknown:
            raise ConfigError(f"unknown memory tags {sorted(unknown)}; use kv_cache and weights")
        if self._scheduler.by_id:
            raise EngineError("release memory only while no request is running; pause(mode='abort')")
        async with self._scheduler.between_steps():
            with self._runner.on_stream():  # ordered after the engine's own kernels
                if "kv_cache" in tags:
                    self.cache.release()
                    self._slots.flush()
                if "weights" in tags and self.device.type != "cpu":
                    self.decoder.to_device("cpu")
                if self._runner.graphs is not None:
                    self._runner.graphs.reset()

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        tags = list(tags or ("kv_cache", "weights"))
        async with self._scheduler.between_steps():
            with self._runner.on_stream():
                if "weights" in tags:
                    self.decoder.to_device(self.device)
                if "kv_cache" in tags and self.cache.slots == 0:
                    self.cache.ensure(self.max_running if self.device.type == "cuda" else 8,
                                      min(256, self.max_model_len))


__all__ = ["LocalEngine", "LocalRequest", "LogitsProcessor", "StreamChunk"]
