"""Optional Triton kernels from ``liger-kernel`` (``pip install 'palaestra[liger]'``), CUDA only.

- `apply_liger_kernels`: Liger's RMSNorm, RoPE and SwiGLU in place of a loaded Hugging Face
  model's modules (its ``apply_liger_kernel_to_<model_type>(model=...)``). Liger also swaps the
  architecture's module-level classes and ``apply_rotary_pos_emb``, which would hand its Triton
  kernels to every later model of that type in the process, CPU ones included: the classes are
  put back at once (the patched model keeps its patched instances), and the RoPE function (looked
  up at call time, so it cannot be per instance) becomes a dispatcher that takes Liger's kernel
  for CUDA tensors only. Its loss patches stay off: the trainer computes logprobs itself.
- `liger_linear_logprobs`: token logprobs through Liger's fused linear cross entropy
  (``reduction="none"``; its backward recomputes the chunked logits). It has no entropy output,
  so with the entropy metric it needs a second pass and measured slower than
  `fused_logprobs` (H200, 16k tokens: 164 vs 114 ms): the backend does not use it, the
  benchmark ``benchmarks/perf/logprobs.py`` compares it.
- `resolve_kernels`: the ``trainer.torch.kernels`` setting resolved for a device.

Nothing here imports liger (or triton) at module level.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from palaestra.errors import ConfigError

#: architectures whose Liger patch this backend uses (all have RMSNorm + RoPE + SwiGLU MLPs)
LIGER_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"})
#: the ones ``kernels = "auto"`` patches: dense models, where Liger was measured (MoE blocks
#: are left to the routing-replay hooks)
LIGER_AUTO_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

KernelChoice = Literal["auto", "torch", "liger"]


def liger_installed() -> bool:
    """True when ``liger_kernel`` and ``triton`` can be imported."""
    return all(importlib.util.find_spec(m) is not None for m in ("liger_kernel", "triton"))


def resolve_kernels(choice: KernelChoice, device: torch.device, model_type: str | None) -> str:
    """"liger" or "torch" for this device and architecture.

    "auto": "liger" on CUDA where liger-kernel is installed and the model is a dense one of
    `LIGER_AUTO_MODEL_TYPES` (H200, Qwen3-0.6B shape, 32k tokens: train step 0.87 -> 0.67 s,
    logprobs within bf16 noise: ``benchmarks/perf/logprobs.py``), else "torch". "liger" asks
    for them and fails with the fix when they cannot run here.
    """
    if choice == "torch":
        return "torch"
    if choice == "auto":
        usable = device.type == "cuda" and model_type in LIGER_AUTO_MODEL_TYPES
        return "liger" if usable and liger_installed() else "torch"
    if device.type != "cuda":
        raise ConfigError("trainer.torch.kernels = 'liger' runs Triton kernels on CUDA only; "
                          "use kernels = 'auto' or 'torch' on this device")
    if not liger_installed():
        raise ConfigError("trainer.torch.kernels = 'liger' needs liger-kernel: "
                          "pip install 'palaestra[liger]' (or kernels = 'auto')")
    if model_type not in LIGER_MODEL_TYPES:
        raise ConfigError(f"trainer.torch.kernels = 'liger' has no patch for model type "
                          f"{model_type!r} here (supported: {sorted(LIGER_MODEL_TYPES)}); use "
                          "kernels = 'auto'")
    return "liger"


def apply_liger_kernels(model: torch.nn.Module) -> None:
    """Swap in Liger's RMSNorm, RoPE and SwiGLU on ``model`` (a loaded HF causal LM)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in LIGER_MODEL_TYPES:
        raise ConfigError(f"no Liger patch for model type {model_type!r}")
    liger = importlib.import_module("liger_kernel.transformers")
    apply = getattr(liger, f"apply_liger_kernel_to_{model_type}")
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    before = dict(vars(modeling))
    apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
          fused_linear_cross_entropy=False, model=model)
    liger_rope = getattr(modeling, "apply_rotary_pos_emb")  # noqa: B009 - set by Liger
    for name, value in before.items():  # undo the module-level swaps (see the docstring)
        if vars(modeling).get(name) is not value:
            setattr(modeling, name, value)
    original = before["apply_rotary_pos_emb"]
    if not getattr(original, "_palaestra_liger_dispatch", False):
        setattr(modeling, "apply_rotary_pos_emb", _cuda_dispatch(original, liger_rope))  # noqa: B010


