"""LoRA adapters in the embedded engine: parsed peft adapters and the low-rank path of `Decoder`.

A `LoraAdapter` is a peft adapter (a folder written by ``save_pretrained``, or the trainer's
in-memory state dict and config) turned into the engine's fused layout: per decoder layer and
fused projection (``qkv``, ``o``, ``gate_up``, ``down``) one ``A`` ``[R, in]`` (the modules'
A matrices stacked) and one ``B`` ``[out, R]`` (their B matrices, block-diagonal, the scale
``alpha / r`` folded in), so one adapter costs two small GEMMs per projection. An adapter that
also trains the unembedding (``lm_head``) adds its update to the logits (`LoraRuntime.add_head`),
low-rank in both modes (the unembedding may be tied to the embedding, so it is never merged).

`LoraRuntime` holds the adapters an engine serves and adds their updates inside the decoder's
forward passes. Requests name their adapter (SGLang's ``lora_path``); a request that names
none runs on the *default* adapter (the policy a trainer syncs in process) or the base model.
The default adapter is applied in one of two modes (``LocalEngine(lora_mode=...)``):

- ``"merged"``: written into the weights (``W_base + s B A``, the touched base weights kept
  in a copy so the next version re-merges from them exactly): no extra work per token; rows of
  the same batch that name another adapter subtract the default's update and add their own.
- ``"lowrank"``: never merged; every row gets its adapter's two GEMMs.

``benchmarks/perf/lora.py`` measures both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.engines.bitwise.lora_merge import merged_weight
from palaestra.errors import EngineError

if TYPE_CHECKING:
    import torch

#: the engine's fused projections: (op, input size key, [(module, out offset key, size key)])
_MODULE_OP = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
              "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}
LORA_MODES = ("merged", "lowrank")


def _layout(decoder: Any) -> dict[str, list[tuple[str, int, int]]]:
    """Per fused op: (module, first output row, rows) inside the fused weight."""
    q, kv = decoder.q_dim, decoder.kv_dim
    h, inter = decoder.config.hidden_size, decoder.config.intermediate_size
    return {"qkv": [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)],
            "o": [("o_proj", 0, h)],
            "gate_up": [("gate_proj", 0, inter), ("up_proj", inter, inter)],
            "down": [("down_proj", 0, h)]}


@dataclass
class LoraAdapter:
    """One adapter: ``modules`` maps a module's Hugging Face name (``model.layers.0.self_attn
    .q_proj``) to ``(A [r, in], B [out, r] * scale)`` in float32."""

    name: str
    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    source: str = ""

    @classmethod
    def from_peft(cls, name: str, state: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                  *, source: str = "") -> LoraAdapter:
        """From peft's saved names (``base_model.model.<module>.lora_A.weight``) and the
        ``adapter_config.json`` fields ``r``, ``lora_alpha``, ``use_rslora``."""
        import math

        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise EngineError(f"adapter {name!r}: per-module rank_pattern/alpha_pattern is not "
                              "supported by the embedded engine; train one rank for all modules")
        if config.get("use_dora"):
            raise EngineError(f"adapter {name!r} is a DoRA adapter; the engine runs plain LoRA")
        r, alpha = int(config["r"]), float(config["lora_alpha"])
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        a_of: dict[str, torch.Tensor] = {}
        b_of: dict[str, torch.Tensor] = {}
        for key, tensor in state.items():
            stem = key.removeprefix("base_model.model.")
            for marker, into in ((".lora_A.", a_of), (".lora_B.", b_of)):
                if marker in stem:
                    into[stem.split(marker)[0]] = tensor.detach().float()
                    break
            else:
                raise EngineError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B matrix "
                                  "(bias or embedding adapters are not supported)")
        if set(a_of) != set(b_of) or not a_of:
            raise EngineError(f"adapter {name!r}: lora_A and lora_B do not pair up "
                              f"({sorted(set(a_of) ^ set(b_of))[:3]})")
        modules = {m: (a_of[m], b_of[m] * scale) for m in sorted(a_of)}
        return cls(name, r, modules, source)

    @classmethod
    def from_folder(cls, name: str, path: str | Path) -> LoraAdapter:
        """A peft adapter folder: ``adapter_config.json`` + ``adapter_model.safetensors``."""
        folder = Path(path)
        config_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
        if not config_file.is_file() or not weights.is_file():
            raise EngineError(f"{path} is not a peft adapter folder (needs adapter_config.json "
                              "and adapter_model.safetensors, what save_pretrained writes)")
        from safetensors.torch import load_file

        config = json.loads(config_file.read_text())
        if config.get("peft_type", "LORA") != "LORA":
            raise EngineError(f"{path} is a {config.get('peft_type')} adapter, not LoRA")
        return cls.from_peft(name, load_file(str(weights)), config, source=str(folder))

    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.modules.values())


@dataclass
class _Fused:
    """One adapter in the decoder's layout: ``ops[layer][op] = (A [R, in], B [out, R])``."""

    adapter: LoraAdapter
    ops: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    #: the unembedding's ``(A [r, hidden], B [vocab, r])``, if the adapter trains it
    head: tuple[torch.Tensor, torch.Tensor] | None = None


