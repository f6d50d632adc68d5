"""Checkpoints of the torch backend and Hugging Face export.

A checkpoint directory holds (written by rank 0 unless noted)::

    model.safetensors      full (unsharded) weights, Hugging Face names, tied copies dropped
    optimizer.pt           full AdamW state keyed by parameter name (world-size independent)
    scheduler.pt           LambdaLR state (its step count)
    rng_<rank>.pt          python/numpy/torch/CUDA RNG states (every rank)
    backend_state.json     step, config and format version, written last: its presence marks
                           the checkpoint complete

Full state dicts make a checkpoint loadable on any world size; ``torch.distributed.checkpoint``
helpers gather them from FSDP2 shards and broadcast them back.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any, cast

import torch

from palaestra.errors import CheckpointError
from palaestra.trainers.torch_backend.distributed import DistInfo, barrier

FORMAT_VERSION = 1
STATE_FILE = "backend_state.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def tied_keys(model: torch.nn.Module) -> set[str]:
    """Parameter names that are copies of another parameter (tied embeddings)."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    keys = getattr(model, "_tied_weights_keys", None) or ()
    return set(keys.keys() if isinstance(keys, dict) else keys)


def full_state_dict(model: torch.nn.Module, info: DistInfo) -> dict[str, torch.Tensor]:
    """Unsharded weights on CPU with Hugging Face names (a collective under FSDP2).

    Under FSDP2 only rank 0 receives the tensors; other ranks get an empty dict.
    """
    if not info.is_distributed:
        return {k: v.detach() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return cast("dict[str, torch.Tensor]", full)  # a model's state dict holds tensors only


def _without_tied(sd: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    drop = tied_keys(model)
    return {k: v.detach().cpu().contiguous() for k, v in sd.items() if k not in drop}


def _rng_state() -> dict[str, Any]:
    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(np.asarray(keys).copy()), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def save_checkpoint(
    directory: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    info: DistInfo,
    extra: dict[str, Any] | None = None,
    trainable_only: bool = False,
) -> Path:
    """Write a complete checkpoint to ``directory`` (every rank must call it).

    ``trainable_only`` (LoRA): ``model.safetensors`` holds only the parameters that require
    gradients (the adapter), not the frozen base the run was started from."""
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / STATE_FILE).unlink(missing_ok=True)
    weights = full_state_dict(model, info)
    if trainable_only:
        weights = {k: v for k, v in weights.items() if k in _trainable_names(model)}
    optim_state = _optimizer_state(model, optimizer)
    if info.is_main:
        save_file(_without_tied(weights, model), str(path / "model.safetensors"))
        torch.save(optim_state, path / "optimizer.pt")
        torch.save(scheduler.state_dict(), path / "scheduler.pt")
    torch.save(_rng_state(), path / f"rng_{info.rank}.pt")
    barrier(info)
    if info.is_main:
        state = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": info.world_size,
            **(extra or {}),
        }
        tmp = path / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2, default=str))
        tmp.replace(path / STATE_FILE)
    barrier(info)
    return path


def read_state(directory: str | Path) -> dict[str, Any]:
    """The ``backend_state.json`` of a complete checkpoint, or a CheckpointError."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{directory} is not a complete backend checkpoint (no {STATE_FILE}); it was "
            "interrupted while saving or is not a checkpoint: resume from an earlier one"
        )
    state = json.loads(path.read_text())
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint format {state.get('format_version')} in {directory} is not supported "
            f"(expected {FORMAT_VERSION})"
        )
    return state


def load_checkpoint(
    directory: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    info: DistInfo,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG; returns the saved state dict (step...).

    ``trainable_only``: the checkpoint holds exactly the trainable parameters (LoRA's)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(directory)
    state = read_state(path)
    weights: dict[str, Any] = load_file(str(path / "model.safetensors")) if info.is_main else {}
    optim_state = torch.load(path / "optimizer.pt", weights_only=True) if info.is_main else {}
    if info.is_distributed:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(model, weights, options=options)
        set_optimizer_state_dict(model, optimizer, optim_state, options=options)
    else:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if trainable_only:
            missing = [k for k in _trainable_names(model) if k not in weights]
        bad = (set(missing) - tied_keys(model)) | set(unexpected)
        if bad:
            raise CheckpointError(
                f"checkpoint {path} does not match the model: {sorted(bad)[:5]} differ; load it "
                "with the model_path it was trained from"
            )
        tie = getattr(model, "tie_weights", None)  # a Hugging Face model's
        if tie is not None:
            tie()
        set_optimizer_state_dict(
            model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True)
        )
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng_file = path / f"rng_{info.rank}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return state


def export_hf(
    directory: str | Path,
    *,
    model: torch.nn.Module,
    info: DistInfo,
    source_path: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Save a ``from_pretrained``-loadable model (safetensors) plus the source's tokenizer."""
    path = Path(directory)
    weights = full_state_dict(model, info)
    if info.is_main:
        path.mkdir(parents=True, exist_ok=True)
        sd = _without_tied(weights, model)
        if dtype is not None:
            sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        save = getattr(model, "save_pretrained")  # noqa: B009 - a Hugging Face model's, not Module's
        save(str(path), state_dict=sd)
        _fix_config_dtype(path, next(iter(sd.values())).dtype if sd else None)
        if source_path is not None:
            for name in TOKENIZER_FILES:
                src = Path(source_path) / name
                if src.is_file() and not (path / name).exists():
                    shutil.copy2(src, path / name)
    barrier(info)
    return path


def _trainable_names(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def export_state_dict(directory: str | Path, state: dict[str, torch.Tensor], *,
                      model: torch.nn.Module, source_path: str | Path | None = None) -> Path:
    """Save ``state`` (Hugging Face names, e.g. LoRA-merged weights) as a ``from_pretrained``
    folder with ``model``'s config and the source's tokenizer (one process)."""
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    drop = tied_keys(model)
    sd = {k: v.contiguous() for k, v in state.items() if k not in drop}
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    getattr(model, "config").save_pretrained(str(path))  # noqa: B009 - a HF model's config
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(path))
    _fix_config_dtype(path, next(iter(sd.values())).dtype if sd else None)
    if source_path is not None:
        for name in TOKENIZER_FILES:
            src = Path(source_path) / name
            if src.is_file() and not (path / name).exists():
                shutil.copy2(src, path / name)
    return path


def _fix_config_dtype(path: Path, dtype: torch.dtype | None) -> None:
    """Make config.json name the dtype the tensors were saved in (fp32 training, bf16 source)."""
    config_file = path / "config.json"
    if dtype is None or not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = name
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


__all__ = [
    "STATE_FILE",
    "export_hf",
    "export_state_dict",
    "full_state_dict",
    "load_checkpoint",
    "read_state",
    "save_checkpoint",
    "tied_keys",
]
