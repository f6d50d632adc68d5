"""Several LoRA adapters trained at once on one base model (the server's training side).

One ``transformers`` model holds every training client's adapter (``peft``, one named adapter
per model id); each has its own AdamW optimizer over its own A/B matrices, so clients never
touch each other's weights or gradients: `forward_backward` runs with the client's adapter
active (peft freezes the others) and adds to its gradients, `optim_step` steps and clears
them. Logprobs come from `palaestra.trainers.torch_backend.logprobs` (float32, chunked), the
losses from `palaestra.tinker_api.losses`. Every method runs on the server's one compute
thread; torch and peft are imported when the trainer is built.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from palaestra.tinker_api.errors import ApiError
from palaestra.tinker_api.wire import TrainDatum
from palaestra.trainers.torch_backend.lora import LINEAR_MODULES

if TYPE_CHECKING:
    import torch

ATTN_MODULES = LINEAR_MODULES[:4]
MLP_MODULES = LINEAR_MODULES[4:]
#: the LoRA scale is alpha / rank
LORA_ALPHA = 32


@dataclass(frozen=True)
class LoraSpec:
    """A training client's adapter, as ``create_lora_training_client`` asked for it."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def targets(self) -> list[str]:
        """The modules the adapter wraps: the decoder's linear layers and the unembedding."""
        return [*(ATTN_MODULES if self.train_attn else ()),
                *(MLP_MODULES if self.train_mlp else ()),
                *(("lm_head",) if self.train_unembed else ())]


