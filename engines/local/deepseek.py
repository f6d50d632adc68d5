"""The DeepSeek-V3 layout in the embedded engine: multi-latent attention, sigmoid group routing
with an expert bias, shared experts (transformers' ``DeepseekV3ForCausalLM`` maths).

`MLADecoder` is a `Decoder` whose attention inputs come from MLA: q from the low-rank
``q_a -> norm -> q_b`` path (or ``q_proj``), keys and values from the compressed latent
(``kv_a_proj_with_mqa -> norm -> kv_b_proj``) plus one rotary key part shared by all heads. The
cache holds the expanded per-head keys ``[nope | rope]`` and the values zero-padded to the key
width, so `Decoder.decode`/`extend`/`prefill_full` (continuous batching, prefix reuse, routed
experts) run unchanged: the output projection's padded input columns are zero, which makes the
padding exact. Rotary dimensions are de-interleaved for ``rope_interleave`` (the same products).

Sparse layers (from ``first_k_dense_replace``) route with DeepSeek-V3's rule: sigmoid scores,
``+ e_score_correction_bias`` for the choice only, the ``topk_group`` best of ``n_group`` groups
(each scored by its two best experts), top-k inside them; gate weights are the unbiased scores,
renormalised if ``norm_topk_prob`` and times ``routed_scaling_factor``; the shared experts'
SwiGLU is added. The cache of expanded keys is simple rather than small (the latent cache of
real MLA serving is left for later).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from palaestra.engines.bitwise.decoder_config import DecoderConfig, MoEConfig, rope_tables
from palaestra.engines.local.model import Decoder
from palaestra.engines.local.moe import experts_forward
from palaestra.errors import EngineError

if TYPE_CHECKING:
    import torch

MODEL_TYPE = "deepseek_v3"

_SLOTS = ("in_norm", "post_norm", "q_w", "q_a_w", "q_a_norm", "q_b_w", "kv_a_w", "kv_a_norm",
          "kv_b_w", "o_w", "gate_up_w", "down_w", "router_w", "expert_bias", "experts_gate_up",
          "experts_down")


class _MLALayer:
    __slots__ = _SLOTS
    # tensors, None where the layer has no such weight (q_w without q_lora_rank, MoE on dense)
    in_norm: Any
    post_norm: Any
    q_w: Any
    q_a_w: Any
    q_a_norm: Any
    q_b_w: Any
    kv_a_w: Any
    kv_a_norm: Any
    kv_b_w: Any
    o_w: Any
    gate_up_w: Any
    down_w: Any
    router_w: Any
    expert_bias: Any
    experts_gate_up: Any
    experts_down: Any

    def sparse(self) -> tuple[Any, Any, Any] | None:
        """(router, experts' gate_up, experts' down) of a MoE layer; None on a dense one."""
        if self.router_w is None:
            return None
        return self.router_w, self.experts_gate_up, self.experts_down


def deepseek_config(hf: Any) -> DecoderConfig:
    """The `DecoderConfig` of an MLA model: keys of width nope + rope, one cache head per head."""
    if getattr(hf, "model_type", "") != MODEL_TYPE:
        raise EngineError(f"MLADecoder runs {MODEL_TYPE} models, not {hf.model_type!r}")
    layers = hf.num_hidden_layers
    first_dense = int(getattr(hf, "first_k_dense_replace", 0) or 0)
    experts = int(hf.n_routed_experts)
    moe = MoEConfig(num_experts=experts, top_k=int(hf.num_experts_per_tok),
                    norm_topk_prob=bool(hf.norm_topk_prob),
                    moe_intermediate_size=int(hf.moe_intermediate_size),
                    sparse_layers=tuple(range(first_dense, layers)))
    if experts % int(hf.n_group):
        raise EngineError(f"n_routed_experts={experts} is not a multiple of n_group={hf.n_group}")
    eos = hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return DecoderConfig(
        model_type=MODEL_TYPE, num_layers=layers, hidden_size=hf.hidden_size,
        num_heads=hf.num_attention_heads, num_kv_heads=hf.num_attention_heads,
        head_dim=hf.qk_nope_head_dim + hf.qk_rope_head_dim,
        intermediate_size=hf.intermediate_size, vocab_size=hf.vocab_size,
        rms_norm_eps=hf.rms_norm_eps, max_positions=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)), qk_norm=False,
        eos_token_ids=tuple(int(e) for e in eos_ids), moe=moe,
    )


class MLADecoder(Decoder):
    """`Decoder` for the DeepSeek-V3 layout (see the module docstring)."""

    supports_split_kv = False  # keys (nope + rope) are wider than values

    def __init__(self, config: DecoderConfig, hf_config: Any, device: torch.device | str, dtype: torch.dtype,
                 qkv_bias: bool = False) -> None:
        import torch

        if qkv_bias or getattr(hf_config, "attention_bias", False):
            raise EngineError("MLA with attention_bias is not implemented by LocalEngine")
        self.config = c = config
        self.device = torch.device(device)
        self.dtype = dtype
        hf = hf_config
        self.nope, self.rope_dim = hf.qk_nope_head_dim, hf.qk_rope_head_dim
        self.v_dim, self.kv_lora = hf.v_head_dim, hf.kv_lora_rank
        self.q_lora = hf.q_lora_rank
        self.interleave = bool(getattr(hf, "rope_interleave", False))
        self.n_group, self.topk_group = int(hf.n_group), int(hf.topk_group)
        self.scaling_factor = float(hf.routed_scaling_factor)
        shared = int(getattr(hf, "n_shared_experts", 0) or 0) * int(hf.moe_intermediate_size)
        h, heads, dk = c.hidden_size, c.num_heads, c.head_dim
        self.q_dim = self.kv_dim = heads * dk
        self.lora: Any = None  # LoRA adapters are not implemented for MLA

        def new(*shape: int, dt: Any = dtype) -> torch.Tensor:
            return torch.zeros(*shape, device=self.device, dtype=dt)

        self.embed = new(c.vocab_size, h)
        self.lm_head = self.embed if c.tie_word_embeddings else new(c.vocab_size, h)
        self.final_norm = new(h)
        assert c.moe is not None
        sparse = set(c.moe.sparse_layers)
        e, inter = c.moe.num_experts, c.moe.moe_intermediate_size
        self.layers: list[Any] = []
        for index in range(c.num_layers):
            layer = _MLALayer()
            for name in _SLOTS:
                setattr(layer, name, None)
            layer.in_norm, layer.post_norm = new(h), new(h)
            if self.q_lora is None:
                layer.q_w = new(heads * dk, h)
            else:
                layer.q_a_w, layer.q_a_norm = new(self.q_lora, h), new(self.q_lora)
                layer.q_b_w = new(heads * dk, self.q_lora)
            layer.kv_a_w = new(self.kv_lora + self.rope_dim, h)
            layer.kv_a_norm = new(self.kv_lora)
            layer.kv_b_w = new(heads * (self.nope + self.v_dim), self.kv_lora)
            layer.o_w = new(h, heads * dk)  # input columns past v_dim of each head stay zero
            if index in sparse:
                layer.router_w = new(e, h)
                layer.expert_bias = new(e, dt=torch.float32)
                layer.experts_gate_up, layer.experts_down = new(e, 2 * inter, h), new(e, h, inter)
                if shared:
                    layer.gate_up_w, layer.down_w = new(2 * shared, h), new(h, shared)
            else:
                layer.gate_up_w = new(2 * c.intermediate_size, h)
                layer.down_w = new(h, c.intermediate_size)
            self.layers.append(layer)
        self.last_routes: list[torch.Tensor | None] = [None] * c.num_layers
        self._index_weights()
        cos, sin = rope_tables(hf, c, self.device, dtype)  # [positions, rope_dim]
        half = self.rope_dim // 2
        self.cos, self.sin = cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        import importlib

        module = importlib.import_module(f"transformers.models.{MODEL_TYPE}.modeling_{MODEL_TYPE}")
        self.scale = module.yarn_apply_mscale(dict(hf.rope_parameters or {}), dk**-0.5)

    # ------------------------------------------------------------------------ weights
    def _index_weights(self) -> None:
        self._views, self._reshape = self._build_views()
        self._aliases = self._build_aliases()

    def _build_views(self) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:  # type: ignore[override]
        c = self.config
        views: dict[str, Any] = {"model.embed_tokens.weight": self.embed,
                                 "model.norm.weight": self.final_norm,
                                 "lm_head.weight": self.lm_head}
        reshape: dict[str, tuple[int, ...]] = {}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            views[p + "input_layernorm.weight"] = layer.in_norm
            views[p + "post_attention_layernorm.weight"] = layer.post_norm
            if layer.q_w is not None:
                views[a + "q_proj.weight"] = layer.q_w
            else:
                views[a + "q_a_proj.weight"] = layer.q_a_w
                views[a + "q_a_layernorm.weight"] = layer.q_a_norm
                views[a + "q_b_proj.weight"] = layer.q_b_w
            views[a + "kv_a_proj_with_mqa.weight"] = layer.kv_a_w
            views[a + "kv_a_layernorm.weight"] = layer.kv_a_norm
            views[a + "kv_b_proj.weight"] = layer.kv_b_w
            views[a + "o_proj.weight"] = layer.o_w.view(c.hidden_size, c.num_heads,
                                                        c.head_dim)[:, :, : self.v_dim]
            reshape[a + "o_proj.weight"] = (c.hidden_size, c.num_heads, self.v_dim)
            mlp = p + ("mlp.shared_experts." if layer.router_w is not None else "mlp.")
            if layer.gate_up_w is not None:
                inter = layer.down_w.shape[1]
                views[mlp + "gate_proj.weight"] = layer.gate_up_w[:inter]
                views[mlp + "up_proj.weight"] = layer.gate_up_w[inter:]
                views[mlp + "down_proj.weight"] = layer.down_w
            if layer.router_w is not None:
                views[p + "mlp.gate.weight"] = layer.router_w
                views[p + "mlp.gate.e_score_correction_bias"] = layer.expert_bias
                views[p + "mlp.experts.gate_up_proj"] = layer.experts_gate_up
                views[p + "mlp.experts.down_proj"] = layer.experts_down
        return views, reshape

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True) -> int:
        def shaped() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                shape = self._reshape.get(name)
                yield name, (tensor.reshape(shape) if shape is not None
                             and tensor.numel() == _numel(shape) else tensor)

        return super().load_weights(shaped(), strict=strict)

    @classmethod
    def config_from_hf(cls, hf: Any) -> DecoderConfig:
        return deepseek_config(hf)

    # ------------------------------------------------------------------------ forward
    def _rot(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        import torch

        if self.interleave:  # pairs (x0, x1), (x2, x3)...: de-interleave, then rotate halves
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return self._rope(x, cos, sin)

    def _qkv(self, layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        import torch
        import torch.nn.functional as F

        c = self.config
        n, heads, eps = x.shape[0], c.num_heads, c.rms_norm_eps
        if layer.q_w is not None:
            q = F.linear(x, layer.q_w)
        else:
            qa = F.rms_norm(F.linear(x, layer.q_a_w), (self.q_lora,), layer.q_a_norm, eps)
            q = F.linear(qa, layer.q_b_w)
        q = q.view(n, heads, c.head_dim)
        kv_a = F.linear(x, layer.kv_a_w)
        latent = F.rms_norm(kv_a[:, : self.kv_lora], (self.kv_lora,), layer.kv_a_norm, eps)
        k_rot = kv_a[:, self.kv_lora :].view(n, 1, self.rope_dim)
        kv = F.linear(latent, layer.kv_b_w).view(n, heads, self.nope + self.v_dim)
        q_rot = self._rot(q[..., self.nope :], cos, sin)
        k_rot = self._rot(k_rot, cos, sin).expand(n, heads, self.rope_dim)
        q = torch.cat((q[..., : self.nope], q_rot), dim=-1)
        k = torch.cat((kv[..., : self.nope], k_rot), dim=-1)
        v = F.pad(kv[..., self.nope :], (0, c.head_dim - self.v_dim))
        return q, k, v

    def _route(self, layer: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import torch
        import torch.nn.functional as F

        c = self.config
        assert c.moe is not None
        scores = F.linear(x.float(), layer.router_w.float()).sigmoid()
        choice = scores + layer.expert_bias
        n, e = scores.shape
        groups = choice.view(n, self.n_group, e // self.n_group).topk(2, dim=-1)[0].sum(-1)
        best = torch.topk(groups, self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(groups).scatter_(1, best, 1.0).bool()
        mask = mask.unsqueeze(-1).expand(n, self.n_group, e // self.n_group).reshape(n, e)
        ids = torch.topk(choice.masked_fill(~mask, float("-inf")), c.moe.top_k, dim=-1,
                         sorted=False)[1]
        weights = scores.gather(1, ids)
        if c.moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, (weights * self.scaling_factor).to(x.dtype)

    def _mlp_residual(self, layer: Any, h: torch.Tensor) -> torch.Tensor:
        import torch
        import torch.nn.functional as F

        c = self.config
        x = F.rms_norm(h, (c.hidden_size,), layer.post_norm, c.rms_norm_eps)
        out = h
        if layer.router_w is not None:
            ids, weights = self._route(layer, x)
            self.last_routes[self.layers.index(layer)] = ids
            out = out + experts_forward(x, ids, weights, layer.experts_gate_up, layer.experts_down)
        if layer.gate_up_w is not None:  # the dense MLP, or the shared experts
            gate, up = F.linear(x, layer.gate_up_w).chunk(2, dim=-1)
            out = torch.addmm(out, F.silu(gate) * up, layer.down_w.t())
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


__all__ = ["MODEL_TYPE", "MLADecoder", "deepseek_config"]
