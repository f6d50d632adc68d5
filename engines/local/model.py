"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE) on Hugging Face weights.

For `LocalEngine`; the sparse blocks of ``qwen3_moe`` are in `palaestra.engines.local.moe`.

The engine does not run the transformers module tree: per decode step that costs several Python
calls per sub-module and a mask rebuild per layer. Instead the checkpoint's tensors are copied
into a fused layout (one QKV matrix, one gate+up matrix per layer) and one function runs a whole
batch through the layers with a handful of torch ops each, reading and writing the slot KV cache
of `palaestra.engines.local.kv_cache`. The maths is the transformers implementation's:
RMSNorm, rotary embeddings from the model's own rotary class (so rope scaling is honoured),
grouped-query attention, SwiGLU; the tests check greedy tokens against ``generate`` and logprobs
against a full forward pass.

Weight updates copy in place into the fused tensors (`Decoder.load_weights`), so tensor
addresses never change (CUDA graphs stay valid) and a partial update (one bucket) is cheap.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.engines.bitwise.decoder_config import (
    DecoderConfig,
    signed_rope_tables,
)
from palaestra.engines.weights.checkpoint_files import (
    iter_safetensors,
    safetensors_files,
    tensor_names,
)
from palaestra.errors import EngineError

if TYPE_CHECKING:
    import torch

    from palaestra.engines.bitwise.forward import BitwiseWeights, KVStore
    from palaestra.engines.bitwise.invariant import AttentionPlan
    from palaestra.engines.local.kv_cache import SlotKVCache

#: Hugging Face ``model_type``s whose layers are not this module's (`load_decoder` picks their
#: decoder class: `palaestra.engines.local.loading`)
OTHER_LAYOUTS = ("deepseek_v3",)


def _refuse_other_layout(cls: type, hf_config: Any) -> None:
    model_type = getattr(hf_config, "model_type", "")
    if cls is Decoder and model_type in OTHER_LAYOUTS:
        raise EngineError(f"a {model_type} checkpoint has its own decoder class; build it with "
                          "palaestra.engines.local.loading.load_decoder / decoder_from_hf_model")


@dataclass
class ExtendBatch:
    """Index tensors of one prefill ("extend") forward over R requests, tokens packed.

    Request r owns cache slot ``slot0 + r``, already holds ``starts[r]`` cached positions and adds
    ``lens[r]`` new tokens; ``pad_index`` maps packed tokens into the padded ``[R, T]`` layout.
    """

    slot0: int
    starts: list[int]
    lens: list[int]
    slot_ids: torch.Tensor  # [N] cache slot of each packed token
    positions: torch.Tensor  # [N]
    pad_index: torch.Tensor | None  # [N] row r * T + t, None when R == 1
    mask: torch.Tensor | None  # [R, 1, T, Lk] bool (True = attend), None = plain causal
    last_index: torch.Tensor  # [R] packed index of each request's last token
    key_len: int  # Lk


