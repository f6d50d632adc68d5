"""palaestra: a Gym-style platform for training LLM agents with reinforcement learning.

Importing this package is cheap: it loads no torch, ray, sglang, megatron or docker. The
components live in subpackages (``palaestra.envs``, ``palaestra.agents``, ``palaestra.rollout``,
``palaestra.sandbox``, ``palaestra.trainers``, ``palaestra.benchmarks``) imported on demand.
"""

from palaestra.errors import PalaestraError
from palaestra.types import Message, Sample, StopReason, ToolCall, Trajectory, Turn

__version__ = "0.1.0"

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
