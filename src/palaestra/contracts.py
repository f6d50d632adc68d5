"""The seams between components as protocols: what rollout needs from an env, and what the
training loop and a weight push need from a trainer backend.

Core holds them so that each side depends on the contract, not on the other's classes (rollout
never names `palaestra.envs.Env`; the loop never names `TorchBackend` or `MegatronBackend`).
`Engine`, the third seam, lives in `palaestra.engine`.

- `RolloutEnv`: the async gymnasium API an episode drives (``areset``/``astep``/``close``).
  `palaestra.envs.Env` implements it, and so does any gymnasium-style env with async twins.
- `WeightSource`: full weights with Hugging Face names, whole or in buckets (an engine push).
- `TrainerBackend`: a policy being trained: `WeightSource` + optimizer steps, log-probs,
  checkpoints and the Hugging Face export. Generic in its batch and loss-config types, which
  belong to trainers (``TrainerBackend[TrainBatch, LossConfig]``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from palaestra.types import Message

if TYPE_CHECKING:
    import torch

BatchT_contra = TypeVar("BatchT_contra", contravariant=True)
LossT_contra = TypeVar("LossT_contra", contravariant=True)

#: an env's observation: the new chat messages of the turn
Observation = Sequence[Message]


@runtime_checkable
class RolloutEnv(Protocol):
    """What an episode calls on an env (gymnasium's API, async). ``info`` dicts carry the keys of
    `palaestra.episode_info` (``ResetInfo``/``StepInfo``)."""

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict[str, Any]]:
        """Start an episode (``options["task"]``: the task row); the first observation + info."""
        ...

    async def astep(
        self, action: Message | str
    ) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        """Apply one assistant message: observation, reward, terminated, truncated, info."""
        ...

    def close(self) -> None:
        """Release the env's resources (safe to call twice)."""
        ...


@runtime_checkable
class WeightSource(Protocol):
    """Where a weight push reads the policy: Hugging Face names, snapshots of the tensors."""

    def state_dict_for_engines(
        self, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """The full weights (every tied name included)."""
        ...

    def iter_engine_weight_buckets(
        self, bucket_bytes: int = 512 << 20, *, dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """`state_dict_for_engines` in lists of at most ``bucket_bytes`` (at least one tensor)."""
        ...


@runtime_checkable
class TrainerBackend(WeightSource, Protocol[BatchT_contra, LossT_contra]):
    """A policy under training, as the training loop drives it (PyTorch, Megatron-core, a group
    of trainer actors)."""

    def train_step(self, batch: BatchT_contra, loss_cfg: LossT_contra, /) -> dict[str, float]:
        """One optimizer step; float metrics (``loss``, ``grad_norm``, ``lr``, ...)."""
        ...

    def forward_logprobs(self, batch: BatchT_contra, /, *, ref: bool = False) -> list[torch.Tensor]:
        """Per-sequence log-probs of the batch's tokens (``ref``: under the reference model)."""
        ...

    def save(self, directory: Any, /, *, extra: dict[str, Any] | None = None) -> Path:
        """Checkpoint into ``directory`` (a path); ``extra`` is returned by `load`."""
        ...

    def load(self, directory: Any, /) -> dict[str, Any]:
        """Restore a `save` checkpoint; its state (``step``, the saved extras)."""
        ...

    def export_hf(self, directory: Any, /, *, dtype: torch.dtype | None = None) -> Path:
        """A ``from_pretrained``-loadable model (and tokenizer) in ``directory``."""
        ...


@runtime_checkable
class AdapterTrainer(Protocol):
    """A backend that can train a LoRA adapter: with ``lora`` set, only the adapter goes to
    engines that host adapters (`palaestra.engine.AdapterHost`, `AdapterServing`)."""

    lora: Any

    def adapter_for_engines(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The adapter's state dict and peft config (None without one)."""
        ...

    def export_adapter(self, directory: str | Path) -> Path:
        """The adapter as a peft folder in ``directory``."""
        ...


def trains_adapter(backend: object) -> bool:
    """Whether ``backend`` trains a LoRA adapter now (an `AdapterTrainer` with ``lora`` set)."""
    return isinstance(backend, AdapterTrainer) and backend.lora is not None


__all__ = ["AdapterTrainer", "Observation", "RolloutEnv", "TrainerBackend", "WeightSource",
           "trains_adapter"]
