"""`DiskWeightSender`: weight versions written as safetensors folders that servers load with
``/update_weights_from_disk`` (the servers must see this machine's disk)."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from palaestra.engines.weights.weight_transfer import Bucket, TransferStats, _Seen, _synchronize
from palaestra.errors import ConfigError

if TYPE_CHECKING:

    from palaestra.engines.clients.sglang_client import SGLangClient


# files a model folder needs besides its weights (SGLang's /update_weights_from_disk loads a
# whole model folder; palaestra serve reads the safetensors only)
_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


class DiskWeightSender:
    """Write each version as a model folder under ``directory``; servers load it from there.

    ``model_dir`` supplies config/tokenizer files so the folder is a loadable model (SGLang
    needs them). ``keep_last`` versions stay on disk.
    """

    def __init__(self, clients: Sequence[SGLangClient], directory: str | Path, *,
                 model_dir: str | Path | None = None, keep_last: int = 2) -> None:
        if not clients:
            raise ConfigError("DiskWeightSender needs at least one server")
        self.clients = list(clients)
        self.directory = Path(directory)
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.keep_last = max(1, keep_last)

    async def connect(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    async def push(self, buckets: Iterable[Bucket], version: int) -> TransferStats:
        _synchronize()
        start = time.perf_counter()
        target = self.directory / f"v{version}"
        nbytes, ntensors, nbuckets = await asyncio.to_thread(self._write, buckets, target)
        await asyncio.gather(*(c.update_weights(path=str(target), version=version)
                               for c in self.clients))
        self._prune(version)
        return TransferStats(time.perf_counter() - start, nbytes, ntensors, nbuckets)

    def _write(self, buckets: Iterable[Bucket], target: Path) -> tuple[int, int, int]:
        from safetensors.torch import save_file

        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        nbytes = ntensors = nbuckets = 0
        seen = _Seen()  # tied weights (lm_head = embeddings) are written once
        for i, bucket in enumerate(buckets):
            tensors = {n: t.detach().cpu().contiguous() for n, t in seen.new(bucket)}
            if not tensors:
                continue
            save_file(tensors, str(partial / f"model-{i:05d}.safetensors"), metadata={"format": "pt"})
            nbuckets += 1
            ntensors += len(tensors)
            nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if self.model_dir is not None:
            for name in _MODEL_FILES:
                if (self.model_dir / name).is_file():
                    shutil.copy2(self.model_dir / name, partial / name)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)  # servers never see a half-written version
        return nbytes, ntensors, nbuckets

    def _prune(self, version: int) -> None:
        versions = sorted(int(p.name[1:]) for p in self.directory.glob("v*")
                          if p.is_dir() and p.name[1:].isdigit())
        for old in versions[:-self.keep_last]:
            if old != version:
                shutil.rmtree(self.directory / f"v{old}", ignore_errors=True)

    async def close(self) -> None:
        return None


__all__ = ["DiskWeightSender"]
