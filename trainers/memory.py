"""Memory of a trainer on its accelerator: what ``offload`` moves and what the GPU holds.

Read by the colocated phases of a run (`palaestra.run.fleet.colocate`) and by each trainer rank of a
trainer group (`palaestra.trainers.group.actor`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GIB = 1024**3


def gpu_memory(device: torch.device | str | None = None) -> dict[str, float]:
    """GPU memory of this process on ``device`` (GiB): allocated, reserved, peak (0 on CPU)."""
    import torch

    if not torch.cuda.is_available() or (device is not None
                                         and torch.device(device).type != "cuda"):
        return {"allocated_gib": 0.0, "reserved_gib": 0.0, "peak_gib": 0.0}
    return {"allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            "reserved_gib": torch.cuda.memory_reserved(device) / GIB,
            "peak_gib": torch.cuda.max_memory_allocated(device) / GIB}


def _tensors_of(backend: object) -> list[torch.Tensor]:
    import torch

    out: list[torch.Tensor] = []
    for model in (getattr(backend, "model", None), getattr(backend, "ref_model", None)):
        if isinstance(model, torch.nn.Module):
            for p in model.parameters():
                out.append(p.data)
                if p.grad is not None:
                    out.append(p.grad)
    state = getattr(getattr(backend, "optimizer", None), "state", None)
    if isinstance(state, dict):
        for entry in state.values():
            if isinstance(entry, dict):
                out += [v for v in entry.values() if isinstance(v, torch.Tensor) and v.dim()]
    return out


def device_state_bytes(backend: object) -> int:
    """Bytes of the backend's parameters, gradients and optimizer state on an accelerator
    (what ``offload`` moves to host memory; 0 on CPU)."""
    seen = {t.data_ptr(): t.numel() * t.element_size()
            for t in _tensors_of(backend) if t.device.type != "cpu"}
    return sum(seen.values())


__all__ = ["GIB", "device_state_bytes", "gpu_memory"]
