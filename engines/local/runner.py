"""The model runner of `LocalEngine`: the compute calls (a batched prefill, ``k`` decode steps)
and where they run (one worker thread, the engine's own CUDA stream, CUDA graphs when present).

Everything here runs on the worker thread through `ModelRunner.compute`, except `on_stream`,
which the event loop's bookkeeping (slot moves, prefix-cache copies) also uses so its kernels are
ordered after the engine's. The scheduler decides which requests a call computes; the runner
turns them into tensors, runs the decoder and samples (`batch_sampling.BatchSampler`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError
from palaestra.trace_ranges import span

if TYPE_CHECKING:
    import torch

    from palaestra.engines.local.batch_sampling import BatchSampler
    from palaestra.engines.local.model import Decoder
    from palaestra.engines.local.request import LocalRequest
    from palaestra.engines.local.slots import KVSlots


def _attention_backends(device: torch.device) -> contextlib.AbstractContextManager[Any]:
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


def choose_decode_attention(decoder: Decoder, device: torch.device, dtype: torch.dtype, choice: str) -> str:
    """``dense``: the batched GEMMs over the padded key length; ``triton``: the split-KV
    kernel (`decode_attention`), or a clear error where it cannot run; ``auto`` (the
    default): the kernel on CUDA when Triton is here and it agrees with the dense path on a
    small case of this model's heads, else dense. Returns what decode uses. The grouped
    kernel measured 1.9-2.2x the dense path per call on an H200 (docs/results.md)."""
    from palaestra.engines.local import decode_attention as split_kv

    if choice not in ("auto", "triton", "dense"):
        raise ConfigError(f"decode_attention {choice!r}: use auto, triton or dense")
    if choice == "dense" or not decoder.supports_split_kv:
        return "dense"  # (MLA: keys and values of other widths keep the dense path)
    why = None if split_kv.available(device.type) else (
        "it needs a CUDA device and the triton package")
    if why is None:
        c = decoder.config
        why = split_kv.self_check(device, dtype, c.num_heads, c.num_kv_heads, c.head_dim)
    if why is not None:
        if choice == "triton":
            raise ConfigError(f"decode_attention = 'triton' cannot run here: {why}; "
                              "use 'auto' or 'dense'")
        return "dense"
    decoder.split_kv_attention = True
    return "triton"


#: CUDA stream priority of the engine's kernels (lower is higher; -1 is the highest on
#: current GPUs, where torch clamps anything lower to the device's range)
ENGINE_STREAM_PRIORITY = -1


class ModelRunner:
    """Runs the decoder for the scheduler: `prefill` and `decode` return, per request, the
    sampled tokens and their logprobs; ``counters`` (the engine's) count the tokens and steps.

    ``decode_steps`` is how many decode steps run between two host syncs; ``graphs`` the CUDA
    graphs of the decode step (None on CPU, for MoE, or when turned off).
    """

    def __init__(self, decoder: Decoder, slots: KVSlots, sampler: BatchSampler,
                 counters: dict[str, int], *, device: torch.device, max_running: int, max_model_len: int,
                 decode_steps: int, use_thread: bool, cuda_graphs: bool) -> None:
        import torch

        self.decoder = decoder
        self.slots = slots
        self.sampler = sampler
        self.counters = counters
        self.device = device
        self.max_model_len = max_model_len
        self.decode_steps = decode_steps
        # set by the scheduler: whether requests wait for a slot (a decode call then ends at
        # the next check after any row stopped, so that they are admitted)
        self.admission_waiting: Callable[[], bool] = lambda: False
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="palaestra-engine")
            if use_thread else None
        )
        # every kernel of the engine runs on its own stream: decode (bandwidth-bound) overlaps a
        # trainer's kernels on the default stream of the same GPU (async mode), and the graphs
        # are captured in thread-local mode, so that trainer's CUDA calls cannot break a capture
        self.stream: Any = None
        if device.type == "cuda":
            # the highest priority: in async mode the decode of the next batch is what the
            # step waits for, and a trainer's long GEMMs on the default stream would hold it up
            self.stream = torch.cuda.Stream(device=device, priority=ENGINE_STREAM_PRIORITY)
            # the weights and the zeroed cache were written on the constructing thread's stream
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self.graphs: Any = None
        if cuda_graphs and device.type == "cuda":
            from palaestra.engines.local.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(decoder, slots.cache, max_running)

    # ---------------------------------------------------------------- where the compute runs
    async def compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the worker thread (inline without one), on the engine's stream."""
        import torch

        def call() -> Any:
            with span("engine_step"), torch.inference_mode(), self.on_stream(), \
                    _attention_backends(self.device):
                return fn(*args)

        if self._executor is None:
            return call()
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def on_stream(self) -> contextlib.AbstractContextManager[Any]:
        """The engine's CUDA stream as the current one (bookkeeping copies on the loop thread)."""
        import torch

        return torch.cuda.stream(self.stream) if self.stream is not None \
            else contextlib.nullcontext()

    def close(self) -> None:
        """Wait for the call in flight and stop the worker thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------------------- weights
    def load_weights(self, named: Iterable[tuple[str, Any]]) -> int:
        """Copy (name, tensor) pairs into the decoder (a compute call); the number copied."""
        import torch

        if self.stream is not None:  # the new tensors come from the caller's (default) stream
            self.stream.wait_stream(torch.cuda.default_stream(self.device))
        count = self.decoder.load_weights(named)
        if self.stream is not None:  # the caller may free (and reuse) the sources at once
            self.stream.synchronize()
        return count

    def weights_changed(self) -> None:
        """New weights or adapters: the graphs recapture what they baked in."""
        if self.graphs is not None:
            self.graphs.weights_changed()

    # ------------------------------------------------------------- compute (worker thread)
    def prefill(self, reqs: list[LocalRequest]) -> tuple[list[list[int]], list[list[float]]]:
        """One batched forward over each request's uncached prompt tokens, then one sample."""
        import torch

        from palaestra.engines.local.model import ExtendBatch

        dev = self.device
        slot0 = reqs[0].slot
        starts = [r.cached_tokens for r in reqs]
        lens = [len(r.input_ids) - r.cached_tokens for r in reqs]
        self.slots.load_prefixes(reqs)
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
        logits = self.decoder.extend(tokens.to(dev), batch, self.slots.cache)
        self.counters["prefill_tokens"] += sum(lens)
        self.counters["cached_tokens"] += sum(starts)
        self.counters["prefill_steps"] += 1
        return self.sampler.sample(logits, reqs)

    def decode(self, reqs: list[LocalRequest]) -> tuple[list[list[int]], list[list[float]]]:
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
        processors = self.sampler.logits_processors
        if k > 1 and (processors or any(r.sampling.stop for r in reqs)):
            k = 1
        if k > 1:
            k = min(k, min(r.sampling.max_new_tokens - len(r.output_ids) for r in reqs),
                    min(self.max_model_len - len(r.input_ids) - len(r.output_ids) for r in reqs))
            k = max(k, 1)
        positions = [r.kv_len for r in reqs]
        self.slots.cache.ensure(b, max(positions) + k)
        self.counters["decode_calls"] += 1
        dev = self.device
        tokens_dev = torch.tensor([r.output_ids[-1] for r in reqs], device=dev)
        pos0 = torch.tensor(positions, device=dev)
        plan = self.sampler.plan(reqs, k)
        out_tokens, out_logprobs = [], []
        lowrank = self._lora_rows(reqs)
        graphs = None if lowrank else self.graphs  # the graphs hold no low-rank updates
        # sampling inside the graph unless a logit bias or processor must see the logits
        sampler = plan.sampler if (graphs is not None and graphs.sample_in_graph
                                   and not plan.biases and not processors) else None
        stops = _StopWatch(reqs, dev, k, self.admission_waiting)
        for step in range(k):
            if stops.should_end_before(step):
                self.counters["decode_early_ends"] += 1
                break
            key_len = max(positions) + step + 1
            pos = pos0 + step if step else pos0
            if graphs is not None and graphs.supports(b, key_len, sampler):
                if sampler is not None:
                    u = None if plan.uniforms is None else plan.uniforms[step]
                    tokens_dev, logprobs_dev = graphs.run_sampled(tokens_dev, pos, key_len,
                                                                  sampler, u)
                else:
                    logits = graphs.run(tokens_dev, pos, key_len)
                    tokens_dev, logprobs_dev = self.sampler.sample_device(logits, reqs, plan,
                                                                          step)
            else:
                logits = self.decoder.decode(tokens_dev, pos, self.slots.cache, key_len)
                tokens_dev, logprobs_dev = self.sampler.sample_device(logits, reqs, plan, step)
            out_tokens.append(tokens_dev)
            out_logprobs.append(logprobs_dev)
            stops.sampled(step, tokens_dev)
            self.counters["decode_steps"] += 1
        k = len(out_tokens)
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


class _StopWatch:
    """Ends a multi-step decode call early once every row has sampled a stop token, or once any
    has while other requests wait for a slot.

    Without it a call of ``k`` steps runs all ``k`` even when every row stopped at its first: at
    the end of a rollout, and whenever the batch finishes together, that is up to ``k - 1``
    wasted steps before the host sees the tokens; and a new turn waits for the whole call before
    it is admitted. The stop flags are kept on the device; every ``CHECK_EVERY`` steps whether
    all and whether any row stopped is copied to pinned host memory behind an event. The host
    reads a check one check late (waiting for the GPU to reach it while the next
    ``CHECK_EVERY`` steps are already queued), so the GPU never waits for the host, and a call
    ends at most ``2 * CHECK_EVERY`` steps after the stop it waited for. On a CPU
    (synchronous) a check is read at once. Only stop *tokens* are watched: a call never runs
    past a row's length budget (the runner caps ``k``), and stop strings keep ``k`` at 1.
    """

    CHECK_EVERY = 8

    def __init__(self, reqs: list[LocalRequest], device: torch.device, k: int,
                 admission_waiting: Callable[[], bool]) -> None:
        import torch

        widest = max(len(r.stop_ids) for r in reqs)
        self.active = k > self.CHECK_EVERY and widest > 0  # else nothing to end early on
        self.device = device
        self.admission_waiting = admission_waiting
        self.pending: list[tuple[Any, Any]] = []  # (event or None, host [all, any]) per check
        if self.active:
            # each row's stop ids, padded with -1 (never sampled): [B, widest]
            self.stop_ids = torch.tensor(
                [sorted(r.stop_ids) + [-1] * (widest - len(r.stop_ids)) for r in reqs],
                device=device)
            self.stopped = torch.zeros(len(reqs), dtype=torch.bool, device=device)

    def sampled(self, step: int, tokens: torch.Tensor) -> None:
        """Step ``step``'s tokens: mark the rows that stopped; queue a check when one is due."""
        import torch

        if not self.active:
            return
        self.stopped |= (tokens[:, None] == self.stop_ids).any(dim=1)
        if (step + 1) % self.CHECK_EVERY:
            return
        flags = torch.stack([self.stopped.all(), self.stopped.any()])
        if self.device.type != "cuda":
            self.pending.append((None, flags))
            return
        host = torch.empty(2, dtype=torch.bool, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending.append((event, host))

    def should_end_before(self, step: int) -> bool:
        """Whether the call ends before ``step``: by a check the GPU has reached (the one before
        the latest on CUDA, so that the latest chunk of steps stays queued while the host
        waits), every row had stopped, or some row had and requests wait for a slot."""
        if not self.active or step % self.CHECK_EVERY or not self.pending:
            return False
        if self.device.type == "cuda":
            if len(self.pending) < 2:
                return False
            event, flags = self.pending[-2]
            event.synchronize()
        else:
            flags = self.pending[-1][1]
        every, some = (bool(f) for f in flags.tolist())
        return every or (some and self.admission_waiting())


__all__ = ["ModelRunner", "choose_decode_attention"]
