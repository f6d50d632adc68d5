"""The decoder class of a checkpoint: `Decoder` (Qwen/Llama layouts, MoE included) or, for
DeepSeek-V3 (``model_type = "deepseek_v3"``: MLA attention), `MLADecoder`.

`load_decoder` (a Hugging Face checkpoint directory) and `decoder_from_hf_model` (an in-memory
transformers model) read the config's ``model_type`` and build the class that owns that layout;
`palaestra.engines.local.model` and `palaestra.engines.local.deepseek` never import each other's
callers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.engines.local.deepseek import MLADecoder
from palaestra.engines.local.model import Decoder

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    Device = str | torch.device | None
    DType = str | torch.dtype | None


def _decoder_class(hf_config: Any) -> type[Decoder]:
    return MLADecoder if getattr(hf_config, "model_type", "") == "deepseek_v3" else Decoder


def load_decoder(path: str | Path, device: Device, dtype: DType) -> Decoder:
    """The decoder of the Hugging Face checkpoint directory ``path`` (its class by model type)."""
    from transformers import AutoConfig

    config_file = Path(path) / "config.json"
    if not config_file.is_file():  # Decoder.from_pretrained says what to pass instead
        return Decoder.from_pretrained(path, device, dtype)
    return _decoder_class(AutoConfig.from_pretrained(path)).from_pretrained(path, device, dtype)


def decoder_from_hf_model(hf_model: PreTrainedModel, device: Device = None,
                          dtype: DType = None) -> Decoder:
    """The decoder of an in-memory transformers model (weights copied; its class by model type)."""
    return _decoder_class(hf_model.config).from_hf_model(hf_model, device, dtype)


__all__ = ["decoder_from_hf_model", "load_decoder"]
