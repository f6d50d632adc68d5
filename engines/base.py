"""The engine protocol: token ids in, token ids + logprobs out (engines know no tokenizer).

The contract lives in core (`palaestra.engine`) so that agents and trainers need not import
rollout for it; this module keeps the old import path working.
"""

from __future__ import annotations

from palaestra.engine import (
    Engine,
    EngineUnavailableError,
    Generation,
    SamplingParams,
)

__all__ = ["Engine", "EngineUnavailableError", "Generation", "SamplingParams"]
