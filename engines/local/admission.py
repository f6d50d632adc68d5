"""Admission for `LocalEngine`'s scheduler: which waiting requests join the next prefill.

In arrival order, while slots are free and within the prefill token budget; each admitted
request gets its slot and the longest prefix the `PrefixCache` holds for it. A request that
shares a longer prefix with one admitted in the same batch than the prefix cache offers waits a
step instead (see `admit`), so samples of one prompt compute that prompt once.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from palaestra.engines.local.prefix_cache import KEY_TOKENS, common_prefix_len

if TYPE_CHECKING:
    from palaestra.engines.local.prefix_cache import PrefixCache
    from palaestra.engines.local.request import LocalRequest


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


def admit(waiting: deque[LocalRequest], running: int, *, max_running: int,
          max_prefill_tokens: int, cache: PrefixCache | None) -> list[LocalRequest]:
    """Waiting requests for the next prefill, in arrival order, within the token budget
    (taken off ``waiting``; ``running`` requests hold slots ``0..running-1``).

    A request that shares a longer prefix with one admitted in this same batch than the
    prefix cache offers (another sample of the same prompt, the same system prompt) waits
    one step: the admitted one's prompt KV is kept after its prefill, so the waiting one
    then prefills only its own suffix.
    """
    admitted: list[LocalRequest] = []
    budget = max_prefill_tokens
    deferred: list[LocalRequest] = []
    # admitted prompts per first-KEY_TOKENS key, sorted: the admitted prompt sharing the
    # longest prefix with a new one is one of its two sorted neighbours, so each check is
    # a bisection and two comparisons, not one per admitted prompt (256 samples of one
    # system prompt made that quadratic: ~1 s of event-loop time per RL step)
    by_key: dict[tuple[int, ...], list[tuple[tuple[int, ...], LocalRequest]]] = {}
    while waiting and running + len(admitted) < max_running:
        req = waiting[0]
        entry, hit = (None, 0)
        if cache is not None and req.lora is None:  # a named adapter's KV is its own
            entry, hit = cache.match(req.input_ids)
            hit = min(hit, len(req.input_ids) - 1)  # at least one token computes logits
            best, shared = _longest_shared(by_key.get(tuple(req.input_ids[:KEY_TOKENS]), []),
                                           req.input_ids)
            if best is not None and \
                    min(shared, len(req.input_ids) - 1) > max(hit, cache.min_tokens - 1):
                best.share_prompt = True
                deferred.append(waiting.popleft())
                continue
        new = len(req.input_ids) - hit
        if admitted and new > budget:
            break
        waiting.popleft()
        req.entry, req.cached_tokens = (entry, hit) if hit > 0 else (None, 0)
        req.slot = running + len(admitted)
        admitted.append(req)
        if cache is not None and len(req.input_ids) >= cache.min_tokens and req.lora is None:
            ids = tuple(req.input_ids)
            bisect.insort(by_key.setdefault(ids[:KEY_TOKENS], []), (ids, req),
                          key=lambda e: e[0])
        budget -= new
    waiting.extendleft(reversed(deferred))  # first in line for the next step
    return admitted


__all__ = ["admit"]
