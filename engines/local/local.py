"""`LocalEngine`: the embedded engine (CPU, or CUDA where present) with continuous batching.

An asyncio scheduler task owns the model. Each iteration it (1) drops aborted requests, (2) admits
waiting requests into free slots and prefills them together (only the tokens after their longest
cached prefix), (3) runs one batched decode step for every running request, then hands control
back to the event loop. Requests therefore join and leave the running batch between steps, and a
weight update, pause or abort takes effect at the next step boundary. The forward passes run in
one worker thread (torch releases the GIL), so the event loop (an HTTP server, the rollout's
episodes) stays responsive while the model computes; all bookkeeping happens on the loop.

Everything a request gets back is token-exact: the sampled ids, ``log_softmax(logits / T)`` of
each (see `palaestra.engines.local.sampling`), the finish reason, the prompt tokens served from
the prefix cache, and the weight version (with spans when an update landed mid-generation).

    engine = LocalEngine("runs/tiny-model")
    gen = await engine.generate(ids, SamplingParams(max_new_tokens=32, temperature=0))
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import itertools
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError, EngineError
from palaestra.engine import EngineUnavailableError, Generation, SamplingParams
from palaestra.engines.local.prefix_cache import PrefixCache, PrefixEntry, common_prefix_len
from palaestra.engines.local.sampling import RowSampler

if TYPE_CHECKING:
    import torch

    from palaestra.engines.local.kv_cache import SlotKVCache
    from palaestra.engines.local.model import Decoder

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
class _SamplingPlan:
    """Per-call sampling inputs of a batch (see `LocalEngine._sampling_plan`)."""

    biases: list[tuple[Any, Any, Any]]  # (row, token ids, values) on the device
    sampler: RowSampler  # the batch's per-row settings, on the device once per call
    uniforms: Any  # [k, B] float32 on the device, None when every row is greedy


@dataclass(frozen=True)
class StreamChunk:
    """Tokens a streaming request gained in one step; ``generation`` is set on the last chunk."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    generation: Generation | None = None


def _attention_backends(device: Any) -> contextlib.AbstractContextManager[Any]:
    """SDPA without the cuDNN backend on CUDA. Prefill shapes are nearly all new (requests x
    new tokens x key length) and SDPA's default choice on an H200 spent its time on the host
    for each of them: in the issue-22 loop the prefill forwards took 65 ms per prefill call
    with it and 23 ms without (`benchmarks/perf/loop.py`, ~16 prefill calls per RL step),
    while the GPU waited. Flash and memory-efficient kernels take any shape at once."""
    if getattr(device, "type", device) != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])


def _longest_shared(admitted: list[tuple[tuple[int, ...], LocalRequest]],
                    ids: Sequence[int]) -> tuple[LocalRequest | None, int]:
    """The admitted request (sorted by prompt) sharing the longest prefix with ``ids``."""
    if not admitted:
        return None, 0
    probe = tuple(ids)
    at = bisect.bisect_left(admitted, probe, key=lambda e: e[0])
    best, shared = None, 0
    for prompt, req in admitted[max(at - 1, 0) : at + 1]:
        n = common_prefix_len(prompt, probe)
        if n > shared:
            best, shared = req, n
    return best, shared


