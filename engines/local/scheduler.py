"""The scheduler of `LocalEngine`: requests in, admission into free slots, the prefill/decode
loop, and each request's end (stop, length, abort, failure).

An asyncio task owns the model. Each iteration it (1) drops aborted requests, (2) admits
waiting requests into free slots and prefills them together (only the tokens after their longest
cached prefix), (3) runs one batched decode call for every running request, then hands control
back to the event loop. Requests therefore join and leave the running batch between steps, and a
weight update, pause or abort takes effect at the next step boundary (`between_steps`). The
compute runs on the model runner's worker thread; all bookkeeping here happens on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from palaestra.errors import EngineError
from palaestra.engine import EngineUnavailableError, Generation, SamplingParams
from palaestra.engines.local.admission import admit
from palaestra.engines.local.request import LocalRequest, StreamChunk
from palaestra.trace_ranges import span

if TYPE_CHECKING:
    from palaestra.contracts import Tokenizer
    from palaestra.engines.local.runner import ModelRunner
    from palaestra.engines.local.slots import KVSlots


class Scheduler:
    """Continuous batching over ``runner`` (see the module docstring).

    ``max_running`` bounds the running batch, ``max_prefill_tokens`` the tokens one prefill
    computes (at least one request is always admitted); ``tokenizer`` is called only when a
    request has stop strings. ``counters`` are the engine's (the runner counts into them too);
    ``timers`` where the scheduler's wall time goes while it has work.
    """

    def __init__(self, runner: ModelRunner, slots: KVSlots, counters: dict[str, int], *,
                 max_running: int, max_prefill_tokens: int, max_model_len: int,
                 eos_token_ids: frozenset[int], tokenizer: Callable[[], Tokenizer]) -> None:
        self.runner = runner
        self.slots = slots
        self.counters = counters
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._tokenizer = tokenizer
        self.version = 0
        self.waiting: deque[LocalRequest] = deque()
        # a long decode call ends early (after a row stops) when new requests wait for it
        runner.admission_waiting = lambda: bool(self.waiting)
        self.running: list[LocalRequest] = []
        self.by_id: dict[str, LocalRequest] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self.lock: asyncio.Lock | None = None
        self.paused = False
        self.closed = False
        self.fatal: BaseException | None = None
        self._ids = itertools.count()
        # where the scheduler's wall time goes while it has work: prefill and decode compute
        # calls (launch to results on the host), and the rest (admission, bookkeeping, the
        # episodes' own coroutines on this event loop): the GPU waits through that rest
        self.timers: dict[str, float] = dict.fromkeys(("prefill_s", "decode_s", "active_s"), 0.0)

    # ------------------------------------------------------------------------------ submission
    def submit(self, input_ids: Sequence[int], sampling: SamplingParams, request_id: str | None,
               session_id: str | None, *, stream: bool, lora: str | None = None
               ) -> LocalRequest:
        """Check and queue a request (finished at once when it asks for no tokens)."""
        import torch

        if self.closed:
            raise EngineUnavailableError("the engine is closed")
        if self.fatal is not None:
            raise EngineUnavailableError(f"the engine's scheduler failed: {self.fatal!r}")
        ids = [int(t) for t in input_ids]
        if not ids:
            raise EngineError("input_ids is empty; a request needs at least one token")
        decoder = self.runner.decoder
        vocab = decoder.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise EngineError(f"token ids {bad[:3]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise EngineError(
                f"the prompt has {len(ids)} tokens; the engine's context is {self.max_model_len}"
            )
        if lora is not None:  # fail now on an adapter that is not loaded
            if decoder.lora is None:
                raise EngineError(f"no LoRA adapter named {lora!r} is loaded (none are); load "
                                  "it first (load_lora_adapter)")
            decoder.lora.id_of(lora)
        if sampling.stop:
            _ = self._tokenizer()  # fail now, not mid-generation
        self.ensure_started()
        loop = asyncio.get_running_loop()
        rid = request_id or f"local-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if rid in self.by_id:
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
        self.by_id[rid] = req
        self.waiting.append(req)
        self.kick()
        return req

    def request_abort(self, req: LocalRequest, message: str) -> None:
        """Mark ``req`` aborted: a waiting one finishes now, a running one at the next step."""
        if req.future.done():
            return
        req.abort_message = message
        if req in self.waiting:
            self.waiting.remove(req)
            self._finish(req, "abort", {"type": "abort", "message": message})
        self.kick()

    # ---------------------------------------------------------------------------- control
    async def pause(self, abort: bool) -> None:
        """Stop scheduling steps (returns once the step in flight ended); ``abort``: abort the
        waiting and running requests too."""
        self.ensure_started()
        self.paused = True
        if abort:
            await self.abort(None)
        assert self.lock is not None
        async with self.lock:
            pass

    def resume(self) -> None:
        self.paused = False
        self.kick()

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """Abort the given requests (all when None): they finish with ``finish_reason="abort"``."""
        targets = list(self.by_id.values()) if request_ids is None else [
            self.by_id[r] for r in request_ids if r in self.by_id
        ]
        for req in targets:
            self.request_abort(req, "aborted by request")
        if request_ids is None or targets:
            self.ensure_started()
            assert self.lock is not None
            if self.paused:  # a paused engine runs no steps: finish them here
                async with self.lock:
                    self._reap_aborted()

    @contextlib.asynccontextmanager
    async def between_steps(self) -> AsyncIterator[None]:
        """Hold the model between two steps (weight updates, adapters, memory moves)."""
        self.ensure_started()
        assert self.lock is not None
        async with self.lock:
            yield

    async def close(self) -> None:
        """Fail every request and stop the loop's task."""
        self.closed = True
        for req in list(self.by_id.values()):
            self._fail(req, EngineUnavailableError("the engine was closed"))
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                if self._loop is asyncio.get_running_loop():
                    await self.task

    # ------------------------------------------------------------------------------- the loop
    def ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self.task is not None and not self.task.done():
            return
        if self._loop is not loop:
            # a new event loop (e.g. a second asyncio.run): requests of the old loop are gone
            self._loop = loop
            self._wakeup = asyncio.Event()
            self.lock = asyncio.Lock()
            self.waiting.clear()
            self.running.clear()
            self.by_id.clear()
        self.task = loop.create_task(self._run_loop(), name="palaestra-local-engine")

    def kick(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _run_loop(self) -> None:
        assert self._wakeup is not None and self.lock is not None
        try:
            while not self.closed:
                if self.paused or not (self.waiting or self.running):
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                began = time.perf_counter()
                async with self.lock:
                    if self.paused:
                        continue
                    with span("admission_stop"):
                        self._reap_aborted()
                        admitted = admit(self.waiting, len(self.running),
                                         max_running=self.max_running,
                                         max_prefill_tokens=self.max_prefill_tokens,
                                         cache=self.slots.prefix_cache)
                    if admitted:
                        await self._step(self.runner.prefill, admitted)
                    if self.running and not self.paused:
                        await self._step(self.runner.decode, list(self.running))
                await asyncio.sleep(0)
                self.timers["active_s"] += time.perf_counter() - began
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a scheduler bug: fail everything loudly, stay unhealthy
            self.fatal = exc
            for req in list(self.by_id.values()):
                self._fail(req, EngineUnavailableError(f"the engine's scheduler failed: {exc!r}"))
            raise

    async def _step(self, kind: Callable[[list[LocalRequest]], Any],
                    reqs: list[LocalRequest]) -> None:
        began = time.perf_counter()
        try:
            tokens, logprobs = await self.runner.compute(kind, reqs)
        except Exception as exc:  # e.g. out of memory: fail these requests, keep serving
            import torch

            with torch.inference_mode(), self.runner.on_stream():
                # a prefill's requests hold no running slot yet: no-op
                self.slots.compact(self.running, reqs)
            for req in reqs:
                self._fail(req, EngineError(f"generation failed: {type(exc).__name__}: {exc}"))
            return
        finally:
            timer = "prefill_s" if kind == self.runner.prefill else "decode_s"
            self.timers[timer] += time.perf_counter() - began
        with span("admission_stop"):  # the tokens' stop checks, retiring finished requests
            self._after_step(reqs, tokens, logprobs)

    def _reap_aborted(self) -> None:
        self._retire_many([(r, "abort", {"type": "abort", "message": r.abort_message or ""})
                           for r in self.running if r.abort_message is not None])

    # --------------------------------------------------------------- bookkeeping (event loop)
    def _after_step(self, reqs: list[LocalRequest], tokens: list[list[int]],
                    logprobs: list[list[float]]) -> None:
        if reqs and reqs[0] not in self.running:  # a prefill: the batch joins the running set
            self.running.extend(reqs)
            self._share_prompts(reqs)
        finished: list[tuple[LocalRequest, str, dict[str, Any]]] = []
        version = self.version
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

        if self.slots.prefix_cache is None:
            return
        with torch.inference_mode(), self.runner.on_stream():
            self.slots.share_prompts(reqs)

    def _stop_reason(self, req: LocalRequest, tok: int) -> tuple[str, dict[str, Any]] | None:
        sp = req.sampling
        if tok in req.stop_ids:
            return "stop", {"type": "stop", "matched": tok}
        if sp.stop:
            tail = self._tokenizer().decode(req.output_ids[-4 * max(map(len, sp.stop)) - 4 :])
            for s in sp.stop:
                if s in tail:
                    return "stop", {"type": "stop", "matched": s}
        if len(req.output_ids) >= sp.max_new_tokens:
            return "length", {"type": "length", "length": sp.max_new_tokens}
        if len(req.input_ids) + len(req.output_ids) >= self.max_model_len:
            return "length", {"type": "length", "length": len(req.output_ids)}
        return None

    def _retire_many(self, finished: list[tuple[LocalRequest, str, dict[str, Any]]]) -> None:
        """Take running requests out of their slots (keeping their KV for reuse), finish them."""
        import torch

        if not finished:
            return
        leaving = [req for req, _, _ in finished]
        with torch.inference_mode(), self.runner.on_stream():
            self.slots.keep_finished(leaving)
            self.slots.compact(self.running, leaving)
        for req, reason, detail in finished:
            self._finish(req, reason, detail)

    def _finish(self, req: LocalRequest, reason: str, detail: dict[str, Any]) -> None:
        self.by_id.pop(req.request_id, None)
        if req.future.done():
            return
        self.counters["finished"] += 1
        if reason == "abort":
            self.counters["aborted"] += 1
        spans = req.version_spans or [(0, self.version)]
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
        self.by_id.pop(req.request_id, None)
        with contextlib.suppress(ValueError):
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
            for i, r in enumerate(self.running):
                r.slot = i
        if not req.future.done():
            req.future.set_exception(exc)
            req.future.exception()  # mark retrieved: the caller may be gone
            if req.stream is not None:
                req.stream.put_nowait(exc)


__all__ = ["Scheduler"]