class LoraRuntime:
    """The adapters of one `Decoder` and the per-row low-rank updates of its forward passes.

    Ids: 0 is the base model; each loaded adapter gets a fresh id. ``set_rows`` (called by the
    engine before each forward) says which adapter each request of the batch runs.
    """

    def __init__(self, decoder: Any, mode: str = "merged") -> None:
        if mode not in LORA_MODES:
            raise EngineError(f"lora_mode {mode!r}: use one of {', '.join(LORA_MODES)}")
        if decoder.config.moe is not None:
            raise EngineError("LoRA adapters run on dense decoders only (this model is MoE)")
        self.decoder = decoder
        self.mode = mode
        self.layout = _layout(decoder)
        self._layer_index = {id(layer): i for i, layer in enumerate(decoder.layers)}
        self._by_name: dict[str, int] = {}
        self._fused: dict[int, _Fused] = {}
        self._next_id = 1
        self.default: int = 0  # the adapter of requests that name none (0: the base model)
        self._merged: int = 0  # the adapter written into the weights (merged mode)
        self._base: dict[str, torch.Tensor] = {}  # module -> its base weight, while merged
        self._groups: list[tuple[torch.Tensor | None, list[tuple[float, int]]]] = []
        self._head_groups: list[tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor]]]
        self._head_groups = []  # (logit rows, the unembedding's A and B): never merged

    # ------------------------------------------------------------------------ adapters
    @property
    def names(self) -> list[str]:
        return sorted(self._by_name)

    def id_of(self, name: str | None) -> int:
        """The id a request naming ``name`` runs (None: the default adapter)."""
        if name is None:
            return self.default
        if name not in self._by_name:
            raise EngineError(f"no LoRA adapter named {name!r} is loaded (loaded: "
                              f"{self.names or 'none'}); load it first (/load_lora_adapter)")
        return self._by_name[name]

    def adapter(self, name: str) -> LoraAdapter:
        return self._fused[self.id_of(name)].adapter

    def load(self, adapter: LoraAdapter, *, default: bool = False) -> int:
        """Add (or replace, same name) ``adapter``; ``default``: requests naming none run it."""
        fused = self._fuse(adapter)
        old = self._by_name.get(adapter.name)
        if old is not None and old == self._merged:
            self._unmerge()
        adapter_id = self._next_id
        self._next_id += 1
        if old is not None:
            del self._fused[old]
            if self.default == old:
                self.default = 0
        self._by_name[adapter.name] = adapter_id
        self._fused[adapter_id] = fused
        if default:
            self.default = adapter_id
        if self.mode == "merged" and self.default != self._merged:
            self._unmerge()
            if self.default:
                self._merge(self.default)
        return adapter_id

    def unload(self, name: str) -> None:
        adapter_id = self.id_of(name)
        if adapter_id == self._merged:
            self._unmerge()
        if adapter_id == self.default:
            self.default = 0
        del self._by_name[name]
        del self._fused[adapter_id]

    def base_weights_changed(self) -> None:
        """The base weights were overwritten (a full sync): merged bases are stale."""
        merged, self._merged = self._merged, 0
        self._base.clear()
        if merged and merged in self._fused:
            self._merge(merged)

    def _fuse(self, adapter: LoraAdapter) -> _Fused:
        import torch

        dec = self.decoder
        dev, dtype = dec.embed.device, dec.dtype
        unknown = []
        for module in adapter.modules:
            if module == "lm_head":
                continue
            bits = module.split(".")
            ok = (len(bits) == 5 and bits[0] == "model" and bits[1] == "layers"
                  and bits[2].isdigit() and int(bits[2]) < len(dec.layers)
                  and bits[4] in _MODULE_OP)
            if not ok:
                unknown.append(module)
        if unknown:
            raise EngineError(f"adapter {adapter.name!r} targets modules the engine has no "
                              f"low-rank path for: {unknown[:3]} (use q/k/v/o/gate/up/down_proj, lm_head)")
        fused = _Fused(adapter)
        for i in range(len(dec.layers)):
            ops: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for op, parts in self.layout.items():
                present = [(m, off, n) for m, off, n in parts
                           if self._module_name(i, m) in adapter.modules]
                if not present:
                    continue
                out_rows = sum(n for _, _, n in parts)
                a_parts: list[torch.Tensor] = []
                r_total = 0
                for m, _, _ in present:
                    a_parts.append(adapter.modules[self._module_name(i, m)][0])
                    r_total += a_parts[-1].shape[0]
                b = torch.zeros(out_rows, r_total)
                col = 0
                for (m, off, n), a in zip(present, a_parts):
                    b_mat = adapter.modules[self._module_name(i, m)][1]
                    if b_mat.shape != (n, a.shape[0]):
                        raise EngineError(f"adapter {adapter.name!r}: {self._module_name(i, m)} "
                                          f"B is {tuple(b_mat.shape)}, the model needs "
                                          f"({n}, {a.shape[0]}): trained on another model?")
                    b[off:off + n, col:col + a.shape[0]] = b_mat
                    col += a.shape[0]
                a_cat = torch.cat(a_parts)
                if a_cat.shape[1] != self._in_features(op):
                    raise EngineError(f"adapter {adapter.name!r}: layer {i} {op} A has "
                                      f"{a_cat.shape[1]} inputs, the model {self._in_features(op)}")
                ops[op] = (a_cat.to(dev, dtype), b.to(dev, dtype))
            fused.ops.append(ops)
        if "lm_head" in adapter.modules:
            fused.head = self._fuse_head(adapter)
        return fused

    def _fuse_head(self, adapter: LoraAdapter) -> tuple[torch.Tensor, torch.Tensor]:
        """The unembedding's update, applied low-rank to the logits (never merged: it may be
        tied to the embedding, and bitwise mode reads merged weights only)."""
        dec, c = self.decoder, self.decoder.config
        if dec.bitwise:
            raise EngineError(f"adapter {adapter.name!r} trains the unembedding (lm_head), which "
                              "bitwise on-policy mode cannot serve")
        a, b = adapter.modules["lm_head"]
        if a.shape[1] != c.hidden_size or b.shape != (c.vocab_size, a.shape[0]):
            raise EngineError(f"adapter {adapter.name!r}: lm_head A {tuple(a.shape)} / B "
                              f"{tuple(b.shape)} do not fit hidden {c.hidden_size}, vocab "
                              f"{c.vocab_size}: trained on another model?")
        return a.to(dec.embed.device, dec.dtype), b.to(dec.embed.device, dec.dtype)

    @staticmethod
    def _module_name(layer: int, module: str) -> str:
        block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        return f"model.layers.{layer}.{block}.{module}"

    def _in_features(self, op: str) -> int:
        c = self.decoder.config
        return {"qkv": c.hidden_size, "o": self.decoder.q_dim, "gate_up": c.hidden_size,
                "down": c.intermediate_size}[op]

    # ------------------------------------------------------------------------ merging
    def _merge(self, adapter_id: int) -> None:
        """``W = W_base + B A`` for every module of the adapter (bases kept for un-merging)."""
        import torch

        adapter = self._fused[adapter_id].adapter
        with torch.no_grad():
            for module, (a, b) in adapter.modules.items():
                if module == "lm_head":  # applied low-rank to the logits (`add_head`)
                    continue
                view = self.decoder.weight(module + ".weight")
                base = self._base.setdefault(module, view.detach().clone())
                view.copy_(merged_weight(base, a.to(view.device), b.to(view.device),
                                         invariant=self.decoder.bitwise))
        self._merged = adapter_id

    def _unmerge(self) -> None:
        import torch

        with torch.no_grad():
            for module, base in self._base.items():
                self.decoder.weight(module + ".weight").copy_(base)
        self._base.clear()
        self._merged = 0

    # ------------------------------------------------------------------------- forward
    def set_rows(self, ids: Sequence[int], lens: Sequence[int] | None = None) -> bool:
        """The adapter of each request of the next forward (``lens``: its packed token rows;
        None: one row each). Returns whether any low-rank work is needed."""
        import torch

        want: dict[int, list[tuple[float, int]]] = {}
        for adapter_id in set(ids):
            terms: list[tuple[float, int]] = []
            if adapter_id != self._merged:
                if self._merged:
                    terms.append((-1.0, self._merged))
                if adapter_id:
                    terms.append((1.0, adapter_id))
            if terms:
                want[adapter_id] = terms
        self._groups = []
        self._head_groups = self._head_rows(ids)
        if not want:
            return bool(self._head_groups)
        counts = list(lens) if lens is not None else [1] * len(ids)
        per_row = torch.tensor(ids).repeat_interleave(torch.tensor(counts))
        dev = self.decoder.embed.device
        for adapter_id, terms in want.items():
            if len(want) == 1 and len(set(ids)) == 1:
                self._groups.append((None, terms))  # every row: no gather
            else:
                rows = (per_row == adapter_id).nonzero().squeeze(1).to(dev)
                self._groups.append((rows, terms))
        return True

    def _head_rows(self, ids: Sequence[int]
                   ) -> list[tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor]]]:
        """The unembedding updates: the logits of a forward have one row per request (decode,
        a prefill's last tokens) or are one request's (a full-sequence prefill)."""
        import torch

        heads = [(a, head) for a in sorted(set(ids)) if a and (head := self._fused[a].head)]
        dev = self.decoder.embed.device
        return [(None if len(set(ids)) == 1 else
                 torch.tensor([i for i, x in enumerate(ids) if x == a], device=dev), head)
                for a, head in heads]

    def clear_rows(self) -> None:
        self._groups = []
        self._head_groups = []

    def add_head(self, h: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (the unembedding of the normed hidden states ``h``) plus the adapters'
        unembedding updates of each row."""
        for rows, head in self._head_groups:
            hs = h if rows is None else h.index_select(0, rows)
            delta = (hs @ head[0].t()) @ head[1].t()
            logits = logits + delta if rows is None else logits.index_add(0, rows, delta)
        return logits

    def add(self, layer: Any, op: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the fused projection of ``x``) plus the low-rank updates of each row."""
        if not self._groups:
            return y
        i = self._layer_index[id(layer)]
        for rows, terms in self._groups:
            xs = x if rows is None else x.index_select(0, rows)
            delta = None
            for sign, adapter_id in terms:
                ab = self._fused[adapter_id].ops[i].get(op)
                if ab is None:
                    continue
                d = (xs @ ab[0].t()) @ ab[1].t()
                delta = d * sign if delta is None else delta + d * sign
            if delta is None:
                continue
            y = y + delta if rows is None else y.index_add(0, rows, delta)
        return y


__all__ = ["LORA_MODES", "LoraAdapter", "LoraRuntime"]
