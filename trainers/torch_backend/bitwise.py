"""The torch backend's forward in bitwise on-policy mode (``trainer.on_policy = "bitwise"``).

The policy's logprobs come from `palaestra.engines.bitwise.forward`, the forward the
embedded engine runs in the same mode, over the Hugging Face model's own parameters fused into
the engine's layout (q/k/v and gate/up concatenated, cast to the engine's dtype: the cast is the
one a weight push applies) and the engine's rotary tables. Each sampled token's logprob then has
the bits the engine reported when it sampled it, so ``rollout/logprob_max_abs_diff`` is 0.0 and
the first update's importance ratios are exactly 1. Autograd runs through all of it (the
concatenations, the casts and every batch-invariant operation), so training needs nothing else.

A peft LoRA policy is covered: each adapted projection's weight is ``W_base + s B A`` built by
`palaestra.engines.bitwise.lora_merge.merged_weight`, the function the engine merges the pushed adapter
with, on the same float32 matrices, so the merged weights have the engine's bits while autograd
carries the gradient to A and B (the base stays frozen). A disabled adapter (the KL reference)
leaves the base weights.

Not covered (refused when the run is configured, `palaestra.run.on_policy`, and by
`TorchBackend`): MoE layers, LoRA dropout (the engine cannot merge a random mask), FSDP sharding,
a critic. Liger's patched modules are bypassed (the forward reads the parameters, not the
modules).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from palaestra.engines.bitwise.forward import BitwiseWeights
    from palaestra.trainers.micro_batches import MicroBatch

#: sampled positions per chunk of the output layer + log-softmax; each chunk is recomputed in
#: the backward instead of keeping its float32 ``[rows, vocab]`` logits
HEAD_CHUNK = 1024


def fused_weights(model: torch.nn.Module, dtype: torch.dtype,
                  rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> BitwiseWeights:
    """The policy's parameters in the engine's fused layout, in ``dtype`` (differentiable);
    ``rope``: the (cos, signed sin) tables when the caller keeps them (else built here)."""
    import torch

    from palaestra.engines.bitwise.decoder_config import DecoderConfig, signed_rope_tables
    from palaestra.engines.bitwise.forward import BitwiseWeights, FusedLayer

    hf_config: Any = model.config
    config = DecoderConfig.from_hf(hf_config)
    if config.moe is not None:
        raise ConfigError("trainer.on_policy = 'bitwise' covers dense models, not MoE ones")
    inner: Any = model.get_decoder()  # type: ignore[operator]

    def fuse(*parts: torch.Tensor) -> torch.Tensor:  # cast first: no float32 temporary
        return torch.cat([t.to(dtype) for t in parts])

    def weight(proj: torch.nn.Module) -> torch.Tensor:
        """A projection's weight in ``dtype``, its active LoRA adapter merged."""
        lora = _active_lora(proj, dtype)
        base: torch.Tensor = proj.weight  # type: ignore[assignment]
        if lora is None:
            return base.to(dtype)
        from palaestra.engines.bitwise.lora_merge import merged_weight

        # the engine's base is the weight cast to its dtype; the merge sums in float32
        return merged_weight(base.to(dtype), *lora, invariant=True, dtype=dtype)

    layers = []
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_b = None
        if attn.q_proj.bias is not None:
            qkv_b = fuse(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        layers.append(FusedLayer(
            in_norm=layer.input_layernorm.weight.to(dtype),
            qkv_w=fuse(weight(attn.q_proj), weight(attn.k_proj), weight(attn.v_proj)),
            qkv_b=qkv_b,
            q_norm=None if q_norm is None else q_norm.weight.to(dtype),
            k_norm=None if k_norm is None else k_norm.weight.to(dtype),
            o_w=weight(attn.o_proj),
            post_norm=layer.post_attention_layernorm.weight.to(dtype),
            gate_up_w=fuse(weight(mlp.gate_proj), weight(mlp.up_proj)),
            down_w=weight(mlp.down_proj),
        ))
    embed = inner.embed_tokens.weight.to(dtype)
    head: Any = model.get_output_embeddings()  # type: ignore[operator]
    lm_head = embed if head.weight is inner.embed_tokens.weight else head.weight.to(dtype)
    cos, sin = rope or signed_rope_tables(hf_config, config, embed.device, dtype)
    return BitwiseWeights(config, embed, inner.norm.weight.to(dtype), lm_head, layers, cos, sin)


def _active_lora(proj: torch.nn.Module, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(A [r, in], s B [out, r])`` in float32 of a peft LoRA projection's active adapter, as
    the engine's `LoraAdapter` holds them: rounded to ``dtype`` first (an in-process adapter
    push casts the adapter to the engine's dtype, bfloat16 on CUDA), ``B`` times the scale.
    None for a plain projection, a disabled adapter, or one peft already merged into the base
    weight."""
    lora_a: Any = getattr(proj, "lora_A", None)
    if lora_a is None or getattr(proj, "disable_adapters", False) or getattr(proj, "merged",
                                                                              False):
        return None
    active = [name for name in getattr(proj, "active_adapters", ["default"]) if name in lora_a]
    if not active:
        return None
    if len(active) > 1:
        raise ConfigError("bitwise on-policy mode merges one active LoRA adapter, not "
                          f"{len(active)}: {active}")
    name = active[0]
    dropout: Any = dict(getattr(proj, "lora_dropout", {}).items()).get(name)  # a ModuleDict
    if dropout is not None and getattr(dropout, "p", 0.0) > 0 and proj.training:
        raise ConfigError("trainer.on_policy = 'bitwise' merges the adapter into the weights, "
                          "where dropout cannot apply: set trainer.torch.lora.dropout = 0")
    peft_layer: Any = proj
    lora_b, scale = peft_layer.lora_B, float(peft_layer.scaling[name])
    return (lora_a[name].weight.to(dtype).float(),
            lora_b[name].weight.to(dtype).float() * scale)


def _head(weights: BitwiseWeights, h: torch.Tensor, targets: torch.Tensor,
          temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of ``targets`` and (``with_entropy``, else an empty tensor) the entropy of each
    row's distribution, from one pass of the output layer and the invariant log-softmax."""
    import torch

    from palaestra.engines.bitwise import forward as bf
    from palaestra.engines.bitwise.invariant import divide_by_temperature, log_softmax

    t = temperature if temperature > 1e-6 else 1.0
    logp_all = log_softmax(divide_by_temperature(bf.logits(weights, h), t))
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, logp.new_zeros(0)
    return logp, -(torch.exp(logp_all) * logp_all).sum(-1)


class BitwiseForward:
    """The bitwise forward of one policy: its rotary tables, built once."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        from palaestra.engines.bitwise.decoder_config import DecoderConfig, signed_rope_tables

        self.dtype = dtype
        device = next(model.parameters()).device
        self.rope = signed_rope_tables(model.config, DecoderConfig.from_hf(model.config),
                                       device, dtype)

    def logprobs(self, model: torch.nn.Module, mb: MicroBatch, *, temperature: float,
                 with_entropy: bool, entropy_grad: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`policy_logprobs` of ``model`` with this forward's tables."""
        return policy_logprobs(model, mb, dtype=self.dtype, temperature=temperature,
                               with_entropy=with_entropy, entropy_grad=entropy_grad,
                               rope=self.rope)

    def full_logprobs(self, model: torch.nn.Module, mb: MicroBatch, flat_rows: torch.Tensor,
                      *, temperature: float) -> torch.Tensor:
        """`full_logprobs` of ``model`` with this forward's tables."""
        return full_logprobs(model, mb, flat_rows, dtype=self.dtype, temperature=temperature,
                             rope=self.rope)


def _hidden(model: torch.nn.Module, mb: MicroBatch, dtype: torch.dtype,
            rope: tuple[torch.Tensor, torch.Tensor] | None
            ) -> tuple[BitwiseWeights, torch.Tensor, torch.Tensor]:
    """The fused weights, the last hidden states ``[N, hidden]`` of a micro-batch's tokens,
    and the row of ``h`` of each ``[R * L]`` position of the micro-batch (-1 at padding)."""
    import torch

    from palaestra.engines.bitwise import forward as bf

    weights = fused_weights(model, dtype, rope)
    present = mb.seq_index >= 0
    seq = mb.seq_index[present]
    pos = mb.position_ids[present]
    store = bf.PackedStore(mb.num_sequences, int(pos.max()) + 1 if pos.numel() else 1)
    h = bf.hidden_states(weights, mb.input_ids[present], seq, pos, store)
    rows, width = mb.input_ids.shape
    flat = torch.nonzero(present.reshape(-1)).squeeze(1)  # where each computed token sits
    slot = torch.full((rows * width,), -1, dtype=torch.long, device=h.device)
    slot[flat] = torch.arange(flat.numel(), device=h.device)
    return weights, h, slot


def full_logprobs(model: torch.nn.Module, mb: MicroBatch, flat_rows: torch.Tensor, *,
                  dtype: torch.dtype, temperature: float,
                  rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Float32 ``log_softmax(logits / T)`` ``[P, V]`` of the hidden states at ``flat_rows``
    (positions ``row * L + column`` of the micro-batch), without autograd: the distributions
    of the tokens after them, with the bits the engine's bitwise sampler computes."""
    import torch

    from palaestra.engines.bitwise import forward as bf
    from palaestra.engines.bitwise.invariant import divide_by_temperature, log_softmax

    with torch.no_grad():
        weights, h, slot = _hidden(model, mb, dtype, rope)
        rows = slot[flat_rows]
        if bool((rows < 0).any()):
            raise ValueError("full_logprobs: a requested position is padding")
        t = temperature if temperature > 1e-6 else 1.0
        return log_softmax(divide_by_temperature(bf.logits(weights, h[rows]), t))


def policy_logprobs(model: torch.nn.Module, mb: MicroBatch, *, dtype: torch.dtype,
                    temperature: float, with_entropy: bool, entropy_grad: bool = False,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token logprobs ``[R, L]`` of a micro-batch (0 at padding and at each sequence's first
    token, like `palaestra.trainers.torch_backend.logprobs.shifted_token_logprobs`), with
    autograd, bit-equal to the engine's in bitwise mode; the entropy when asked, from the same
    float32 logits (differentiable only with ``entropy_grad``)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    weights, h, slot = _hidden(model, mb, dtype, rope)
    rows, width = mb.input_ids.shape
    present = mb.seq_index >= 0
    valid = present & (mb.position_ids > 0)
    targets_flat = torch.nonzero(valid.reshape(-1)).squeeze(1)
    prev = slot[targets_flat - 1]  # the hidden state that predicted each target token
    targets = mb.input_ids.reshape(-1)[targets_flat]
    parts, ent_parts = [], []
    for start in range(0, targets.numel(), HEAD_CHUNK):
        args = (weights, h[prev[start : start + HEAD_CHUNK]],
                targets[start : start + HEAD_CHUNK], temperature, with_entropy)
        # checkpointed: the backward recomputes a chunk's float32 [rows, vocab] work
        logp, ent = (checkpoint(_head, *args, use_reentrant=False) if torch.is_grad_enabled()
                     else _head(*args))
        parts.append(logp)
        ent_parts.append(ent if entropy_grad else ent.detach())
    logp_flat = torch.zeros(rows * width, dtype=torch.float32, device=h.device)
    if parts:
        logp_flat = logp_flat.index_put((targets_flat,), torch.cat(parts))
    entropy = None
    if with_entropy:
        entropy = torch.zeros(rows * width, dtype=torch.float32, device=h.device)
        if ent_parts:
            entropy = entropy.index_put((targets_flat,), torch.cat(ent_parts))
        entropy = entropy.view(rows, width)
    return logp_flat.view(rows, width), entropy


__all__ = ["HEAD_CHUNK", "BitwiseForward", "full_logprobs", "fused_weights", "policy_logprobs"]
