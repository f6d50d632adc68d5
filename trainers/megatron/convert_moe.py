"""Mixture-of-experts parts of the HF <-> Megatron conversion: router, routed and shared experts.

Megatron names (inside ``decoder.layers.{i}.``): ``mlp.router.weight`` and, per expert j local to
the expert-parallel rank, ``mlp.experts.local_experts.{j}.linear_fc{1,2}.weight`` (SequentialMLP,
the local spec) or ``mlp.experts.linear_fc{1,2}.weight{j}`` (grouped GEMM, the TE spec), with
``fc1 = [gate; up]``. HF checkpoint names: ``mlp.gate.weight`` and
``mlp.experts.{j}.{gate,up,down}_proj.weight``. DeepSeek-V3 adds the router's expert bias
(``mlp.router.expert_bias`` = ``mlp.gate.e_score_correction_bias``, a float32 buffer on both
sides) and a shared expert (``mlp.shared_experts.linear_fc{1,2}`` =
``mlp.shared_experts.{gate,up,down}_proj``). transformers >= 5 keeps experts in memory as fused
``mlp.experts.gate_up_proj [E, 2F, H]`` and ``mlp.experts.down_proj [E, H, F]``; `unfuse_hf_experts`
and `fuse_hf_experts` translate between the two HF layouts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from palaestra.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from palaestra.trainers.megatron.arch import ModelArch

_SEQ_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")
_FUSED_HF = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def mcore_moe_param_to_hf(
    rest: str, tensor: torch.Tensor, hf_prefix: str, expert_offset: int = 0
) -> list[tuple[str, torch.Tensor]] | None:
    """HF pairs for an MoE parameter named ``rest`` inside a layer, or None if not an MoE name."""
    if rest == "mlp.router.weight":
        return [(hf_prefix + "mlp.gate.weight", tensor)]
    if rest == "mlp.router.expert_bias":
        return [(hf_prefix + "mlp.gate.e_score_correction_bias", tensor)]
    if rest == "mlp.shared_experts.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(hf_prefix + "mlp.shared_experts.gate_proj.weight", gate),
                (hf_prefix + "mlp.shared_experts.up_proj.weight", up)]
    if rest == "mlp.shared_experts.linear_fc2.weight":
        return [(hf_prefix + "mlp.shared_experts.down_proj.weight", tensor)]
    match = _SEQ_EXPERT.match(rest)
    if match is not None:
        expert, fc = int(match.group(1)), match.group(2)
    else:
        match = _GROUPED_EXPERT.match(rest)
        if match is None:
            return None
        fc, expert = match.group(1), int(match.group(2))
    base = f"{hf_prefix}mlp.experts.{expert + expert_offset}."
    if fc == "1":
        gate, up = tensor.chunk(2, dim=0)
        return [(base + "gate_proj.weight", gate), (base + "up_proj.weight", up)]
    return [(base + "down_proj.weight", tensor)]


def expert_param_name(expert: int, fc: int, grouped: bool) -> str:
    """Megatron in-layer name of a local expert's fc1/fc2 weight."""
    if grouped:
        return f"mlp.experts.linear_fc{fc}.weight{expert}"
    return f"mlp.experts.local_experts.{expert}.linear_fc{fc}.weight"


def hf_moe_layer_to_mcore(
    take: Callable[[str], torch.Tensor], arch: ModelArch, layer: int, grouped: bool
) -> dict[str, torch.Tensor]:
    """Megatron tensors of one MoE layer's router and experts, read through ``take(hf_name)``."""
    import torch

    assert arch.moe is not None
    pre, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}.mlp."
    out = {pre + "mlp.router.weight": take(hf + "gate.weight")}
    if arch.moe.expert_bias:
        out[pre + "mlp.router.expert_bias"] = take(hf + "gate.e_score_correction_bias")
    if arch.moe.shared_expert_ffn:
        shared = hf + "shared_experts."
        out[pre + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [take(shared + "gate_proj.weight"), take(shared + "up_proj.weight")], dim=0
        )
        out[pre + "mlp.shared_experts.linear_fc2.weight"] = take(shared + "down_proj.weight")
    for j in range(arch.moe.num_experts):
        e = f"{hf}experts.{j}."
        out[pre + expert_param_name(j, 1, grouped)] = torch.cat(
            [take(e + "gate_proj.weight"), take(e + "up_proj.weight")], dim=0
        )
        out[pre + expert_param_name(j, 2, grouped)] = take(e + "down_proj.weight")
    return out


def unfuse_hf_experts(
    hf_sd: Mapping[str, torch.Tensor], arch: ModelArch
) -> dict[str, torch.Tensor]:
    """transformers-5 fused expert tensors -> checkpoint layout (one tensor per expert)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_sd.items():
        match = _FUSED_HF.match(name)
        if match is None:
            out[name] = tensor
            continue
        layer, kind = match.group(1), match.group(2)
        base = f"model.layers.{layer}.mlp.experts."
        if arch.moe is None or tensor.shape[0] != arch.moe.num_experts:
            raise ConfigError(f"{name} has {tensor.shape[0]} experts, the config says otherwise")
        for j in range(tensor.shape[0]):
            if kind == "gate_up_proj":
                gate, up = tensor[j].chunk(2, dim=0)
                out[f"{base}{j}.gate_proj.weight"] = gate
                out[f"{base}{j}.up_proj.weight"] = up
            else:
                out[f"{base}{j}.down_proj.weight"] = tensor[j]
    return out


def fuse_hf_experts(hf_sd: Mapping[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """Checkpoint-layout experts -> transformers-5 fused tensors (the in-memory HF layout)."""
    import torch

    if arch.moe is None:
        return dict(hf_sd)
    out = {k: v for k, v in hf_sd.items() if ".mlp.experts." not in k}
    for layer in range(arch.num_layers):
        if not arch.is_moe_layer(layer):
            continue
        base = f"model.layers.{layer}.mlp.experts."
        experts = range(arch.moe.num_experts)
        out[base + "gate_up_proj"] = torch.stack([
            torch.cat([hf_sd[f"{base}{j}.gate_proj.weight"], hf_sd[f"{base}{j}.up_proj.weight"]])
            for j in experts
        ])
        out[base + "down_proj"] = torch.stack(
            [hf_sd[f"{base}{j}.down_proj.weight"] for j in experts]
        )
    return out
