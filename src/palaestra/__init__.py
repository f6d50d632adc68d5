"""palaestra: a Gym-style platform for training LLM agents with reinforcement learning.

Importing this package is cheap: it loads no torch, ray, sglang, megatron or docker. The
components live in subpackages (``palaestra.envs``, ``palaestra.agents``, ``palaestra.engines``,
``palaestra.rollout``, ``palaestra.sandbox``, ``palaestra.trainers``, ``palaestra.run``,
``palaestra.benchmarks``, and the core
``palaestra.tool_parsers``) imported on first attribute access: ``import palaestra;
palaestra.envs.make(...)`` works.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from palaestra.errors import PalaestraError
from palaestra.types import Message, Sample, StopReason, ToolCall, Trajectory, Turn

if TYPE_CHECKING:  # for type checkers and IDEs; at run time `__getattr__` imports on first use
    from palaestra import agents as agents
    from palaestra import benchmarks as benchmarks
    from palaestra import engines as engines
    from palaestra import envs as envs
    from palaestra import rollout as rollout
    from palaestra import run as run
    from palaestra import sandbox as sandbox
    from palaestra import tool_parsers as tool_parsers
    from palaestra import trainers as trainers

__version__ = "0.1.0"

#: subpackages imported on first attribute access (``palaestra.envs`` after ``import palaestra``)
_SUBPACKAGES = ("agents", "benchmarks", "engines", "envs", "rollout", "run", "sandbox",
                "tool_parsers", "trainers")


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"palaestra.{name}")  # also binds it on this module
    raise AttributeError(f"module 'palaestra' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBPACKAGES})

__all__ = [
    "Message",
    "PalaestraError",
    "Sample",
    "StopReason",
    "ToolCall",
    "Trajectory",
    "Turn",
    "__version__",
]
