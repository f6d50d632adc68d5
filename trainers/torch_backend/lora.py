"""LoRA on the torch backend through ``peft``: settings, wrapping, adapter export, merged weights.

``[trainer.torch.lora]`` wraps the policy in a ``peft`` LoRA model: only the adapter's A/B
matrices require gradients (so only they sit in the optimizer), the reference logprobs for KL
come from the same model with the adapter disabled (no second copy), checkpoints hold the
adapter and its optimizer state, and the engines receive the adapter only
(`adapter_for_engines`): a few megabytes instead of the whole model.

`LoraSettings` is torch-free (pydantic) so configs validate before torch is imported; the
functions import torch/peft when called.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from palaestra.errors import ConfigError

if TYPE_CHECKING:
    import torch

#: the linear layers of a Llama-family decoder block: what "all-linear" means to the engine too
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: `peft`'s prefix of a wrapped causal LM's state-dict names
PEFT_PREFIX = "base_model.model."


class LoraSettings(BaseModel):
    """``[trainer.torch.lora]``: a LoRA adapter trained instead of the full weights."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    rank: int = Field(16, gt=0)
    """``r``: the rank of each low-rank update ``B @ A``."""

    alpha: float = Field(32.0, gt=0.0)
    """``lora_alpha``: the update is scaled by ``alpha / rank``."""

    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training (0 keeps training deterministic)."""

    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """"all-linear" (every projection of the decoder blocks, not lm_head) or module names among
    q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj."""

    adapter_name: str = Field("policy", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """The name the engines serve the trained adapter under (``lora_path`` in /generate)."""

    export_merged: bool = True
    """At the end of a run also write ``final-model`` with the adapter merged (what
    `palaestra eval` and plain transformers load); the adapter folder is always written."""

    @model_validator(mode="after")
    def _known_targets(self) -> LoraSettings:
        self.targets()  # refused when the config loads, not when the backend starts
        return self

    def targets(self) -> list[str]:
        """The module names handed to peft (checked against the ones the engine can run)."""
        if self.target_modules == "all-linear":
            return list(LINEAR_MODULES)
        bad = [m for m in self.target_modules if m not in LINEAR_MODULES]
        if bad or not self.target_modules:
            raise ConfigError(
                f"trainer.torch.lora.target_modules {bad or '[]'}: name modules among "
                f"{', '.join(LINEAR_MODULES)} or use \"all-linear\"")
        return list(self.target_modules)


def _require_peft() -> Any:
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("trainer.torch.lora needs the peft package: pip install "
                          "'palaestra[lora]' (or pip install peft)") from exc
    return peft


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> Any:
    """``model`` wrapped in a peft LoRA model: base weights frozen, the adapter trainable."""
    peft = _require_peft()
    config = peft.LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=settings.targets(), bias="none", task_type="CAUSAL_LM",
    )
    wrapped = peft.get_peft_model(model, config)
    if not any(p.requires_grad for p in wrapped.parameters()):
        raise ConfigError("trainer.torch.lora matched no module of this model: check "
                          "target_modules against the model's layer names")
    return wrapped


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a peft-wrapped model."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (``...q_proj.lora_A.weight``), snapshot."""
    peft = _require_peft()
    state = peft.get_peft_model_state_dict(model)
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def adapter_config(model: Any) -> dict[str, Any]:
    """What an engine needs to scale the adapter: ``r``, ``lora_alpha``, ``use_rslora``,
    ``target_modules``, ``rank_pattern``/``alpha_pattern`` (peft's adapter_config.json names)."""
    cfg = model.peft_config["default"]
    return {"r": cfg.r, "lora_alpha": cfg.lora_alpha, "use_rslora": bool(cfg.use_rslora),
            "target_modules": sorted(cfg.target_modules), "rank_pattern": dict(cfg.rank_pattern),
            "alpha_pattern": dict(cfg.alpha_pattern)}


def merged_state_dict(model: Any, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The base model's weights with the adapter merged (``W + s B A``) under Hugging Face
    names, as a snapshot; the wrapped model is left unchanged."""

    base = model.get_base_model()
    out: dict[str, torch.Tensor] = {}
    deltas: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if lora_a is None or "default" not in lora_a:
            continue
        a = module.lora_A["default"].weight.detach().float()
        b = module.lora_B["default"].weight.detach().float()
        deltas[name + ".weight"] = (b @ a) * float(module.scaling["default"])
    copies: dict[int, torch.Tensor] = {}
    for key, tensor in base.state_dict().items():
        if ".lora_" in key:
            continue
        name = key.replace(".base_layer.", ".")
        ptr = tensor.data_ptr()
        if ptr in copies and name not in deltas:  # tied embeddings stay shared
            out[name] = copies[ptr]
            continue
        t = tensor.detach()
        if name in deltas:
            t = (t.float() + deltas[name].to(t.device)).to(t.dtype)
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        copies[ptr] = out[name] = t.to(device="cpu", dtype=target, copy=True)
    return out


def save_adapter(model: Any, directory: str | Path) -> Path:
    """A peft adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    return path


__all__ = ["LINEAR_MODULES", "PEFT_PREFIX", "LoraSettings", "adapter_config", "adapter_state",
           "apply_lora", "is_lora", "merged_state_dict", "save_adapter"]