def _cuda_dispatch(original: Any, cuda_fn: Any) -> Any:
    """``apply_rotary_pos_emb`` that runs ``cuda_fn`` on CUDA tensors, ``original`` elsewhere."""

    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        fn = cuda_fn if q.is_cuda else original
        return fn(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._palaestra_liger_dispatch = True  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def liger_linear_logprobs(
    hidden_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor,
    *, temperature: float = 1.0,
) -> torch.Tensor:
    """``log softmax(h W^T / T)[target]`` per row (float32) by Liger's fused linear CE.

    The temperature scales the hidden states (the head has no bias), so the matmul sees
    ``h / T``; under autocast both operands are cast to the autocast dtype first.
    """
    functional = importlib.import_module("liger_kernel.transformers.functional")
    device_type = hidden_NH.device.type
    dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
             else hidden_NH.dtype)
    h = hidden_NH if temperature == 1.0 else hidden_NH / temperature
    with torch.autocast(device_type, enabled=False):
        loss = functional.liger_fused_linear_cross_entropy(
            h.to(dtype), weight_VH.to(dtype), targets_N.long(), reduction="none",
            accum_dtype=torch.float32)
    return -loss.float()




#: Instruction sets a process can be held to (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``)
#: that have no bf16 arithmetic: held there, torch emulates bf16 matmuls (tens of times slower
#: than float32), as a CPU without AVX512-BF16/AMX would never be asked to.
_HELD_WITHOUT_BF16 = {"default", "sse41", "avx", "avx2", "avx2_vnni", "avx512", "avx512_core",
                      "avx512_core_vnni"}


def _held_below_bf16(environ: Mapping[str, str]) -> str | None:
    """The variable that holds this process to an instruction set without bf16, if any."""
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        if environ.get(name, "").strip().lower() in _HELD_WITHOUT_BF16:
            return name
    return None


def cpu_has_bf16(environ: Mapping[str, str] | None = None) -> bool:
    """True when this CPU advertises AVX512-BF16 or AMX-BF16 (Linux ``/proc/cpuinfo``) and the
    process is not held to an instruction set without them (``ATEN_CPU_CAPABILITY=avx2`` or
    ``ONEDNN_MAX_CPU_ISA=AVX2``, as `scripts/test.sh`'s AVX2 pass and docs/results.md's AVX2 runs
    hold it): a held process then chooses what a CPU without bf16 would."""
    if _held_below_bf16(os.environ if environ is None else environ) is not None:
        return False
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


#: ``cpu_autocast = "auto"`` turns bf16 on from this hidden size up (measured side by side:
#: ``benchmarks/perf/logprobs.py --cpu-autocast``)
CPU_BF16_MIN_HIDDEN = 256


def cpu_autocast_dtype(choice: str, model_path: Path) -> torch.dtype:
    """The CPU compute dtype for ``trainer.torch.cpu_autocast`` and the model at ``model_path``."""
    if choice == "off":
        return torch.float32
    if choice == "bf16":
        return torch.bfloat16
    if not cpu_has_bf16():
        return torch.float32
    try:
        hidden = int(json.loads((model_path / "config.json").read_text()).get("hidden_size", 0))
    except (OSError, ValueError, TypeError):
        return torch.float32
    return torch.bfloat16 if hidden >= CPU_BF16_MIN_HIDDEN else torch.float32


__all__ = ["CPU_BF16_MIN_HIDDEN", "LIGER_AUTO_MODEL_TYPES", "LIGER_MODEL_TYPES",
           "apply_liger_kernels", "cpu_autocast_dtype", "cpu_has_bf16", "liger_installed",
           "liger_linear_logprobs", "resolve_kernels"]