class _Layer:
    __slots__ = (
        "down_w",
        "experts_down",
        "experts_gate_up",
        "gate_up_w",
        "in_norm",
        "k_norm",
        "o_w",
        "post_norm",
        "q_norm",
        "qkv_b",
        "qkv_w",
        "router_w",
    )
    in_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_w: torch.Tensor
    post_norm: torch.Tensor
    gate_up_w: torch.Tensor | None  # None on a sparse (MoE) layer
    down_w: torch.Tensor | None
    router_w: torch.Tensor | None  # None on a dense layer
    experts_gate_up: torch.Tensor | None
    experts_down: torch.Tensor | None

    def sparse(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(router, experts' gate_up, experts' down) of a MoE layer; None on a dense one."""
        if self.router_w is None or self.experts_gate_up is None or self.experts_down is None:
            return None
        return self.router_w, self.experts_gate_up, self.experts_down

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) of a dense layer's MLP."""
        if self.gate_up_w is None or self.down_w is None:
            raise EngineError("a MoE layer has no dense MLP weights")
        return self.gate_up_w, self.down_w


class Decoder:
    """Fused weights + the batched forward passes of a Llama-family model."""

    #: keys and values share one head width, so decode can use the split-KV kernel
    supports_split_kv = True
    #: decode attention to each row's own length (`decode_attention`); the engine turns it on
    #: after its self-check (a class default: subclasses with their own __init__ inherit it)
    split_kv_attention = False
    #: bitwise on-policy mode (`enable_bitwise`): every forward through
    #: `palaestra.engines.bitwise.forward`, batch-invariant
    bitwise = False

    def __init__(self, config: DecoderConfig, hf_config: Any, device: Any, dtype: Any,
                 qkv_bias: bool) -> None:
        import torch

        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        c = config
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_dim, self.kv_dim = q_dim, kv_dim
        self.lora: Any = None  # a `palaestra.engines.local.lora.LoraRuntime` serving adapters

        def new(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, device=self.device, dtype=dtype)

        self.embed = new(c.vocab_size, c.hidden_size)
        self.lm_head = self.embed if c.tie_word_embeddings else new(c.vocab_size, c.hidden_size)
        self.final_norm = new(c.hidden_size)
        self.layers: list[_Layer] = []
        sparse = set(c.moe.sparse_layers) if c.moe is not None else set()
        for index in range(c.num_layers):
            layer = _Layer()
            layer.in_norm = new(c.hidden_size)
            layer.qkv_w = new(q_dim + 2 * kv_dim, c.hidden_size)
            layer.qkv_b = new(q_dim + 2 * kv_dim) if qkv_bias else None
            layer.q_norm = new(c.head_dim) if c.qk_norm else None
            layer.k_norm = new(c.head_dim) if c.qk_norm else None
            layer.o_w = new(c.hidden_size, q_dim)
            layer.post_norm = new(c.hidden_size)
            layer.router_w = layer.experts_gate_up = layer.experts_down = None
            if index in sparse:
                assert c.moe is not None
                e, inter = c.moe.num_experts, c.moe.moe_intermediate_size
                layer.gate_up_w = layer.down_w = None
                layer.router_w = new(e, c.hidden_size)
                layer.experts_gate_up = new(e, 2 * inter, c.hidden_size)
                layer.experts_down = new(e, c.hidden_size, inter)
            else:
                layer.gate_up_w = new(2 * c.intermediate_size, c.hidden_size)
                layer.down_w = new(c.hidden_size, c.intermediate_size)
            self.layers.append(layer)
        #: expert ids ``[N, K]`` each sparse layer chose in the last forward (None on dense ones)
        self.last_routes: list[torch.Tensor | None] = [None] * c.num_layers
        self._index_weights()
        self.cos, self.sin = signed_rope_tables(hf_config, c, self.device, dtype)
        self.scale = c.head_dim**-0.5

    def _index_weights(self) -> None:
        """Map HF names to the tensors holding them (after building or moving the weights)."""
        self._views = self._build_views()
        self._aliases = self._build_aliases()

    def _build_views(self) -> dict[str, torch.Tensor]:
        """HF parameter name -> the tensor (or fused slice) that holds it."""
        c = self.config
        q_dim, kv_dim, inter = self.q_dim, self.kv_dim, c.intermediate_size
        views = {
            "model.embed_tokens.weight": self.embed,
            "model.norm.weight": self.final_norm,
            "lm_head.weight": self.lm_head,
        }
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            views[p + "input_layernorm.weight"] = layer.in_norm
            views[p + "post_attention_layernorm.weight"] = layer.post_norm
            views[p + "self_attn.q_proj.weight"] = layer.qkv_w[:q_dim]
            views[p + "self_attn.k_proj.weight"] = layer.qkv_w[q_dim : q_dim + kv_dim]
            views[p + "self_attn.v_proj.weight"] = layer.qkv_w[q_dim + kv_dim :]
            if layer.qkv_b is not None:
                views[p + "self_attn.q_proj.bias"] = layer.qkv_b[:q_dim]
                views[p + "self_attn.k_proj.bias"] = layer.qkv_b[q_dim : q_dim + kv_dim]
                views[p + "self_attn.v_proj.bias"] = layer.qkv_b[q_dim + kv_dim :]
            if layer.q_norm is not None and layer.k_norm is not None:  # both or neither
                views[p + "self_attn.q_norm.weight"] = layer.q_norm
                views[p + "self_attn.k_norm.weight"] = layer.k_norm
            views[p + "self_attn.o_proj.weight"] = layer.o_w
            sparse = layer.sparse()
            if sparse is not None:
                views[p + "mlp.gate.weight"] = sparse[0]
                views[p + "mlp.experts.gate_up_proj"] = sparse[1]
                views[p + "mlp.experts.down_proj"] = sparse[2]
                continue
            gate_up_w, down_w = layer.dense()
            views[p + "mlp.gate_proj.weight"] = gate_up_w[:inter]
            views[p + "mlp.up_proj.weight"] = gate_up_w[inter:]
            views[p + "mlp.down_proj.weight"] = down_w
        return views

    def _build_aliases(self) -> dict[str, tuple[str, torch.Tensor]]:
        """Per-expert checkpoint names (``mlp.experts.{e}.gate_proj.weight``, what
        ``save_pretrained`` writes) -> (the fused in-memory name they fill, the slice)."""
        aliases: dict[str, tuple[str, torch.Tensor]] = {}
        if self.config.moe is None:
            return aliases
        inter = self.config.moe.moe_intermediate_size
        for i, layer in enumerate(self.layers):
            sparse = layer.sparse()
            if sparse is None:
                continue
            router_w, experts_gate_up, experts_down = sparse
            p = f"model.layers.{i}.mlp.experts."
            for e in range(router_w.shape[0]):
                aliases[f"{p}{e}.gate_proj.weight"] = (p + "gate_up_proj",
                                                        experts_gate_up[e, :inter])
                aliases[f"{p}{e}.up_proj.weight"] = (p + "gate_up_proj",
                                                      experts_gate_up[e, inter:])
                aliases[f"{p}{e}.down_proj.weight"] = (p + "down_proj", experts_down[e])
        return aliases

    def to_device(self, device: Any) -> None:
        """Move every weight to ``device`` (``release_memory_occupation`` of weights on a GPU)."""
        import torch

        device = torch.device(device)
        if device == self.device:
            return
        tied = self.lm_head is self.embed
        with torch.inference_mode():
            self.embed = self.embed.to(device)
            self.lm_head = self.embed if tied else self.lm_head.to(device)
            self.final_norm = self.final_norm.to(device)
            for layer in self.layers:
                for name in type(layer).__slots__:  # subclasses bring their own layer kind
                    t = getattr(layer, name)
                    if t is not None:
                        setattr(layer, name, t.to(device))
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        self.device = device
        self._index_weights()

    # ----------------------------------------------------------------------------- weights
    @property
    def weight_names(self) -> list[str]:
        return list(self._views)

    def weight(self, name: str) -> torch.Tensor | None:
        """The tensor (or fused slice) holding the HF weight ``name``; None if there is none."""
        alias = self._aliases.get(name)
        return self._views.get(name) if alias is None else alias[1]

    def num_bytes(self) -> int:
        seen = {self.embed.data_ptr(): self.embed.numel() * self.embed.element_size()}
        for t in (self.lm_head, self.final_norm):
            seen[t.data_ptr()] = t.numel() * t.element_size()
        for layer in self.layers:
            for name in type(layer).__slots__:
                t = getattr(layer, name)
                if t is not None:
                    seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values())

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True) -> int:
        """Copy (name, tensor) pairs (HF names) into the fused weights in place; returns a count.

        Unknown names and shape mismatches raise `EngineError` (all of them in one message) when
        ``strict``; rotary ``inv_freq`` buffers are skipped.
        """
        import torch

        problems: list[str] = []
        count = 0
        with torch.inference_mode():
            for name, tensor in named:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                dst = self._views.get(name)
                if dst is None and name in self._aliases:
                    dst = self._aliases[name][1]
                if dst is None:
                    if strict:
                        problems.append(f"unknown weight {name!r}")
                    continue
                if tuple(tensor.shape) != tuple(dst.shape):
                    problems.append(
                        f"{name}: shape {tuple(tensor.shape)} does not match {tuple(dst.shape)}"
                    )
                    continue
                dst.copy_(tensor, non_blocking=True)
                count += 1
        if problems:
            raise EngineError(
                f"{len(problems)} weight(s) could not be loaded: {'; '.join(problems[:8])}"
                + (" ..." if len(problems) > 8 else "")
                + "; send tensors with the checkpoint's Hugging Face names and shapes"
            )
        return count

    def missing_after_full_load(self, loaded: set[str]) -> list[str]:
        skip = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        by_fused: dict[str, list[str]] = {}
        for alias, (fused, _) in self._aliases.items():
            by_fused.setdefault(fused, []).append(alias)
        skip |= {fused for fused, names in by_fused.items() if loaded.issuperset(names)}
        return sorted(set(self._views) - loaded - skip)

    @classmethod
    def config_from_hf(cls, hf: Any) -> DecoderConfig:
        """This decoder's `DecoderConfig` of a Hugging Face config (subclasses: their layout)."""
        return DecoderConfig.from_hf(hf)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: Any, dtype: Any) -> Decoder:
        """Read config.json and the safetensors files of an HF checkpoint directory."""
        from transformers import AutoConfig

        path = Path(path)
        if not (path / "config.json").is_file():
            raise EngineError(
                f"{path} has no config.json; pass a Hugging Face model directory "
                "(e.g. one written by `palaestra init-model`)"
            )
        hf_config = AutoConfig.from_pretrained(path)
        _refuse_other_layout(cls, hf_config)
        config = cls.config_from_hf(hf_config)
        files = safetensors_files(path)
        qkv_bias = any(name.endswith("q_proj.bias") for name, _ in tensor_names(files))
        model = cls(config, hf_config, device, dtype, qkv_bias=qkv_bias)
        loaded: set[str] = set()

        def named() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in iter_safetensors(files):
                loaded.add(name)
                yield name, tensor

        model.load_weights(named())
        missing = model.missing_after_full_load(loaded)
        if missing:
            raise EngineError(f"checkpoint {path} lacks {len(missing)} weights, e.g. {missing[:3]}")
        return model

    @classmethod
    def from_hf_model(cls, hf_model: Any, device: Any = None, dtype: Any = None) -> Decoder:
        """Build from an in-memory transformers model (weights are copied)."""
        _refuse_other_layout(cls, hf_model.config)
        param = next(hf_model.parameters())
        device = device if device is not None else param.device
        dtype = dtype if dtype is not None else param.dtype
        config = cls.config_from_hf(hf_model.config)
        state = hf_model.state_dict()
        qkv_bias = any(k.endswith("q_proj.bias") for k in state)
        model = cls(config, hf_model.config, device, dtype, qkv_bias=qkv_bias)
        model.load_weights(state.items())
        missing = model.missing_after_full_load(set(state))
        if missing:
            raise EngineError(f"model lacks {len(missing)} weights, e.g. {missing[:3]}")
        return model

    # ----------------------------------------------------------------------------- bitwise
    def enable_bitwise(self) -> None:
        """Run every forward batch-invariantly (`bitwise_forward`): a token's logits then have
        the same bits in any batch, and the same as the torch trainer's bitwise forward.
        Dense Llama-family layers; a LoRA adapter only as the default one, merged into the
        weights once bitwise is on (`LocalEngine.load_lora_adapter`)."""
        if type(self) is not Decoder or self.config.moe is not None:
            raise EngineError(f"bitwise on-policy mode covers dense Llama-family models, not "
                              f"{self.config.model_type}: use trainer.on_policy = 'default'")
        if self.lora is not None:
            raise EngineError("turn bitwise on-policy mode on before loading LoRA adapters "
                              "(a merged one is then merged the way the trainer merges it)")
        if self.device.type == "cuda":
            from palaestra.engines.bitwise.invariant_triton import available

            if not available("cuda"):
                raise EngineError("bitwise on-policy mode on CUDA runs Triton kernels: "
                                  "pip install triton (it comes with torch's CUDA wheels)")
        self.bitwise = True
        self.split_kv_attention = False

    def bitwise_weights(self) -> BitwiseWeights:
        """This decoder's tensors as `bitwise_forward` reads them (views, no copies)."""
        from palaestra.engines.bitwise.forward import BitwiseWeights

        return BitwiseWeights(self.config, self.embed, self.final_norm, self.lm_head,
                              self.layers, self.cos, self.sin)

    def _bitwise_logits(self, tokens: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor,
                        store: KVStore, rows: torch.Tensor | None = None,
                        plan: AttentionPlan | None = None) -> torch.Tensor:
        from palaestra.engines.bitwise import forward as bf

        w = self.bitwise_weights()
        h = bf.hidden_states(w, tokens, seq, pos, store, plan)
        return bf.logits(w, h if rows is None else h[rows])

    # ----------------------------------------------------------------------------- forward
    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` with the sign folded into ``sin_signed``."""
        import torch

        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin_signed)

    def _qkv(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        import torch
        import torch.nn.functional as F

        c = self.config
        n = x.shape[0]
        qkv = F.linear(x, layer.qkv_w, layer.qkv_b)
        if self.lora is not None:
            qkv = self.lora.add(layer, "qkv", x, qkv)
        qk_dim = self.q_dim + self.kv_dim
        v = qkv[:, qk_dim:].view(n, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = F.rms_norm(qkv[:, : self.q_dim].view(n, c.num_heads, c.head_dim), (c.head_dim,),
                           layer.q_norm, c.rms_norm_eps)
            k = F.rms_norm(qkv[:, self.q_dim : qk_dim].view(n, c.num_kv_heads, c.head_dim),
                           (c.head_dim,), layer.k_norm, c.rms_norm_eps)
            qk = torch.cat((q, k), dim=1)
        else:
            qk = qkv[:, :qk_dim].view(n, c.num_heads + c.num_kv_heads, c.head_dim)
        qk = self._rope(qk, cos, sin)
        return qk[:, : c.num_heads], qk[:, c.num_heads :], v

    def _mlp_residual(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        import torch
        import torch.nn.functional as F

        c = self.config
        x = F.rms_norm(h, (c.hidden_size,), layer.post_norm, c.rms_norm_eps)
        sparse = layer.sparse()
        if sparse is not None:
            from palaestra.engines.local.moe import experts_forward, route

            assert c.moe is not None
            router_w, experts_gate_up, experts_down = sparse
            ids, weights = route(x, router_w, c.moe.top_k, c.moe.norm_topk_prob)
            self.last_routes[self.layers.index(layer)] = ids
            return h + experts_forward(x, ids, weights, experts_gate_up, experts_down)
        gate_up_w, down_w = layer.dense()
        if self.lora is not None:  # LoRA: the adapters' low-rank updates of the projections
            act = self.lora.add(layer, "gate_up", x, F.linear(x, gate_up_w))
            gate, up = act.chunk(2, dim=-1)
            act = F.silu(gate) * up
            return self.lora.add(layer, "down", act, torch.addmm(h, act, down_w.t()))
        gate, up = F.linear(x, gate_up_w).chunk(2, dim=-1)
        return torch.addmm(h, F.silu(gate) * up, down_w.t())  # residual fused in the GEMM

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        c = self.config
        h = F.rms_norm(h, (c.hidden_size,), self.final_norm, c.rms_norm_eps)
        logits = F.linear(h, self.lm_head)
        if self.lora is not None:  # LoRA: adapters that train the unembedding
            logits = self.lora.add_head(h, logits)
        return logits.float()

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: SlotKVCache,
               key_len: int) -> torch.Tensor:
        """One decode step for slots ``0..B-1`` (one token each at ``positions``); logits [B, V].

        ``key_len`` must exceed every position; keys past a row's position are masked. Few
        kernels per layer (this is what a CUDA graph replays): the KV write is one index_put
        per tensor, the mask and the softmax scale ride inside one batched GEMM (baddbmm) over
        ``B * kv_heads`` groups of ``heads / kv_heads`` queries, and residual adds ride inside
        the output GEMMs (addmm).
        """
        import torch
        import torch.nn.functional as F

        if self.bitwise:
            from palaestra.engines.bitwise.forward import SlotCacheStore
            from palaestra.engines.bitwise.invariant import decode_plan

            c = self.config  # no host sync on this path: a CUDA graph captures it
            plan = decode_plan(positions, c.num_heads, c.num_kv_heads, key_len)
            slots = torch.arange(tokens.shape[0], device=tokens.device)
            return self._bitwise_logits(tokens, slots, positions, SlotCacheStore(cache),
                                        plan=plan)
        c = self.config
        b = tokens.shape[0]
        hkv, d = c.num_kv_heads, c.head_dim
        rep = c.num_heads // hkv
        cap = cache.k[0].shape[2]
        dev = tokens.device
        slots = torch.arange(b, device=dev)
        # row of (slot, kv head, position) in a layer's cache viewed as [slots * hkv * cap, d]
        rows = (slots[:, None] * hkv + torch.arange(hkv, device=dev)[None, :]) * cap
        rows = rows + positions[:, None]
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        split_kv = self.split_kv_attention
        if split_kv:  # each row reads its own positions only (`decode_attention`)
            from palaestra.engines.local.decode_attention import decode_attention

            lengths = (positions + 1).to(torch.int32)
        else:
            keys = torch.arange(key_len, device=dev)
            mask = torch.zeros(b, 1, key_len, device=dev, dtype=self.dtype)
            mask.masked_fill_((keys[None, :] > positions[:, None]).unsqueeze(1), float("-inf"))
            mask = mask.expand(b, hkv * rep, key_len).reshape(b * hkv, rep, key_len)
        h = F.embedding(tokens, self.embed)
        for i, layer in enumerate(self.layers):
            x = F.rms_norm(h, (c.hidden_size,), layer.in_norm, c.rms_norm_eps)
            q, k, v = self._qkv(layer, x, cos, sin)
            cache.k[i].view(-1, d).index_put_((rows,), k)
            cache.v[i].view(-1, d).index_put_((rows,), v)
            if split_kv:
                attn = decode_attention(q, cache.k[i], cache.v[i], lengths, self.scale,
                                        key_len).view(b, self.q_dim)
            else:
                keys_i = cache.k[i][:b, :, :key_len].reshape(b * hkv, key_len, d)
                vals_i = cache.v[i][:b, :, :key_len].reshape(b * hkv, key_len, d)
                scores = torch.baddbmm(mask, q.reshape(b * hkv, rep, d),
                                       keys_i.transpose(1, 2), alpha=self.scale)
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(vals_i.dtype)
                attn = torch.bmm(probs, vals_i).view(b, self.q_dim)
            h = torch.addmm(h, attn, layer.o_w.t())
            if self.lora is not None:
                h = self.lora.add(layer, "o", attn, h)
            h = self._mlp_residual(layer, h)
        if c.moe is not None and hasattr(cache, "write"):
            cache.write(slots, positions, self.last_routes)
        return self._logits(h)

    def extend(self, tokens: torch.Tensor, batch: ExtendBatch, cache: SlotKVCache) -> torch.Tensor:
        """Prefill packed new tokens of R requests (see `ExtendBatch`); logits of each last token."""
        import torch
        import torch.nn.functional as F

        if self.bitwise:
            from palaestra.engines.bitwise.forward import SlotCacheStore

            return self._bitwise_logits(tokens, batch.slot_ids, batch.positions,
                                        SlotCacheStore(cache), batch.last_index)
        c = self.config
        r = len(batch.lens)
        t_max = max(batch.lens)
        positions = batch.positions
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        h = F.embedding(tokens, self.embed)
        s0 = batch.slot0
        for i, layer in enumerate(self.layers):
            x = F.rms_norm(h, (c.hidden_size,), layer.in_norm, c.rms_norm_eps)
            q, k, v = self._qkv(layer, x, cos, sin)
            cache.k[i][batch.slot_ids, :, positions] = k
            cache.v[i][batch.slot_ids, :, positions] = v
            keys_i = cache.k[i][s0 : s0 + r, :, : batch.key_len]
            vals_i = cache.v[i][s0 : s0 + r, :, : batch.key_len]
            if batch.pad_index is None:
                qp = q.view(1, t_max, c.num_heads, c.head_dim).transpose(1, 2)
            else:
                qp = q.new_zeros(r * t_max, c.num_heads, c.head_dim)
                qp[batch.pad_index] = q
                qp = qp.view(r, t_max, c.num_heads, c.head_dim).transpose(1, 2)
            out = _attention(qp, keys_i, vals_i, batch.mask, self.scale)  # [R, H, T, D]
            out = out.transpose(1, 2).reshape(r * t_max, self.q_dim)
            if batch.pad_index is not None:
                out = out[batch.pad_index]
            h = torch.addmm(h, out, layer.o_w.t())
            if self.lora is not None:
                h = self.lora.add(layer, "o", out, h)
            h = self._mlp_residual(layer, h)
        if c.moe is not None and hasattr(cache, "write"):
            cache.write(batch.slot_ids, positions, self.last_routes)
        return self._logits(h[batch.last_index])

    def prefill_full(self, tokens: torch.Tensor, rows: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """Logits of every position of one sequence without any cache (tests, scoring) [T, V];
        ``rows``: of those positions only ``[len(rows), V]`` (the output layer runs on them)."""
        import torch
        import torch.nn.functional as F

        n = tokens.shape[0]
        if self.bitwise:
            from palaestra.engines.bitwise.forward import PackedStore

            zeros = torch.zeros(n, dtype=torch.long, device=tokens.device)
            return self._bitwise_logits(tokens, zeros, torch.arange(n, device=tokens.device),
                                        PackedStore(1, n), rows)
        c = self.config
        positions = torch.arange(n, device=tokens.device)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        h = F.embedding(tokens, self.embed)
        for layer in self.layers:
            x = F.rms_norm(h, (c.hidden_size,), layer.in_norm, c.rms_norm_eps)
            q, k, v = self._qkv(layer, x, cos, sin)
            out = _attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                             v.transpose(0, 1)[None], None, self.scale)
            attn = out[0].transpose(0, 1).reshape(n, self.q_dim)
            h = torch.addmm(h, attn, layer.o_w.t())
            if self.lora is not None:
                h = self.lora.add(layer, "o", attn, h)
            h = self._mlp_residual(layer, h)
        return self._logits(h if rows is None else h[rows])


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float) -> torch.Tensor:
    """Grouped-query SDPA: q [R, H, T, D], k/v [R, Hkv, L, D]; causal when ``mask`` is None."""
    import torch.nn.functional as F

    rep = q.shape[1] // k.shape[1]
    if rep > 1 and q.device.type != "cpu":
        # the fused CUDA kernels take equal head counts; expanding costs one copy per layer
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        rep = 1
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=rep > 1
    )


__all__ = ["Decoder", "ExtendBatch"]
