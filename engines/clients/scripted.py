"""`ScriptedEngine`: an `Engine` that answers with canned token ids, for tests and benchmarks.

It knows no model: a *script* maps the input ids (and a seeded RNG) to the response ids, e.g.
``ScriptedEngine.by_marker([CALL, ANSWER], marker_id=tool_response_id)`` answers turn ``k`` (``k``
= how often the marker occurs in the input) with ``responses[min(k, len - 1)]``. Everything else
behaves like a real engine: ``max_new_tokens`` and stop tokens cut the response, logprobs come
from a fixed function of (previous token, token) that `score` recomputes for a whole sequence
(the analogue of a forward pass), ``weight_version`` changes on `update_weights`, and with
``latency_s > 0`` a request takes that long, `abort`/`pause` end it early with
``finish_reason="abort"`` and the tokens produced so far, which the same session then resumes.
With ``latency_s == 0`` a request yields to the event loop once and returns at once.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from palaestra.errors import EngineError
from palaestra.engine import Generation, SamplingParams

Script = Callable[[Sequence[int], random.Random], Sequence[int]]


def scripted_logprob(prev: int, token: int) -> float:
    """The logprob the scripted "model" gives ``token`` after ``prev``: in [-1, -0.001]."""
    return -(((prev * 31 + token * 17) % 1000) + 1) / 1000.0


class ScriptedEngine:
    """Canned responses with real engine semantics (stop tokens, abort, versions, logprobs)."""

    def __init__(
        self,
        script: Script | Sequence[int],
        *,
        latency_s: float = 0.0,
        version: int = 0,
        seed: int = 0,
        name: str = "scripted",
    ) -> None:
        if not callable(script):
            canned = tuple(int(t) for t in script)
            script = lambda _ids, _rng: canned
        self._script: Script = script
        self.latency_s = float(latency_s)
        self._version = int(version)
        self._rng = random.Random(seed)
        self.name = name
        self.requests = 0
        self.generated_tokens = 0
        self.alive = True
        self._paused = False
        self._resumed: asyncio.Event | None = None  # created lazily on the running loop
        self._inflight: dict[str, asyncio.Event] = {}
        self._partial: dict[str, tuple[tuple[int, ...], int]] = {}
        self._seq = 0

    @classmethod
    def by_marker(
        cls, responses: Sequence[Sequence[int]], marker_id: int, **kwargs: Any
    ) -> ScriptedEngine:
        """Turn ``k`` (``k`` = occurrences of ``marker_id`` in the input) gets ``responses[k]``."""
        table = tuple(tuple(int(t) for t in r) for r in responses)
        if not table:
            raise ValueError("by_marker needs at least one response")

        def script(ids: Sequence[int], _rng: random.Random) -> Sequence[int]:
            return table[min(ids.count(marker_id), len(table) - 1)]

        return cls(script, **kwargs)

    # ----- Engine protocol --------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> Generation:
        if not self.alive:
            raise EngineError(f"engine {self.name!r} is dead")
        while self._paused:  # like SGLang after /pause_generation: new requests wait
            await self._resume_event().wait()
        self.requests += 1
        if not isinstance(input_ids, list):
            input_ids = list(input_ids)
        response, start = self._response(input_ids, sampling, session_id)
        tokens, finish = self._cut(response[start:], sampling)
        finish_reason = finish
        if self.latency_s > 0:
            self._seq += 1
            rid = request_id or f"{self.name}-{self._seq}"
            event = self._inflight[rid] = asyncio.Event()
            began = time.perf_counter()
            try:
                await asyncio.wait_for(event.wait(), self.latency_s)
            except asyncio.TimeoutError:
                pass
            else:  # aborted: keep what was "generated" so far
                done = (time.perf_counter() - began) / self.latency_s
                # an aborted request never has all its tokens: under a loaded event loop the
                # abort can land after the latency ran out, which would otherwise leave nothing
                # for the resumed request (and no partial rollout to observe)
                tokens = tokens[: min(int(len(tokens) * done), max(len(tokens) - 1, 0))]
                finish_reason = "abort"
                if session_id is not None:
                    self._partial[session_id] = (response, start + len(tokens))
            finally:
                self._inflight.pop(rid, None)
            if not self.alive:
                raise EngineError(f"engine {self.name!r} died during the request")
        else:
            await asyncio.sleep(0)
        self.generated_tokens += len(tokens)
        prev = input_ids[-1] if input_ids else 0
        logprobs = []
        for t in tokens:
            logprobs.append(scripted_logprob(prev, t))
            prev = t
        return Generation(
            token_ids=tuple(tokens),
            logprobs=tuple(logprobs),
            finish_reason=finish_reason,
            weight_version=self._version,
            prompt_tokens=len(input_ids),
            meta={"engine": self.name},
        )

    def _response(
        self, input_ids: list[int], sampling: SamplingParams, session_id: str | None
    ) -> tuple[tuple[int, ...], int]:
        """The full response for this turn and where to start (after resumed partial tokens)."""
        if session_id is not None and session_id in self._partial:
            response, done = self._partial.pop(session_id)
            if done and input_ids[-done:] == list(response[:done]):
                return response, done
        rng = random.Random(sampling.seed) if sampling.seed is not None else self._rng
        return tuple(int(t) for t in self._script(input_ids, rng)), 0

    @staticmethod
    def _cut(tokens: Sequence[int], sampling: SamplingParams) -> tuple[list[int], str]:
        out: list[int] = []
        stops = sampling.stop_token_ids
        for t in tokens:
            if len(out) >= sampling.max_new_tokens:
                return out, "length"
            out.append(t)
            if t in stops:
                return out, "stop"
        return out, "stop"

    def score(self, token_ids: Sequence[int]) -> list[float]:
        """Logprob of every token given the previous one (0.0 for the first): a "forward pass"."""
        return [0.0] + [scripted_logprob(p, t) for p, t in itertools.pairwise(token_ids)]

    async def update_weights(
        self,
        state_dict: Mapping[str, Any] | None = None,
        *,
        path: str | None = None,
        version: int | None = None,
    ) -> None:
        self._version = self._version + 1 if version is None else int(version)

    async def pause(self) -> None:
        self._paused = True
        self._resume_event().clear()
        await self.abort()

    async def resume(self) -> None:
        self._paused = False
        self._resume_event().set()

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        targets = list(self._inflight) if request_ids is None else request_ids
        for rid in targets:
            event = self._inflight.get(rid)
            if event is not None:
                event.set()

    async def flush_cache(self) -> None:
        self._partial.clear()

    async def health(self) -> bool:
        return self.alive

    async def close(self) -> None:
        await self.abort()

    def kill(self) -> None:
        """Simulate a crash: in-flight and later requests raise `EngineError`."""
        self.alive = False
        for event in self._inflight.values():
            event.set()

    def _resume_event(self) -> asyncio.Event:
        if self._resumed is None:
            self._resumed = asyncio.Event()
            self._resumed.set()
        return self._resumed


__all__ = ["ScriptedEngine", "scripted_logprob"]
