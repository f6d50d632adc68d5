"""The tensors of a Hugging Face checkpoint on disk: its safetensors files (sharded or not),
read one tensor at a time."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from palaestra.errors import EngineError

if TYPE_CHECKING:
    import torch


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (sharded or not), or the file itself."""
    path = Path(path)
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors files in {path}; save the model with safetensors")
    return files


def tensor_names(files: list[Path]) -> Iterator[tuple[str, Path]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, f


def iter_safetensors(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of safetensors files, one tensor in memory at a time."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


__all__ = ["iter_safetensors", "safetensors_files", "tensor_names"]
