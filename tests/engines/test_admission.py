"""Admission of `LocalEngine`'s scheduler (`engines/local/admission.py`), without a model: slots,
the prefill token budget, prefix-cache hits, and the wait of a request that shares its prompt
with one admitted in the same batch."""

from __future__ import annotations

import asyncio
from collections import deque

from palaestra.engine import SamplingParams
from palaestra.engines.local.admission import admit
from palaestra.engines.local.prefix_cache import PrefixCache
from palaestra.engines.local.request import LocalRequest


def _request(ids: list[int], name: str, loop: asyncio.AbstractEventLoop) -> LocalRequest:
    return LocalRequest(request_id=name, input_ids=ids, sampling=SamplingParams(),
                        session_id=None, future=loop.create_future())


def test_admission_fills_free_slots_within_the_budget() -> None:
    loop = asyncio.new_event_loop()
    try:
        waiting = deque(_request(list(range(i * 100, i * 100 + 30)), f"r{i}", loop)
                        for i in range(4))
        first = admit(waiting, 1, max_running=8, max_prefill_tokens=70, cache=None)
        assert [r.request_id for r in first] == ["r0", "r1"]  # a third would pass 70 tokens
        assert [r.slot for r in first] == [1, 2]  # slot 0 is the running request's
        full = admit(waiting, 7, max_running=8, max_prefill_tokens=10, cache=None)
        assert [r.request_id for r in full] == ["r2"]  # over budget, but one always goes
        assert [r.request_id for r in waiting] == ["r3"]
        assert admit(waiting, 8, max_running=8, max_prefill_tokens=10, cache=None) == []
    finally:
        loop.close()


def test_admission_uses_the_prefix_cache_and_defers_a_shared_prompt() -> None:
    loop = asyncio.new_event_loop()
    try:
        cache = PrefixCache(capacity_tokens=1000, min_tokens=16)
        prompt = list(range(40))
        cache.insert(tuple(prompt[:20]), ("k", "v"), None)
        a, b = _request(prompt, "a", loop), _request(prompt + [7], "b", loop)
        other = _request(list(range(500, 540)), "c", loop)
        waiting = deque([a, b, other])
        admitted = admit(waiting, 0, max_running=8, max_prefill_tokens=4096, cache=cache)
        assert [r.request_id for r in admitted] == ["a", "c"]
        assert a.cached_tokens == 20 and a.entry is not None  # the cached 20 are not recomputed
        assert a.share_prompt  # b waits for a's prompt KV instead of computing it again
        assert [r.request_id for r in waiting] == ["b"]  # first in line for the next step
    finally:
        loop.close()