class LocalEngine:
    """Embedded engine over a Hugging Face Llama-family checkpoint (see the module docstring).

    ``max_running`` bounds the running batch (its KV slots); ``max_prefill_tokens`` the tokens one
    prefill step computes (at least one request is always admitted); ``prefix_cache_tokens`` the
    tokens whose KV is kept for reuse (0 disables prefix reuse); ``decode_steps`` how many decode
    steps run between two host syncs (default 8 on CUDA, 1 on CPU); ``logits_processors``
    (attribute) edit each step's logits, e.g. to script outputs in tests.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        hf_model: Any = None,
        device: str | None = None,
        dtype: Any = None,
        max_running: int = 64,
        max_model_len: int | None = None,
        max_prefill_tokens: int = 4096,
        prefix_cache_tokens: int = 32768,
        seed: int = 0,
        use_thread: bool = True,
        cuda_graphs: bool = True,
        decode_steps: int | None = None,
        tokenizer: Any = None,
        lora_mode: str = "merged",
        decode_attention: str = "auto",
    ) -> None:
        import torch

        from palaestra.engines.local.kv_cache import SlotKVCache
        from palaestra.engines.local.loading import decoder_from_hf_model, load_decoder

        if (model_path is None) == (hf_model is None):
            raise ConfigError("pass exactly one of model_path or hf_model to LocalEngine")
        if max_running < 1 or max_prefill_tokens < 1:
            raise ConfigError("max_running and max_prefill_tokens must be >= 1")
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
        elif isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.model_path = str(model_path) if model_path is not None else None
        self.device = dev
        self.dtype = dtype
        if hf_model is not None:
            self.decoder: Decoder = decoder_from_hf_model(hf_model, dev, dtype)
        else:
            self.decoder = load_decoder(model_path, dev, dtype)  # type: ignore[arg-type]
        cfg = self.decoder.config
        self.decode_attention = self._choose_decode_attention(decode_attention)
        self.max_model_len = min(max_model_len or cfg.max_positions, cfg.max_positions)
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        # decode steps per host sync: hides the per-step Python work behind the GPU
        self.decode_steps = decode_steps or (8 if dev.type == "cuda" else 1)
        self.eos_token_ids = frozenset(cfg.eos_token_ids)
        cache_kw: dict[str, Any] = {}
        cache_cls: type[SlotKVCache] = SlotKVCache
        if cfg.moe is not None:  # MoE: routed experts are kept per position next to the KV
            from palaestra.engines.local.moe import SlotRouteKVCache

            cache_cls, cache_kw = SlotRouteKVCache, {"route_layers": cfg.num_layers,
                                                     "top_k": cfg.moe.top_k}
            cuda_graphs = False  # the per-expert GEMMs read the expert counts on the host
        self.cache: SlotKVCache = cache_cls(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=dev,
            max_length=self.max_model_len, slots=max_running if dev.type == "cuda" else 8,
            **cache_kw,
        )
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        self.logits_processors: list[LogitsProcessor] = []
        self._tokenizer = tokenizer
        self._rng = torch.Generator().manual_seed(seed)
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="palaestra-engine")
            if use_thread else None
        )
        # every kernel of the engine runs on its own stream: decode (bandwidth-bound) overlaps a
        # trainer's kernels on the default stream of the same GPU (async mode), and the graphs
        # are captured in thread-local mode, so that trainer's CUDA calls cannot break a capture
        self._stream: Any = None
        if dev.type == "cuda":
            self._stream = torch.cuda.Stream(device=dev)
            # the weights and the zeroed cache were written on the constructing thread's stream
            self._stream.wait_stream(torch.cuda.current_stream(dev))
        self._graphs: Any = None
        if cuda_graphs and dev.type == "cuda":
            from palaestra.engines.local.cuda_graphs import DecodeGraphs

            self._graphs = DecodeGraphs(self.decoder, self.cache, max_running)
        from palaestra.engines.local.lora import LORA_MODES

        if lora_mode not in LORA_MODES:
            raise ConfigError(f"lora_mode {lora_mode!r}: use one of {', '.join(LORA_MODES)}")
        self.lora_mode = lora_mode  # how the default LoRA adapter is applied (`lora.py`)
        self._version = 0
        self._waiting: deque[LocalRequest] = deque()
        self._running: list[LocalRequest] = []
        self._by_id: dict[str, LocalRequest] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._paused = False
        self._closed = False
        self._fatal: BaseException | None = None
        self._ids = itertools.count()
        self.counters: dict[str, int] = dict.fromkeys(
            ("requests", "finished", "aborted", "prompt_tokens", "prefill_tokens",
             "cached_tokens", "generated_tokens", "prefill_steps", "decode_steps", "decode_calls"), 0)
        # where the scheduler's wall time goes while it has work: prefill and decode compute
        # calls (launch to results on the host), and the rest (admission, bookkeeping, the
        # episodes' own coroutines on this event loop): the GPU waits through that rest
        self.timers: dict[str, float] = dict.fromkeys(("prefill_s", "decode_s", "active_s"), 0.0)

    def _choose_decode_attention(self, choice: str) -> str:
        """``dense``: the batched GEMMs over the padded key length; ``triton``: the split-KV
        kernel (`decode_attention`), or a clear error where it cannot run; ``auto`` (the
        default): the kernel on CUDA when Triton is here and it agrees with the dense path on a
        small case of this model's heads, else dense. Returns what decode uses. The grouped
        kernel measured 1.9-2.2x the dense path per call on an H200 (docs/results.md)."""
        from palaestra.engines.local import decode_attention as split_kv

        if choice not in ("auto", "triton", "dense"):
            raise ConfigError(f"decode_attention {choice!r}: use auto, triton or dense")
        decoder = self.decoder
        if choice == "dense" or not decoder.supports_split_kv:
            return "dense"  # (MLA: keys and values of other widths keep the dense path)
        why = None if split_kv.available(self.device.type) else (
            "it needs a CUDA device and the triton package")
        if why is None:
            c = decoder.config
            why = split_kv.self_check(self.device, self.dtype, c.num_heads, c.num_kv_heads,
                                      c.head_dim)
        if why is not None:
            if choice == "triton":
                raise ConfigError(f"decode_attention = 'triton' cannot run here: {why}; "
                                  "use 'auto' or 'dense'")
            return "dense"
        decoder.split_kv_attention = True
        return "triton"

    # ------------------------------------------------------------------------------- protocol
    #: `update_weights` applies between two decode steps while requests keep running, so a
    #: rollout manager need not park in-flight episodes around a push
    updates_in_place = True

    @property
    def weight_version(self) -> int:
        return self._version

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
            running=len(self._running),
            waiting=len(self._waiting),
            weight_version=self._version,
            prefix_cache_entries=len(self.prefix_cache) if self.prefix_cache else 0,
            prefix_cache_tokens=self.prefix_cache.num_tokens if self.prefix_cache else 0,
        )
        return out

    def request_ids(self) -> list[str]:
        """Ids of the waiting and running requests."""
        return list(self._by_id)

    def set_weight_version(self, version: int) -> None:
        """Relabel the current weights (SGLang's ``/update_weight_version``)."""
        self._version = int(version)

    @property
    def tokenizer(self) -> Any:
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
        req = self._submit(input_ids, sampling, request_id, session_id, stream=False, lora=lora)
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            # the caller gave up (timeout, cancelled episode): free the slot at the next step
            self._request_abort(req, "the caller cancelled the request")
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
        req = self._submit(input_ids, sampling, request_id, session_id, stream=True, lora=lora)
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
                self._request_abort(req, "the stream was closed by the caller")

    def get_weight(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first ``truncate_size`` rows of the weight ``name`` (HF name) as float lists."""
        tensor = self.decoder.weight(name)
        if tensor is None:
            raise EngineError(f"no weight named {name!r}; names are the checkpoint's Hugging "
                              f"Face names, e.g. {self.decoder.weight_names[0]!r}")
        with self._on_stream():
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
        from palaestra.engines.local.model import iter_safetensors, safetensors_files

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
        self._ensure_started()
        assert self._lock is not None
        async with self._lock:
            await self._compute(self._load_after_producer, named)
            if self.decoder.lora is not None:  # merged adapters re-merge onto the new base
                await self._compute(self.decoder.lora.base_weights_changed)
            if self._graphs is not None:
                self._graphs.weights_changed()
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            self._version = self._version + 1 if version is None else int(version)

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
        parsed = adapter if adapter is not None else await asyncio.to_thread(
            LoraAdapter.from_folder, name, str(path))
        parsed.name = name
        self._ensure_started()
        assert self._lock is not None
        async with self._lock:
            def load() -> None:
                if self.decoder.lora is None:
                    self.decoder.lora = LoraRuntime(self.decoder, self.lora_mode)
                self.decoder.lora.load(parsed, default=default)
            await self._compute(load)
            if self._graphs is not None:
                self._graphs.weights_changed()
            if default:
                if self.prefix_cache is not None:
                    self.prefix_cache.clear()
                self._version = self._version + 1 if version is None else int(version)

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
        busy = [r.request_id for r in self._by_id.values() if r.lora == name]
        if busy:
            raise EngineError(f"LoRA adapter {name!r} is in use by {len(busy)} request(s), e.g. "
                              f"{busy[0]!r}: unload it when they finish (or abort them)")
        self._ensure_started()
        assert self._lock is not None
        async with self._lock:
            runtime = self.decoder.lora
            was_default = runtime.default == runtime.id_of(name)
            await self._compute(runtime.unload, name)
            if self._graphs is not None:
                self._graphs.weights_changed()
            if was_default and self.prefix_cache is not None:
                self.prefix_cache.clear()

    def _load_after_producer(self, named: Iterable[tuple[str, Any]]) -> int:
        import torch

        if self._stream is not None:  # the new tensors come from the caller's (default) stream
            self._stream.wait_stream(torch.cuda.default_stream(self.device))
        count = self.decoder.load_weights(named)
        if self._stream is not None:  # the caller may free (and reuse) the sources at once
            self._stream.synchronize()
        return count

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        """The engine's CUDA stream as the current one (bookkeeping copies on the loop thread)."""
        import torch

        return torch.cuda.stream(self._stream) if self._stream is not None \
            else contextlib.nullcontext()

    async def pause(self, mode: str = "in_place") -> None:
        """Stop scheduling steps (returns once the step in flight ended).

        ``mode`` is SGLang's: ``in_place`` keeps running requests for `resume`, ``abort`` aborts
        them (they return their tokens so far with finish reason ``abort``), ``retract`` is
        treated as ``in_place`` (the KV stays resident here).
        """
        if mode not in ("in_place", "abort", "retract"):
            raise ConfigError(f"pause mode must be in_place, abort or retract, not {mode!r}")
        self._ensure_started()
        self._paused = True
        if mode == "abort":
            await self.abort(None)
        assert self._lock is not None
        async with self._lock:
            pass

    async def resume(self) -> None:
        self._paused = False
        self._kick()

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """Abort the given requests (all when None): they finish with ``finish_reason="abort"``."""
        targets = list(self._by_id.values()) if request_ids is None else [
            self._by_id[r] for r in request_ids if r in self._by_id
        ]
        for req in targets:
            self._request_abort(req, "aborted by request")
        if request_ids is None or targets:
            self._ensure_started()
            assert self._lock is not None
            if self._paused:  # a paused engine runs no steps: finish them here
                async with self._lock:
                    self._reap_aborted()

    async def flush_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    async def health(self) -> bool:
        if self._closed or self._fatal is not None:
            return False
        return self._task is None or not self._task.done()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for req in list(self._by_id.values()):
            self._fail(req, EngineUnavailableError("the engine was closed"))
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                if self._loop is asyncio.get_running_loop():
                    await self._task
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free the KV cache (tag ``kv_cache``) and move weights off the GPU (tag ``weights``)."""
        tags = list(tags or ("kv_cache", "weights"))
        unknown = set(tags) - {"kv_cache", "weights"}
        if unknown:
            raise ConfigError(f"unknown memory tags {sorted(unknown)}; use kv_cache and weights")
        if self._by_id:
            raise EngineError("release memory only while no request is running; pause(mode='abort')")
        self._ensure_started()
        assert self._lock is not None
        async with self._lock:
            self._release_memory(tags)

    def _release_memory(self, tags: list[str]) -> None:
        with self._on_stream():  # ordered after the engine's own kernels
            if "kv_cache" in tags:
                self.cache.release()
                if self.prefix_cache is not None:
                    self.prefix_cache.clear()
            if "weights" in tags and self.device.type != "cpu":
                self.decoder.to_device("cpu")
            if self._graphs is not None:
                self._graphs.reset()

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        tags = list(tags or ("kv_cache", "weights"))
        self._ensure_started()
        assert self._lock is not None
        async with self._lock:
            self._resume_memory(tags)

    def _resume_memory(self, tags: list[str]) -> None:
        with self._on_stream():
            if "weights" in tags:
                self.decoder.to_device(self.device)
            if "kv_cache" in tags and self.cache.slots == 0:
                self.cache.ensure(self.max_running if self.device.type == "cuda" else 8,
                                  min(256, self.max_model_len))

    # ------------------------------------------------------------------------------ submission
    def _submit(self, input_ids: Sequence[int], sampling: SamplingParams, request_id: str | None,
                session_id: str | None, *, stream: bool, lora: str | None = None
                ) -> LocalRequest:
        import torch

        if self._closed:
            raise EngineUnavailableError("the engine is closed")
        if self._fatal is not None:
            raise EngineUnavailableError(f"the engine's scheduler failed: {self._fatal!r}")
        ids = [int(t) for t in input_ids]
        if not ids:
            raise EngineError("input_ids is empty; a request needs at least one token")
        vocab = self.decoder.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise EngineError(f"token ids {bad[:3]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise EngineError(
                f"the prompt has {len(ids)} tokens; the engine's context is {self.max_model_len}"
            )
        if lora is not None:  # fail now on an adapter that is not loaded
            if self.decoder.lora is None:
                raise EngineError(f"no LoRA adapter named {lora!r} is loaded (none are); load "
                                  "it first (load_lora_adapter)")
            self.decoder.lora.id_of(lora)
        if sampling.stop:
            _ = self.tokenizer  # fail now, not mid-generation
        self._ensure_started()
        loop = asyncio.get_running_loop()
        rid = request_id or f"local-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if rid in self._by_id:
            raise EngineError(f"request id {rid!r} is already running; use unique ids")
        stop_ids = frozenset(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= self.eos_token_ids
        req = LocalRequest(
            request_id=rid, input_ids=ids, sampling=sampling, session_id=session_id,
            future=loop.create_future(), stream=asyncio.Queue() if stream else None,
            stop_ids=stop_ids,
            generator=(torch.Generator().manual_seed(sampling.seed)
                       if sampling.seed is not None else None),
            lora=lora,
        )
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(ids)
        if sampling.max_new_tokens == 0:
            self._finish(req, "length", {"type": "length", "length": 0})
            return req
        self._by_id[rid] = req
        self._waiting.append(req)
        self._kick()
        return req

    def _request_abort(self, req: LocalRequest, message: str) -> None:
        if req.future.done():
            return
        req.abort_message = message
        if req in self._waiting:
            self._waiting.remove(req)
            self._finish(req, "abort", {"type": "abort", "message": message})
        self._kick()

    # ------------------------------------------------------------------------------- scheduler
    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        if self._loop is not loop:
            # a new event loop (e.g. a second asyncio.run): requests of the old loop are gone
            self._loop = loop
            self._wakeup = asyncio.Event()
            self._lock = asyncio.Lock()
            self._waiting.clear()
            self._running.clear()
            self._by_id.clear()
        self._task = loop.create_task(self._run_loop(), name="palaestra-local-engine")

    def _kick(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        import torch

        def call() -> Any:
            with torch.inference_mode(), self._on_stream(), _attention_backends(self.device):
                return fn(*args)

        if self._executor is None:
            return call()
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def _run_loop(self) -> None:
        assert self._wakeup is not None and self._lock is not None
        try:
            while not self._closed:
                if self._paused or not (self._waiting or self._running):
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                began = time.perf_counter()
                async with self._lock:
                    if self._paused:
                        continue
                    self._reap_aborted()
                    admitted = self._admit()
                    if admitted:
                        await self._step(self._prefill, admitted)
                    if self._running and not self._paused:
                        await self._step(self._decode, list(self._running))
                await asyncio.sleep(0)
                self.timers["active_s"] += time.perf_counter() - began
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a scheduler bug: fail everything loudly, stay unhealthy
            self._fatal = exc
            for req in list(self._by_id.values()):
                self._fail(req, EngineUnavailableError(f"the engine's scheduler failed: {exc!r}"))
            raise

    async def _step(self, kind: Callable[[list[LocalRequest]], Any],
                    reqs: list[LocalRequest]) -> None:
        began = time.perf_counter()
        try:
            tokens, logprobs = await self._compute(kind, reqs)
        except Exception as exc:  # e.g. out of memory: fail these requests, keep serving
            import torch

            with torch.inference_mode(), self._on_stream():
                self._compact(reqs)  # a prefill's requests hold no running slot yet: no-op
            for req in reqs:
                self._fail(req, EngineError(f"generation failed: {type(exc).__name__}: {exc}"))
            return
        finally:
            timer = "prefill_s" if kind == self._prefill else "decode_s"
            self.timers[timer] += time.perf_counter() - began
        self._after_step(reqs, tokens, logprobs)

    def _reap_aborted(self) -> None:
        self._retire_many([(r, "abort", {"type": "abort", "message": r.abort_message or ""})
                           for r in self._running if r.abort_message is not None])

    def _admit(self) -> list[LocalRequest]:
        """Waiting requests for the next prefill, in arrival order, within the token budget.

        A request that shares a longer prefix with one admitted in this same batch than the
        prefix cache offers (another sample of the same prompt, the same system prompt) waits
        one step: the admitted one's prompt KV is kept after its prefill, so the waiting one
        then prefills only its own suffix.
        """
        from palaestra.engines.local.prefix_cache import KEY_TOKENS

        admitted: list[LocalRequest] = []
        budget = self.max_prefill_tokens
        deferred: list[LocalRequest] = []
        # admitted prompts per first-KEY_TOKENS key, sorted: the admitted prompt sharing the
        # longest prefix with a new one is one of its two sorted neighbours, so each check is
        # a bisection and two comparisons, not one per admitted prompt (256 samples of one
        # system prompt made that quadratic: ~1 s of event-loop time per RL step)
        by_key: dict[tuple[int, ...], list[tuple[tuple[int, ...], LocalRequest]]] = {}
        cache = self.prefix_cache
        while self._waiting and len(self._running) + len(admitted) < self.max_running:
            req = self._waiting[0]
            entry, hit = (None, 0)
            if cache is not None and req.lora is None:  # a named adapter's KV is its own
                entry, hit = cache.match(req.input_ids)
                hit = min(hit, len(req.input_ids) - 1)  # at least one token computes logits
                best, shared = _longest_shared(by_key.get(tuple(req.input_ids[:KEY_TOKENS]), []),
                                               req.input_ids)
                if best is not None and \
                        min(shared, len(req.input_ids) - 1) > max(hit, cache.min_tokens - 1):
                    best.share_prompt = True
                    deferred.append(self._waiting.popleft())
                    continue
            new = len(req.input_ids) - hit
            if admitted and new > budget:
                break
            self._waiting.popleft()
            req.entry, req.cached_tokens = (entry, hit) if hit > 0 else (None, 0)
            req.slot = len(self._running) + len(admitted)
            admitted.append(req)
            if cache is not None and len(req.input_ids) >= cache.min_tokens and req.lora is None:
                ids = tuple(req.input_ids)
                bisect.insort(by_key.setdefault(ids[:KEY_TOKENS], []), (ids, req),
                              key=lambda e: e[0])
            budget -= new
        self._waiting.extendleft(reversed(deferred))  # first in line for the next step
        return admitted

    # ------------------------------------------------------------- compute (worker thread)
    def _prefill(self, reqs: list[LocalRequest]) -> tuple[list[list[int]], list[list[float]]]:
        import torch

        from palaestra.engines.local.model import ExtendBatch

        dev = self.device
        slot0 = reqs[0].slot
        need_len = max(len(r.input_ids) for r in reqs) + 1
        self.cache.ensure(slot0 + len(reqs), need_len)
        starts = [r.cached_tokens for r in reqs]
        lens = [len(r.input_ids) - r.cached_tokens for r in reqs]
        for r in reqs:
            if r.entry is not None:
                self.cache.load(r.slot, r.entry.kv, r.cached_tokens)
                r.entry = None
        tokens = torch.tensor([t for r in reqs for t in r.input_ids[r.cached_tokens:]],
                              dtype=torch.long)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        slot_ids = torch.cat([torch.full((n,), r.slot) for r, n in zip(reqs, lens)])
        ends = torch.tensor(lens).cumsum(0)
        key_len = max(s + n for s, n in zip(starts, lens))
        t_max = max(lens)
        pad_index = mask = None
        if len(reqs) > 1:
            rows = torch.arange(len(reqs)).repeat_interleave(torch.tensor(lens))
            within = torch.arange(int(ends[-1])) - (ends - torch.tensor(lens))[rows]
            pad_index = (rows * t_max + within).to(dev)
        if len(reqs) > 1 or starts[0] > 0:
            t = torch.arange(t_max)
            limit = torch.tensor(starts)[:, None] + t[None, :]  # [R, T] last visible key
            mask = (torch.arange(key_len)[None, None, :] <= limit[:, :, None]).unsqueeze(1)
            mask = mask.to(dev)
        batch = ExtendBatch(
            slot0=slot0, starts=starts, lens=lens, slot_ids=slot_ids.to(dev),
            positions=positions.to(dev), pad_index=pad_index, mask=mask,
            last_index=(ends - 1).to(dev), key_len=key_len,
        )
        self._lora_rows(reqs, lens)
        logits = self.decoder.extend(tokens.to(dev), batch, self.cache)
        self.counters["prefill_tokens"] += sum(lens)
        self.counters["cached_tokens"] += sum(starts)
        self.counters["prefill_steps"] += 1
        return self._sample(logits, reqs)

    def _decode(self, reqs: list[LocalRequest]) -> tuple[list[list[int]], list[list[float]]]:
        """``k`` decode steps for the running batch, sampled tokens fed back on the device.

        One host sync per call instead of per step, so the GPU never waits for the Python
        bookkeeping between steps; a request that stops mid-call keeps its tokens up to the
        stop (the rest are discarded: at most ``k - 1`` wasted positions, beyond its length).
        ``k`` is 1 whenever a step's result must be seen on the host (stop strings, logits
        processors) and never runs a request past its token or context budget.
        """
        import torch

        b = len(reqs)
        k = self.decode_steps
        if k > 1 and (self.logits_processors or any(r.sampling.stop for r in reqs)):
            k = 1
        if k > 1:
            k = min(k, min(r.sampling.max_new_tokens - len(r.output_ids) for r in reqs),
                    min(self.max_model_len - len(r.input_ids) - len(r.output_ids) for r in reqs))
            k = max(k, 1)
        positions = [r.kv_len for r in reqs]
        self.cache.ensure(b, max(positions) + k)
        self.counters["decode_calls"] += 1
        dev = self.device
        tokens_dev = torch.tensor([r.output_ids[-1] for r in reqs], device=dev)
        pos0 = torch.tensor(positions, device=dev)
        plan = self._sampling_plan(reqs, k)
        out_tokens, out_logprobs = [], []
        lowrank = self._lora_rows(reqs)
        graphs = None if lowrank else self._graphs  # the graphs hold no low-rank updates
        # sampling inside the graph unless a logit bias or processor must see the logits
        sampler = plan.sampler if (graphs is not None and graphs.sample_in_graph
                                   and not plan.biases and not self.logits_processors) else None
        for step in range(k):
            key_len = max(positions) + step + 1
            pos = pos0 + step if step else pos0
            if graphs is not None and graphs.supports(b, key_len, sampler):
                if sampler is not None:
                    u = None if plan.uniforms is None else plan.uniforms[step]
                    tokens_dev, logprobs_dev = graphs.run_sampled(tokens_dev, pos, key_len,
                                                                  sampler, u)
                else:
                    logits = graphs.run(tokens_dev, pos, key_len)
                    tokens_dev, logprobs_dev = self._sample_device(logits, reqs, plan, step)
            else:
                logits = self.decoder.decode(tokens_dev, pos, self.cache, key_len)
                tokens_dev, logprobs_dev = self._sample_device(logits, reqs, plan, step)
            out_tokens.append(tokens_dev)
            out_logprobs.append(logprobs_dev)
            self.counters["decode_steps"] += 1
        # one device-to-host copy: ids < 2**24 are exact in float32
        both = torch.stack([t.to(torch.float32) for t in out_tokens] + out_logprobs).cpu()
        toks = both[:k].t().tolist()
        lps = both[k:].t().tolist()
        return [[int(t) for t in row] for row in toks], lps

    def _lora_rows(self, reqs: list[LocalRequest], lens: list[int] | None = None) -> bool:
        """Tell the LoRA runtime each request's adapter; whether low-rank work is needed."""
        runtime = self.decoder.lora
        if runtime is None:
            return False
        return bool(runtime.set_rows([runtime.id_of(r.lora) for r in reqs], lens))

    def _sample(self, logits: torch.Tensor, reqs: list[LocalRequest]
                ) -> tuple[list[list[int]], list[list[float]]]:
        import torch

        tokens, logprobs = self._sample_device(logits, reqs, self._sampling_plan(reqs, 1), 0)
        both = torch.stack((tokens.to(torch.float32), logprobs)).cpu()
        return [[int(t)] for t in both[0].tolist()], [[lp] for lp in both[1].tolist()]

    def _sampling_plan(self, reqs: list[LocalRequest], k: int) -> _SamplingPlan:
        """What ``k`` sampling steps of this batch need, built once per decode call.

        The per-row Python (logit biases, per-request generators) runs once per call, not once
        per step: a seeded row draws its ``k`` uniforms in one call, which gives the numbers
        ``k`` single draws would (as does the shared generator's ``[k, B]`` draw), so a seeded
        request samples the same tokens whatever ``k`` and its batch are.
        """
        import torch

        dev = self.device
        biases = []
        for row, req in enumerate(reqs):
            if req.sampling.logit_bias:  # rare: the loop is cheap Python when unused
                pairs = req.sampling.logit_bias
                biases.append((row, torch.tensor([t for t, _ in pairs], device=dev),
                               torch.tensor([v for _, v in pairs], device=dev)))
        params = [r.sampling for r in reqs]
        uniforms = None
        if not all(p.greedy for p in params):
            uniforms = torch.rand(k, len(reqs), generator=self._rng)
            seeded = [(row, r.generator) for row, r in enumerate(reqs) if r.generator is not None]
            if seeded:
                rows = torch.tensor([row for row, _ in seeded])
                uniforms[:, rows] = torch.stack([torch.rand(k, generator=g) for _, g in seeded],
                                                dim=1)
            uniforms = uniforms.to(dev)  # one host-to-device copy per call
        sampler = RowSampler([p.temperature for p in params], [p.top_p for p in params],
                             [p.top_k for p in params], self.decoder.config.vocab_size, dev)
        return _SamplingPlan(biases, sampler, uniforms)

    def _sample_device(self, logits: torch.Tensor, reqs: list[LocalRequest],
                       plan: _SamplingPlan, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        for row, ids, vals in plan.biases:
            logits[row].index_add_(0, ids, vals)
        for proc in self.logits_processors:
            proc(logits, reqs)
        return plan.sampler.sample(logits, None if plan.uniforms is None else plan.uniforms[step])

    # --------------------------------------------------------------- bookkeeping (event loop)
    def _after_step(self, reqs: list[LocalRequest], tokens: list[list[int]],
                    logprobs: list[list[float]]) -> None:
        if reqs and reqs[0] not in self._running:  # a prefill: the batch joins the running set
            self._running.extend(reqs)
            self._share_prompts(reqs)
        finished: list[tuple[LocalRequest, str, dict[str, Any]]] = []
        version = self._version
        generated = 0
        for req, toks, lps in zip(reqs, tokens, logprobs):
            if not req.version_spans or req.version_spans[-1][1] != version:
                req.version_spans.append((len(req.output_ids), version))
            for i, (tok, lp) in enumerate(zip(toks, lps)):
                req.output_ids.append(tok)
                req.logprobs.append(lp)
                generated += 1
                done = self._stop_reason(req, tok)
                if done is not None:
                    finished.append((req, *done))
                    toks, lps = toks[: i + 1], lps[: i + 1]
                    break
            if req.stream is not None:
                req.stream.put_nowait(StreamChunk(tuple(toks), tuple(lps)))
        self.counters["generated_tokens"] += generated
        self._retire_many(finished)

    def _share_prompts(self, reqs: list[LocalRequest]) -> None:
        """Keep the prompt KV of prefilled requests that others are waiting to share."""
        import torch

        if self.prefix_cache is None:
            return
        with torch.inference_mode(), self._on_stream():
            for r in reqs:
                if r.share_prompt:
                    r.share_prompt = False
                    self.prefix_cache.insert(tuple(r.input_ids),
                                             self.cache.extract(r.slot, len(r.input_ids)),
                                             r.session_id)

    def _stop_reason(self, req: LocalRequest, tok: int) -> tuple[str, dict[str, Any]] | None:
        sp = req.sampling
        if tok in req.stop_ids:
            return "stop", {"type": "stop", "matched": tok}
        if sp.stop:
            tail = self.tokenizer.decode(req.output_ids[-4 * max(map(len, sp.stop)) - 4 :])
            for s in sp.stop:
                if s in tail:
                    return "stop", {"type": "stop", "matched": s}
        if len(req.output_ids) >= sp.max_new_tokens:
            return "length", {"type": "length", "length": sp.max_new_tokens}
        if len(req.input_ids) + len(req.output_ids) >= self.max_model_len:
            return "length", {"type": "length", "length": len(req.output_ids)}
        return None

    def _retire_many(self, finished: list[tuple[LocalRequest, str, dict[str, Any]]]) -> None:
        """Take running requests out of their slots (keeping their KV for reuse), finish them.

        The survivors are compacted in one batched slot move (two copy kernels for all of
        them), not one move per finished request: the GPU waits for this bookkeeping.
        """
        import torch

        if not finished:
            return
        with torch.inference_mode(), self._on_stream():
            cache = self.prefix_cache
            for req, _, _ in finished:
                if cache is not None and req.kv_len >= cache.min_tokens and req.lora is None:
                    n = req.kv_len
                    tokens = tuple(req.input_ids + req.output_ids)[:n]
                    cache.insert(tokens, self.cache.extract(req.slot, n), req.session_id)
            routes_of = getattr(self.cache, "routes_of", None)  # MoE: the routed experts
            if routes_of is not None:
                for req, _, _ in finished:
                    req.routed_experts = routes_of(req.slot, req.kv_len)
            self._compact([req for req, _, _ in finished])
        for req, reason, detail in finished:
            self._finish(req, reason, detail)

    def _compact(self, leaving: list[LocalRequest]) -> None:
        """Remove ``leaving`` from the running batch: tail survivors move into the holes."""
        gone = {id(r) for r in leaving}
        running = self._running
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

    def _finish(self, req: LocalRequest, reason: str, detail: dict[str, Any]) -> None:
        self._by_id.pop(req.request_id, None)
        if req.future.done():
            return
        self.counters["finished"] += 1
        if reason == "abort":
            self.counters["aborted"] += 1
        spans = req.version_spans or [(0, self._version)]
        gen = Generation(
            token_ids=tuple(req.output_ids),
            logprobs=tuple(req.logprobs),
            finish_reason=reason,
            weight_version=spans[-1][1],
            prompt_tokens=len(req.input_ids),
            cached_tokens=req.cached_tokens,
            meta={
                "id": req.request_id,
                "finish_reason": detail,
                "weight_version_spans": tuple(spans),
                "e2e_latency": time.perf_counter() - req.created,
                **({} if req.routed_experts is None else {"routed_experts": req.routed_experts}),
            },
        )
        req.future.set_result(gen)
        if req.stream is not None:
            req.stream.put_nowait(StreamChunk((), (), gen))

    def _fail(self, req: LocalRequest, exc: BaseException) -> None:
        self._by_id.pop(req.request_id, None)
        with contextlib.suppress(ValueError):
            self._waiting.remove(req)
        if req in self._running:
            self._running.remove(req)
            for i, r in enumerate(self._running):
                r.slot = i
        if not req.future.done():
            req.future.set_exception(exc)
            req.future.exception()  # mark retrieved: the caller may be gone
            if req.stream is not None:
                req.stream.put_nowait(exc)


__all__ = ["LocalEngine", "LocalRequest", "LogitsProcessor", "StreamChunk"]
