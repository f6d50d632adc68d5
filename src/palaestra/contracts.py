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
- `Tokenizer`: what agents, rollout, serving and runs call on a tokenizer (a Hugging Face
  ``PreTrainedTokenizerBase`` satisfies it structurally; engines know no tokenizer).
- `Offloadable`, `MemoryReporting`, `Closeable`: what a colocated run and its teardown call on a
  trainer (moving its state off the GPU and back, per-rank memory, release).

mypy checks this module with ``disallow_any_explicit`` (pyproject.toml): no ``Any`` here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from palaestra.types import Message

if TYPE_CHECKING:
    import torch

BatchT_contra = TypeVar("BatchT_contra", contravariant=True)
LossT_contra = TypeVar("LossT_contra", contravariant=True)

#: an env's observation: the new chat messages of the turn
Observation = Sequence[Message]

#: a filesystem path as callers pass one
StrPath = str | os.PathLike[str]

#: a tool as a chat template takes it: its JSON schema (Hugging Face also takes a Python function)
ChatTool = dict[str, object] | Callable[[], object]


@runtime_checkable
class RolloutEnv(Protocol):
    """What an episode calls on an env (gymnasium's API, async). ``info`` dicts carry the keys of
    `palaestra.episode_info` (``ResetInfo``/``StepInfo``)."""

    async def areset(
        self, *, seed: int | None = None, options: dict[str, object] | None = None
    ) -> tuple[Observation, dict[str, object]]:
        """Start an episode (``options["task"]``: the task row); the first observation + info."""
        ...

    async def astep(
        self, action: Message | str
    ) -> tuple[Observation, float, bool, bool, dict[str, object]]:
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

    def save(self, directory: str | Path, /, *, extra: dict[str, object] | None = None) -> Path:
        """Checkpoint into ``directory`` (a path); ``extra`` is returned by `load`."""
        ...

    def load(self, directory: str | Path, /) -> dict[str, object]:
        """Restore a `save` checkpoint; its state (``step``, the saved extras)."""
        ...

    def export_hf(self, directory: str | Path, /, *, dtype: torch.dtype | None = None) -> Path:
        """A ``from_pretrained``-loadable model (and tokenizer) in ``directory``."""
        ...


class AdapterSettings(Protocol):
    """What a weight push reads of a LoRA adapter's settings."""

    @property
    def adapter_name(self) -> str: ...
    @property
    def export_merged(self) -> bool:
        """Whether the run's end also exports the adapter merged into the base weights."""
        ...


@runtime_checkable
class AdapterTrainer(Protocol):
    """A backend that can train a LoRA adapter: with ``lora`` set, only the adapter goes to
    engines that host adapters (`palaestra.engine.AdapterHost`, `AdapterServing`)."""

    @property
    def lora(self) -> AdapterSettings | None:
        """The adapter being trained (None: full weights)."""
        ...

    def adapter_for_engines(self) -> tuple[dict[str, torch.Tensor], dict[str, object]] | None:
        """The adapter's state dict and peft config (None without one)."""
        ...

    def export_adapter(self, directory: str | Path) -> Path:
        """The adapter as a peft folder in ``directory``."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """What the package calls on a tokenizer: text <-> ids, the chat template, special ids.

    A Hugging Face ``PreTrainedTokenizerBase`` satisfies it structurally (its parameters are
    wider, its returns no wider); test doubles implement the members their code path calls.
    """

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def pad_token_id(self) -> int | None: ...

    def encode(self, text: str, /, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        ...

    def decode(self, token_ids: list[int], /, *, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str | list[str]:
        """The text of ``token_ids`` (Hugging Face types the return wider; it is a str here)."""
        ...

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        /,
        *,
        tools: list[ChatTool] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
    ) -> object:
        """The rendered conversation: text with ``tokenize=False``, else token ids. Callers pass
        the template's own keywords (``enable_thinking``, ...) through ``**``: Hugging Face's
        keywords are typed, so the protocol names only those the package passes by name."""
        ...

    def convert_tokens_to_ids(self, tokens: str, /) -> int | list[int]:
        """The id of one token string."""
        ...

    def __len__(self) -> int:
        """The vocabulary's size, added tokens included."""
        ...

    def __call__(self, text: str, /, *, add_special_tokens: bool = True
                 ) -> Mapping[str, list[int]]:
        """``encode`` as a batch: ``["input_ids"]`` holds the token ids."""
        ...

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        ...

    def save_pretrained(self, save_directory: StrPath, /) -> tuple[str, ...]:
        """Write the tokenizer's files into ``save_directory``."""
        ...


@runtime_checkable
class Offloadable(Protocol):
    """A trainer whose device state (weights, grads, optimizer) can leave the GPU while a
    colocated engine generates, and come back. A group returns one dict per rank."""

    def offload(self) -> object: ...

    def onload(self) -> object: ...


@runtime_checkable
class MemoryReporting(Protocol):
    """A trainer that reports its device memory (``allocated_gib``, ``peak_gib``; a group: one
    dict per rank)."""

    def memory(self) -> Mapping[str, float] | list[dict[str, float]]: ...


@runtime_checkable
class Closeable(Protocol):
    """Releases its resources (processes, actors, files); safe to call twice."""

    def close(self) -> None: ...


def trains_adapter(backend: object) -> bool:
    """Whether ``backend`` trains a LoRA adapter now (an `AdapterTrainer` with ``lora`` set)."""
    return isinstance(backend, AdapterTrainer) and backend.lora is not None


__all__ = ["AdapterSettings", "AdapterTrainer", "ChatTool", "Closeable", "MemoryReporting", "Observation", "Offloadable",
           "RolloutEnv", "StrPath", "Tokenizer", "TrainerBackend", "WeightSource",
           "trains_adapter"]
