"""Whether Triton kernels can run on a device type: CUDA with Triton importable (the engine's
split-KV decode attention and the batch-invariant kernels both ask)."""

from __future__ import annotations

import functools


@functools.cache
def available(device_type: str) -> bool:
    """Whether the Triton path can run on ``device_type`` (CUDA with Triton importable)."""
    if device_type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["available"]
