"""Helpers shared by the engine tests (random prompts, a scripted logits processor)."""

from __future__ import annotations


def prompts(n: int, lo: int = 3, hi: int = 40, seed: int = 0, vocab: int = 700) -> list[list[int]]:
    """``n`` random prompts of random lengths in [lo, hi)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


class ForcedTokens:
    """A logits processor (LocalEngine.logits_processors) that makes a request emit a script.

    Test-only but honest: the model still runs, the engine still samples from the (now one-hot)
    logits, and everything downstream (decoding, parsing, HTTP) is the real path.
    """

    def __init__(self, script: list[int]) -> None:
        self.script = script

    def __call__(self, logits, requests) -> None:
        for row, req in enumerate(requests):
            k = len(req.output_ids)
            if k < len(self.script):
                logits[row].fill_(float("-inf"))
                logits[row, self.script[k]] = 0.0
