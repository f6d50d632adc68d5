"""``trainer.on_policy``: what bitwise on-policy mode needs of the rest of a run.

In bitwise mode the embedded engine and the torch backend run the same batch-invariant forward
(`palaestra.engines.bitwise.forward`), so each sampled token's trainer logprob has the bits
the engine reported (``rollout/logprob_max_abs_diff == 0.0`` every step). That holds only where
both forwards are ours and read the same numbers: `on_policy_problems` refuses, before any work,
the settings where they would not be (SGLang or launched servers, Ray engine actors, Megatron,
LoRA dropout, MoE, a trainer dtype other than the engine's, top-p filtering, different devices).
A LoRA adapter is merged into the weights the same way on both sides
(`palaestra.engines.local.lora.merged_weight`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from palaestra.config import Problem

if TYPE_CHECKING:
    from palaestra.run.sections import RunSettings

#: model types the bitwise forward covers (dense Llama-family layers)
BITWISE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def bitwise(cfg: RunSettings) -> bool:
    """Whether the run trains in bitwise on-policy mode."""
    return cfg.trainer.on_policy == "bitwise"


def on_policy_problems(cfg: RunSettings) -> list[Problem]:
    """Why ``trainer.on_policy = "bitwise"`` cannot hold in this run (empty otherwise)."""
    if not bitwise(cfg) and cfg.trainer.torch.on_policy == "default":
        return []
    key = "trainer.on_policy"
    out: list[Problem] = []

    def refuse(field: str, why: str) -> None:
        out.append(Problem((field, key), f"trainer.on_policy = 'bitwise': {why}"))

    if cfg.engine.kind != "local" or cfg.placement is not None:
        refuse("engine.kind", "needs the embedded engine in the trainer's process (its forward "
               "is the trainer's): set engine.kind = 'local' and drop [placement], or use "
               "trainer.on_policy = 'default' with servers (the logprob gap is then measured)")
    if cfg.trainer.backend != "torch":
        refuse("trainer.backend", "runs on the torch backend (Megatron's kernels are not the "
               "engine's): set --trainer.backend torch")
    torch_cfg = cfg.trainer.torch
    if torch_cfg.lora is not None and torch_cfg.lora.dropout > 0:
        refuse("trainer.torch.lora.dropout", "the adapter is merged into the weights on both "
               "sides, where dropout cannot apply: set trainer.torch.lora.dropout = 0")
    if torch_cfg.dtype != "auto":
        refuse("trainer.torch.dtype", "the trainer computes in the engine's dtype (float32 on "
               "CPU, bfloat16 on CUDA): leave trainer.torch.dtype = 'auto'")
    engine_device = (cfg.engine.device or "auto").split(":")[0]
    trainer_device = torch_cfg.device.split(":")[0]
    if engine_device != trainer_device:  # "auto" on one side only could resolve to another
        refuse("engine.device", f"the engine ({cfg.engine.device or 'auto'}) and the trainer "
               f"({torch_cfg.device}) must run on one kind of device: set engine.device and "
               "trainer.torch.device alike (both 'cpu', both 'cuda', or both left to auto)")
    if cfg.engine.weight_sync.dtype is not None:
        refuse("engine.weight_sync.dtype", "the engine must hold the weights the trainer "
               "reads, cast only to the engine's own dtype: remove engine.weight_sync.dtype")
    if torch_cfg.on_policy != cfg.trainer.on_policy:
        refuse("trainer.torch.on_policy", "set trainer.on_policy (it sets the engine's mode "
               "and trainer.torch.on_policy together), not trainer.torch.on_policy alone")
    if cfg.rollout.top_p < 1.0:
        refuse("rollout.top_p", "top-p sampling draws from a truncated distribution whose "
               "logprobs are not the trained ones: set rollout.top_p = 1.0")
    if cfg.trainer.routing_replay != "off":
        refuse("trainer.routing_replay", "MoE models are not covered")
    from palaestra.tiny_model import MOE_SIZES

    size = cfg.model.init_size
    if size is not None and size in MOE_SIZES:
        refuse("model.init_size", f"{size!r} is a MoE model; bitwise mode covers dense "
               f"{', '.join(BITWISE_MODEL_TYPES)} models")
    config_json = cfg.in_run(cfg.model.path) / "config.json"
    if size is None and config_json.is_file():
        model_type = json.loads(config_json.read_text()).get("model_type")
        if model_type not in BITWISE_MODEL_TYPES:
            refuse("model.path", f"the model is a {model_type!r}; bitwise mode covers "
                   f"{', '.join(BITWISE_MODEL_TYPES)} models")
    return out


__all__ = ["BITWISE_MODEL_TYPES", "bitwise", "on_policy_problems"]