@dataclass(frozen=True)
class AdamStep:
    """One optimizer step's hyperparameters (the SDK's ``AdamParams``)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class _Adapter:
    spec: LoraSpec
    params: list[Any]  # the adapter's torch Parameters, in name order
    optimizer: Any  # torch.optim.AdamW
    steps: int = 0


class MultiLoraTrainer:
    """The base model and the adapters trained on it (see the module docstring)."""

    def __init__(self, model_dir: str, device: str = "cpu", dtype: str | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        torch_dtype = getattr(torch, dtype) if dtype else (
            torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
        torch.nn.Module.to(base, self.device)
        base.eval()  # no dropout: forward passes are deterministic
        for p in base.parameters():
            p.requires_grad_(False)
        self._base = base
        self.model: Any = None  # the peft model, once the first adapter exists
        self.adapters: dict[str, _Adapter] = {}

    @property
    def architecture(self) -> str:
        """The base model's class name (``Qwen3ForCausalLM``)."""
        archs = getattr(self._base.config, "architectures", None) or [type(self._base).__name__]
        return str(archs[0])

    # ------------------------------------------------------------------------------ adapters
    def create(self, name: str, spec: LoraSpec) -> None:
        """A new adapter (B = 0, so it starts as the base model) and its optimizer."""
        import peft
        import torch

        config = peft.LoraConfig(r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                 target_modules=spec.targets(), bias="none",
                                 task_type="CAUSAL_LM")
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # the seed draws A where the model lives
            if spec.seed is not None:
                torch.manual_seed(spec.seed)
            if self.model is None:
                self.model = peft.get_peft_model(self._base, config, adapter_name=name)
            else:
                self.model.add_adapter(name, config)
        marker = f".{name}."
        params = [p for n, p in sorted(self.model.named_parameters(), key=lambda kv: kv[0])
                  if ".lora_" in n and marker in n]
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12,
                                      weight_decay=0.0)
        self.adapters[name] = _Adapter(spec, params, optimizer)

    def remove(self, name: str) -> None:
        """Forget an adapter (its weights stay in memory only while peft needs one)."""
        self.adapters.pop(name, None)
        if self.model is not None and len(self.model.peft_config) > 1:
            self.model.delete_adapter(name)

    def _activate(self, name: str) -> _Adapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise ApiError(f"unknown model {name!r}", status=404)
        self.model.set_adapter(name)
        return adapter

    # ------------------------------------------------------------------------------ compute
    def _target_logprobs(self, data: Sequence[TrainDatum]) -> list[torch.Tensor]:
        """Per datum, the logprob of each target token (``[T]`` or ``[T, K]``)."""
        import torch

        from palaestra.trainers.torch_backend.logprobs import token_logprobs

        n_max = max(len(d.tokens) for d in data)
        ids = torch.zeros(len(data), n_max, dtype=torch.long)
        mask = torch.zeros(len(data), n_max, dtype=torch.long)
        for i, d in enumerate(data):
            ids[i, :len(d.tokens)] = torch.tensor(d.tokens)
            mask[i, :len(d.tokens)] = 1
        logits = self.model(input_ids=ids.to(self.device),
                            attention_mask=mask.to(self.device)).logits
        out = []
        for i, d in enumerate(data):
            n = len(d.tokens)
            targets = torch.as_tensor(d.inputs["target_tokens"], dtype=torch.long,
                                      device=self.device)
            if targets.ndim == 1:
                out.append(token_logprobs(logits[i, :n], targets)[0])
            else:
                logp = torch.log_softmax(logits[i, :n].float(), dim=-1)
                out.append(logp.gather(-1, targets))
        return out

    def forward_backward(self, name: str, data: Sequence[TrainDatum], loss_fn: str,
                         config: Mapping[str, float | str], forward_only: bool
                         ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per-datum ``logprobs`` and ``elementwise_loss``, and ``loss:sum``; adds the loss's
        gradient to the adapter's unless ``forward_only``."""
        import torch

        from palaestra.tinker_api.losses import elementwise_loss

        self._activate(name)
        with torch.set_grad_enabled(not forward_only):
            logps = self._target_logprobs(data)
            losses = []
            for d, logp in zip(data, logps):
                inputs = {k: torch.as_tensor(v, dtype=torch.float32, device=self.device)
                          for k, v in d.inputs.items() if k != "target_tokens"}
                losses.append(elementwise_loss(loss_fn, logp, inputs, config))
            total = torch.stack([el.sum() for el in losses]).sum()
            if not forward_only and total.requires_grad:
                total.backward()
        outputs = [{"logprobs": lp.detach().float().cpu().numpy(),
                    "elementwise_loss": el.detach().float().cpu().numpy()}
                   for lp, el in zip(logps, losses)]
        return outputs, {"loss:sum": float(total.detach())}

    def optim_step(self, name: str, step: AdamStep) -> dict[str, float]:
        """One AdamW step on the adapter's accumulated gradients, which are then cleared."""
        import torch

        adapter = self.adapters.get(name)
        if adapter is None:
            raise ApiError(f"unknown model {name!r}", status=404)
        for group in adapter.optimizer.param_groups:
            group.update(lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps,
                         weight_decay=step.weight_decay)
        max_norm = step.grad_clip_norm if step.grad_clip_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(adapter.params, max_norm)
        adapter.optimizer.step()
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.steps += 1
        return {"grad_norm:mean": float(norm), "learning_rate:mean": step.learning_rate}

    # ------------------------------------------------------------------------------ weights
    def export_adapter(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The adapter's tensors (peft's saved names) and its ``adapter_config.json`` fields."""
        import peft

        adapter = self.adapters.get(name)
        if adapter is None:
            raise ApiError(f"unknown model {name!r}", status=404)
        state = peft.get_peft_model_state_dict(self.model, adapter_name=name,
                                               save_embedding_layers=False)
        state = {k: v.detach().float().cpu().clone() for k, v in state.items()
                 if ".lora_A." in k or ".lora_B." in k}
        cfg = self.model.peft_config[name]
        config = {"peft_type": "LORA", "r": cfg.r, "lora_alpha": cfg.lora_alpha,
                  "use_rslora": bool(cfg.use_rslora), "target_modules": sorted(cfg.target_modules),
                  "rank_pattern": {}, "alpha_pattern": {}, "task_type": "CAUSAL_LM",
                  "bias": "none", "lora_dropout": 0.0}
        return state, config

    def save(self, name: str, directory: Path, *, optimizer: bool) -> None:
        """A peft adapter folder, plus the spec and (``optimizer``) the optimizer state."""
        import torch
        from safetensors.torch import save_file

        state, config = self.export_adapter(name)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(state, str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))
        adapter = self.adapters[name]
        (directory / "lora_spec.json").write_text(json.dumps(
            {**asdict(adapter.spec), "steps": adapter.steps}))
        if optimizer:
            torch.save(adapter.optimizer.state_dict(), directory / "optimizer.pt")

    def load(self, name: str, directory: Path, *, optimizer: bool) -> None:
        """Weights (and, with ``optimizer``, the optimizer state) of a `save` folder."""
        import peft
        import torch
        from safetensors.torch import load_file

        adapter = self.adapters.get(name)
        if adapter is None:
            raise ApiError(f"unknown model {name!r}", status=404)
        saved = read_spec(directory)
        if (saved.rank, saved.targets()) != (adapter.spec.rank, adapter.spec.targets()):
            raise ApiError(f"the checkpoint's adapter (rank {saved.rank}, {saved.targets()}) does "
                           f"not fit this model's (rank {adapter.spec.rank}, "
                           f"{adapter.spec.targets()})")
        state = load_file(str(directory / "adapter_model.safetensors"))
        peft.set_peft_model_state_dict(self.model, state, adapter_name=name)
        adapter.optimizer.zero_grad(set_to_none=True)
        if optimizer:
            opt_file = directory / "optimizer.pt"
            if not opt_file.is_file():
                raise ApiError(f"the checkpoint {directory.name!r} holds no optimizer state")
            adapter.optimizer.load_state_dict(torch.load(opt_file, weights_only=True))


def read_spec(directory: Path) -> LoraSpec:
    """The `LoraSpec` a checkpoint folder was saved with."""
    raw = json.loads((directory / "lora_spec.json").read_text())
    return LoraSpec(int(raw["rank"]), raw.get("seed"), bool(raw["train_mlp"]),
                    bool(raw["train_attn"]), bool(raw["train_unembed"]))


__all__ = ["AdamStep", "LoraSpec", "MultiLoraTrainer", "read_spec"]
