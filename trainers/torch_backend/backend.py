"""``TorchBackend``: train any Hugging Face causal LM (or a value model) with the palaestra losses.

Typical use from a training loop::

    backend = TorchBackend(model_path, TorchBackendConfig(lr=1e-5, ref_model=True))
    batch = TrainBatch.from_samples(samples)
    batch = batch.replace(ref_logprobs=backend.forward_logprobs(batch, ref=True))
    batch = compute_advantages(batch, loss_cfg)
    metrics = backend.train_step(batch, loss_cfg)       # one optimizer step
    engine.update_weights(backend.state_dict_for_engines())
    backend.save(run_dir / "ckpt" / f"step_{backend.step}")

One ``train_step`` is one optimizer step: the batch is cut into token-balanced micro-batches
(packed rows by default), the loss weights of the configured aggregation are computed over the
whole batch first, and gradients are accumulated, so the update does not depend on the
micro-batch size. Under ``torchrun`` with several ranks the model is sharded with FSDP2 and
every rank passes the *same* full batch: the backend splits it across ranks by tokens.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from palaestra.errors import ConfigError
from palaestra.host_memory import release_freed_memory
from palaestra.trace_ranges import span
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.algorithms.objective import (
    MAX_METRICS,
    PAIR_WEIGHT,
    dpo_loss_micro,
    merge_metric,
    rl_loss,
    sft_loss_micro,
    value_loss_micro,
)
from palaestra.trainers.batching import TrainBatch
from palaestra.trainers.loss_inputs import LOSS_WEIGHTS, loss_micro_batches, runs_ref_forward
from palaestra.trainers.micro_batches import (
    MicroBatch,
    build_micro_batch,
    make_micro_batches,
    split_across_ranks,
)
from palaestra.trainers.torch_backend import checkpoint as ckpt
from palaestra.trainers.torch_backend.config import TorchBackendConfig
from palaestra.trainers.torch_backend.distributed import (
    DistInfo,
    all_gather_objects,
    all_reduce_max,
    all_reduce_max_int,
    all_reduce_sum,
    apply_fsdp2,
    setup_distributed,
)
from palaestra.trainers.torch_backend.fused_logprobs import shifted_linear_logprobs
from palaestra.trainers.torch_backend.kernels import resolve_kernels
from palaestra.trainers.torch_backend.logprobs import shift_values, shifted_token_logprobs
from palaestra.trainers.torch_backend.optim import build_optimizer, build_scheduler

if TYPE_CHECKING:
    from palaestra.trainers.torch_backend.bitwise import BitwiseForward

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

#: architectures whose logits are exactly ``lm_head(last hidden state)`` (no soft-capping or
#: logit scale), so the fused logprob path may skip the logits
_FUSED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                                "mixtral"})

#: ``attn_implementation = "varlen"``: packed rows attend within each sequence through torch's
#: variable-length flash kernel (per-sequence SDPA on CPU); no [tokens, tokens] mask is built
VARLEN = "varlen"
_VARLEN_HF_NAME = "palaestra_varlen"


def _varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs: Any
                      ) -> tuple[torch.Tensor, None]:
    """HF attention function over one packed row: q ``[1, H, T, D]`` -> ``[1, T, H, D]``."""
    from palaestra.trainers.attention import sdpa_thd

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        raise ConfigError("attn_implementation='varlen' needs packed rows (pack_sequences=True)")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):  # HF's q/k norms hand back float32
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = sdpa_thd(q, k, v, cu, kwargs.get("max_length_q"), scale=scaling,
                   dropout_p=dropout if module.training else 0.0)
    return out.view(1, q.shape[0], q.shape[1], -1), None


def resolve_attn_implementation(setting: str | None, device_type: str, packed: bool
                                ) -> str | None:
    """``"auto"``: the varlen flash kernel for packed rows on CUDA (an RL batch of 256 ragged
    sequences on an H200, Qwen3-0.6B shape: train step 0.85 s against 1.89 s with SDPA over a
    block-diagonal mask, which runs the masked kernel over every packed pair), else SDPA."""
    if setting != "auto":
        return setting
    return VARLEN if device_type == "cuda" and packed else "sdpa"


def _register_varlen() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(_VARLEN_HF_NAME, _varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(_VARLEN_HF_NAME, lambda *args, **kwargs: None)
    return _VARLEN_HF_NAME


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _enable_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation checkpointing of every layer (transformers 5 and 4 names)."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)  # the name differs by version
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        getattr(model, "gradient_checkpointing_enable")(  # noqa: B009 - not a Module method
            gradient_checkpointing_kwargs=kwargs)


class TorchBackend:
    """A trainable Hugging Face model with its optimizer, schedule and optional reference copy.

    ``model_path`` is a local directory with a ``from_pretrained`` checkpoint (no downloads are
    attempted when it is a directory).
    """

    def __init__(self, model_path: str | Path, config: TorchBackendConfig | None = None) -> None:
        self.config = config or TorchBackendConfig()
        self.model_path = Path(model_path)
        self.dist: DistInfo = setup_distributed(self.config.device)
        self.device = self.dist.device
        self.attn_implementation = resolve_attn_implementation(
            self.config.attn_implementation, self.device.type, self.config.pack_sequences)
        self.compute_dtype = self._compute_dtype()
        self.param_dtype = _DTYPES[self.config.param_dtype]
        self.fsdp = self.dist.is_distributed and self.config.fsdp == "auto"
        if self.dist.is_distributed and not self.fsdp:
            raise ConfigError(
                "several ranks but fsdp='off': the torch backend shards with FSDP2 only; set "
                "fsdp='auto' or run one process"
            )
        seed_everything(self.config.seed)
        self.lora = None if self.config.critic else self.config.lora
        if self.lora is not None and self.fsdp:
            raise ConfigError("trainer.torch.lora runs on one process here (FSDP2 with a peft "
                              "model is not supported yet): drop torchrun or the lora section")
        bitwise = self.config.on_policy == "bitwise"
        if bitwise and (self.fsdp or self.config.critic):
            raise ConfigError("on_policy = 'bitwise' runs one unsharded policy (no FSDP ranks "
                              "or critic): use 'default'")
        if bitwise and self.lora is not None and self.lora.dropout > 0:
            raise ConfigError("on_policy = 'bitwise' merges the LoRA adapter into the weights, "
                              "where dropout cannot apply: set lora.dropout = 0")
        self.kernels = "torch"  # "liger" once Liger's kernels are patched into the policy
        self.model = self._load_model(self.model_path, trainable=True)
        self.bitwise: BitwiseForward | None = None  # the policy's forward in bitwise mode
        if bitwise:
            from palaestra.trainers.torch_backend.bitwise import BitwiseForward as Forward

            self.bitwise = Forward(self.model, self.compute_dtype)
        self.routing_replay: Any = None  # `RoutingReplay` of the policy when replaying
        if self.config.routing_replay == "rollout":
            from palaestra.trainers.routing_replay import RoutingReplay

            self.routing_replay = RoutingReplay(self.model)
        self.ref_model: torch.nn.Module | None = None
        if self.config.ref_model and self.lora is None:  # LoRA: the adapter-disabled policy
            ref_path = Path(self.config.ref_model_path or self.model_path)
            self.ref_model = self._load_model(ref_path, trainable=False)
        self.teacher_model: torch.nn.Module | None = None  # `load_teacher`: distillation
        self.optimizer = build_optimizer(self.model.parameters(), self.config)
        self.scheduler = build_scheduler(self.optimizer, self.config)
        self.step = 0
        # True in a trainer group (`palaestra.trainers.group`): each rank's batch is already its
        # data-parallel shard (and train_step gets the loss weights of the whole batch)
        self.local_batches = False
        self._last_lr = float(self.optimizer.param_groups[0]["lr"])

    # ---------------------------------------------------------------- construction helpers
    def _compute_dtype(self) -> torch.dtype:
        if self.config.dtype != "auto":
            return _DTYPES[self.config.dtype]
        if self.config.on_policy == "bitwise":  # the embedded engine's dtype on this device
            return torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if self.device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        if self.device.type == "cpu" and not self.dist.is_distributed:
            from palaestra.trainers.torch_backend.kernels import cpu_autocast_dtype

            return cpu_autocast_dtype(self.config.cpu_autocast, self.model_path)
        return torch.float32

    def _load_model(self, path: Path, *, trainable: bool) -> torch.nn.Module:
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"{path} is not a Hugging Face model directory (no config.json); pass a local "
                "directory saved with save_pretrained (or `palaestra init-model`)"
            )
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

        kwargs: dict[str, Any] = {
            "dtype": self.param_dtype,
            "trust_remote_code": self.config.trust_remote_code,
        }
        if self.attn_implementation == VARLEN:
            if not self.config.pack_sequences:
                raise ConfigError("attn_implementation='varlen' attends within packed rows: set "
                                  "pack_sequences=True (or use 'sdpa')")
            kwargs["attn_implementation"] = _register_varlen()
        elif self.attn_implementation:
            kwargs["attn_implementation"] = self.attn_implementation
        if self.config.critic and trainable:
            # the value head starts from a seeded random init; no dropout keeps it deterministic
            hf_config = AutoConfig.from_pretrained(
                str(path), trust_remote_code=self.config.trust_remote_code
            )
            hf_config.num_labels = 1
            hf_config.classifier_dropout = 0.0
            # a causal LM checkpoint has no value head: transformers' load report would print
            # a table of the head's "MISSING" keys into every PPO run's log; the head is meant
            # to start fresh, so that report says nothing a user needs
            from transformers.utils import logging as hf_logging

            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()
            try:
                model = AutoModelForTokenClassification.from_pretrained(
                    str(path), config=hf_config, **kwargs
                )
            finally:
                hf_logging.set_verbosity(verbosity)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        model.config.use_cache = False
        if resolve_kernels(self.config.kernels, self.device,
                           getattr(model.config, "model_type", None)) == "liger":
            from palaestra.trainers.torch_backend.kernels import apply_liger_kernels

            apply_liger_kernels(model)
            if trainable:
                self.kernels = "liger"
        if trainable and self.config.gradient_checkpointing:
            _enable_checkpointing(model)
        if trainable and self.lora is not None:
            from palaestra.trainers.torch_backend.lora import apply_lora

            model = apply_lora(model, self.lora)
        model.to(self.device)
        if self.fsdp:
            mp_dtype = self.compute_dtype if self.compute_dtype != self.param_dtype else None
            apply_fsdp2(
                model, self.dist, param_dtype=mp_dtype,
                reshard_after_forward=self.config.fsdp_reshard_after_forward,
            )
        if trainable:
            model.train()
        else:
            model.eval()
            model.requires_grad_(False)
        return model

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.fsdp or self.compute_dtype == self.param_dtype:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    # ------------------------------------------------------------------------- forwards
    def _run_model(
        self, model: torch.nn.Module, mb: MicroBatch, *, hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[R, L, V]`` (``hidden``: the last hidden states ``[R, L, H]``, the output
        layer skipped) and the valid-position mask ``[R, L]`` of a micro-batch."""
        extra: dict[str, Any] = {}
        if self.attn_implementation == VARLEN:
            lengths = [n for _, _, n in mb.spans]
            cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
            cu = cu.to(self.device, non_blocking=True)
            extra = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths),
                     "max_length_k": max(lengths)}
        if self.routing_replay is not None and model is self.model:
            self.routing_replay.set(mb.routed_experts)  # kept for a backward recompute
        with self._autocast():
            out = (model.get_decoder() if hidden else model)(  # type: ignore[operator]
                input_ids=mb.input_ids,
                position_ids=mb.position_ids,
                attention_mask=mb.attention_mask,
                use_cache=False,
                **extra,
            )
        valid = (mb.seq_index >= 0) & (mb.position_ids > 0)
        return (out.last_hidden_state if hidden else out.logits), valid

    def _fused_head(self, model: torch.nn.Module) -> torch.nn.Linear | None:
        """The output layer when logprobs may come from hidden states; None: use the logits."""
        if not self.config.fused_logprobs or self.fsdp or self.config.critic:
            return None  # FSDP2 gathers the head's weight only inside the root's own forward
        if getattr(model.config, "model_type", None) not in _FUSED_MODEL_TYPES:
            return None
        head = model.get_output_embeddings()  # type: ignore[operator]
        return head if type(head) is torch.nn.Linear else None  # a LoRA-wrapped head: logits

    def _policy_logprobs(
        self, model: torch.nn.Module, mb: MicroBatch, *, with_entropy: bool, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token logprobs ``[R, L]`` (with autograd) and the entropy (differentiable only with
        ``entropy_grad``), by the fused path where it applies, else from the logits."""
        temperature = self.config.logits_temperature
        if self.bitwise is not None and model is self.model:
            return self.bitwise.logprobs(model, mb, temperature=temperature,
                                         with_entropy=with_entropy, entropy_grad=entropy_grad)
        head = self._fused_head(model)
        if head is None:  # chunked float32 work on the logits, recomputed in the backward
            logits, valid = self._run_model(model, mb)
            logp, entropy = shifted_token_logprobs(
                logits, mb.input_ids, valid, with_entropy=with_entropy, temperature=temperature)
        else:
            hidden, valid = self._run_model(model, mb, hidden=True)
            with self._autocast():
                logp, entropy = shifted_linear_logprobs(
                    hidden, head.weight, mb.input_ids, valid, bias_V=head.bias,
                    temperature=temperature, with_entropy=with_entropy,
                    chunk_tokens=self.config.logprob_chunk_tokens,
                )
        if entropy is not None and not entropy_grad:  # a metric: its backward costs nothing
            entropy = entropy.detach()
        return logp, entropy

    def _token_stats(
        self, model: torch.nn.Module, mb: MicroBatch, *, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.config.critic and model is self.model:
            logits, valid = self._run_model(model, mb)
            return shift_values(logits[..., 0].float(), valid), None
        return self._policy_logprobs(model, mb, with_entropy=with_entropy,
                                     entropy_grad=with_entropy)

    def _dummy_micro_batch(self) -> MicroBatch:
        """Two tokens whose result is discarded: keeps FSDP collectives in step across ranks."""
        return build_micro_batch(
            (torch.zeros(2, dtype=torch.long),), [0], pack=self.config.pack_sequences
        )

    def _rank_subset(self, batch: TrainBatch) -> list[int] | None:
        if not self.dist.is_distributed or self.local_batches:
            return None
        parts = split_across_ranks(batch.lengths, self.dist.world_size, units=batch.units())
        return parts[self.dist.rank]

    @torch.no_grad()
    def _forward_all(
        self, batch: TrainBatch, *, ref: bool, with_entropy: bool,
        model: torch.nn.Module | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        adapter_off = ref and self.lora is not None and self.config.ref_model
        if model is not None:  # another frozen model (the teacher)
            ref, adapter_off = False, False
        model = self.model if model is None else model
        if adapter_off:
            pass  # LoRA's reference: the same model with the adapter disabled (no copy)
        elif ref:
            if self.ref_model is None:
                raise ConfigError(
                    "forward_logprobs(ref=True) needs a reference model: set "
                    "TorchBackendConfig(ref_model=True), or precompute ref_logprobs"
                )
            model = self.ref_model
        was_training = model.training
        model.eval()
        micro = make_micro_batches(
            batch, self.config.forward_max_tokens, pack=self.config.pack_sequences, fields={},
            subset=self._rank_subset(batch),
        )
        steps = all_reduce_max_int(len(micro), self.dist)
        local: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for i in range(steps):
            mb = (micro[i] if i < len(micro) else self._dummy_micro_batch()).to(self.device)
            with (self.model.disable_adapter() if adapter_off  # type: ignore[operator]
                  else contextlib.nullcontext()):
                values, entropy = self._token_stats(model, mb, with_entropy=with_entropy)
            if i >= len(micro):
                continue
            ent_parts = mb.unpack(entropy) if entropy is not None else [None] * mb.num_sequences
            for idx, v, e in zip(mb.indices, mb.unpack(values), ent_parts):
                local[idx] = (v.float().cpu(), None if e is None else e.float().cpu())
        if was_training:
            model.train()
        merged: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for part in [local] if self.local_batches else all_gather_objects(local, self.dist):
            merged.update(part)
        logps = [merged[i][0] for i in range(batch.num_sequences)]
        ents = [merged[i][1] for i in range(batch.num_sequences)] if with_entropy else None
        return logps, ents  # type: ignore[return-value]

    def forward_logprobs(self, batch: TrainBatch, *, ref: bool = False) -> list[torch.Tensor]:
        """``log pi(token_t | tokens_<t)`` of every token (0 at position 0), one row per sequence.

        ``ref=True`` uses the frozen reference model. float32 on CPU, aligned with
        ``Sample.logprobs_T``. Under FSDP every rank gets the whole result.
        """
        if self.config.critic and not ref:
            raise ConfigError("this backend is a critic; use forward_values()")
        return self._forward_all(batch, ref=ref, with_entropy=False)[0]

    def full_logprobs(self, token_ids: Sequence[Sequence[int]],
                      positions: Sequence[Sequence[int]]) -> torch.Tensor:
        """The policy's full next-token log-distributions at ``positions[i]`` of sequence
        ``token_ids[i]`` (position t: token t given the ones before it), float32
        ``[sum of positions, V]`` on the CPU, at ``logits_temperature``, from this backend's
        forward (`palaestra.trainers.torch_backend.parity`)."""
        from palaestra.trainers.torch_backend.parity import full_logprobs

        if self.config.critic:
            raise ConfigError("this backend is a critic: it has no next-token distribution")
        if self.fsdp:
            raise ConfigError("full_logprobs runs on one unsharded trainer process")
        return full_logprobs(
            token_ids, positions, model=self.model, device=self.device,
            pack=self.config.pack_sequences, temperature=self.config.logits_temperature,
            bitwise=self.bitwise, autocast=self._autocast,
            hidden_states=lambda mb: self._run_model(self.model, mb, hidden=True)[0])

    def load_teacher(self, path: str | Path) -> None:
        """Load the frozen teacher of on-policy distillation (a Hugging Face folder with the
        policy's vocabulary) on this backend's device, in eval mode, without gradients."""
        if self.fsdp:
            raise ConfigError("distill.teacher runs in one trainer process (the teacher is not "
                              "sharded with FSDP2 here): drop torchrun")
        self.teacher_model = self._load_model(Path(path), trainable=False)

    def forward_teacher_logprobs(self, batch: TrainBatch) -> list[torch.Tensor]:
        """The teacher's ``log p(token_t | tokens_<t)`` of every token of ``batch`` (batched
        no-grad forwards, aligned like `forward_logprobs`); `load_teacher` first."""
        if self.teacher_model is None:
            raise ConfigError("forward_teacher_logprobs() needs load_teacher(path) first")
        return self._forward_all(batch, ref=False, with_entropy=False,
                                 model=self.teacher_model)[0]

    def forward_logprobs_with_entropy(
        self, batch: TrainBatch, *, ref: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Token logprobs and the entropy of each next-token distribution (same alignment)."""
        if self.config.critic and not ref:
            raise ConfigError("this backend is a critic; use forward_values()")
        logps, ents = self._forward_all(batch, ref=ref, with_entropy=True)
        assert ents is not None
        return logps, ents

    def forward_values(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Critic values ``V_t`` (estimated before token ``t``), one tensor per sequence."""
        if not self.config.critic:
            raise ConfigError("forward_values() needs TorchBackendConfig(critic=True)")
        return self._forward_all(batch, ref=False, with_entropy=False)[0]

    # --------------------------------------------------------------------------- training
    def _micro_loss(
        self, mb: MicroBatch, cfg: LossConfig
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        f = mb.fields
        if self.config.critic:
            values, _ = self._token_stats(self.model, mb, with_entropy=False)
            return value_loss_micro(
                cfg, values=values, weights=f[LOSS_WEIGHTS], old_values=f["old_values"],
                returns=f["returns"],
            )
        logp, entropy = self._policy_logprobs(
            self.model, mb, with_entropy=cfg.objective != "dpo",
            entropy_grad=cfg.objective == "rl" and cfg.entropy_coef > 0,
        )
        if cfg.objective == "sft":
            return sft_loss_micro(logp=logp, weights=f[LOSS_WEIGHTS], entropy=entropy)
        if cfg.objective == "dpo":
            return dpo_loss_micro(
                cfg, logp=logp, ref_logp=f["ref_logprobs"], loss_mask=f["loss_mask"],
                seq_index=mb.seq_index, pair_weights=mb.seq_fields[PAIR_WEIGHT][0::2],
            )
        return rl_loss(
            cfg, logp=logp, weights=f[LOSS_WEIGHTS], loss_mask=f["loss_mask"],
            advantages=f["advantages"], old_logp=f.get("old_logprobs"),
            ref_logp=f.get("ref_logprobs"), rollout_logp=f.get("rollout_logprobs"),
            entropy=entropy, seq_index=mb.seq_index,
        )

    def train_step(self, batch: TrainBatch, loss_cfg: LossConfig, *,
                   loss_weights: Sequence[torch.Tensor] | None = None) -> dict[str, float]:
        """One optimizer step on ``batch`` under ``loss_cfg``; returns float metrics.

        ``loss_weights``: per-sequence aggregation weights computed over the whole batch (a
        trainer group's rank gets its shard and these; default: from ``batch`` itself).

        Metrics: ``loss`` and the objective's terms (``actor/pg_loss``, ``actor/kl``,
        ``actor/entropy``, ``actor/clip_frac``, ... aggregated like the loss), ``grad_norm``
        (before clipping), ``lr``, ``num_tokens``, ``num_loss_tokens``, ``num_micro_batches``,
        ``step_time_s``, ``logprobs_s`` (the reference forward inside the step; 0 without).
        """
        start = time.perf_counter()
        critic = self.config.critic
        logprobs_s = 0.0
        has_reference = self.ref_model is not None or (
            self.lora is not None and self.config.ref_model)  # LoRA: the base is the reference
        if runs_ref_forward(batch, loss_cfg, critic=critic, has_reference=has_reference):
            batch = batch.replace(ref_logprobs=self.forward_logprobs(batch, ref=True))
            logprobs_s = time.perf_counter() - start
        micro = loss_micro_batches(
            batch, loss_cfg, critic=critic, max_tokens=self.config.max_tokens_per_micro_batch,
            pack=self.config.pack_sequences, loss_weights=loss_weights,
            sharded=self.local_batches, subset=self._rank_subset(batch))
        steps = all_reduce_max_int(len(micro), self.dist)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        for i in range(steps):
            if self.fsdp:
                self.model.set_requires_gradient_sync(i == steps - 1)  # type: ignore[operator]
            if i < len(micro):
                with span("trainer_data"):
                    mb = micro[i].to(self.device)
                with span("train_compute"):
                    loss, metrics = self._micro_loss(mb, loss_cfg)
            else:  # this rank ran out of data: a zero-loss forward/backward keeps FSDP in step
                logits, _ = self._run_model(self.model, self._dummy_micro_batch().to(self.device))
                loss, metrics = logits.float().sum() * 0.0, {}
            # FSDP2 averages gradients over ranks; the weights already sum to the batch loss
            with span("train_compute"):
                (loss * self.dist.world_size).backward()
            for k, v in metrics.items():
                sums[k] = merge_metric(k, sums[k], float(v))
        with span("optimizer"):
            grad_norm = self._clip_and_step()
        del micro
        release_freed_memory()  # the step's freed activations back to the system (host_memory)
        maxima = {k: sums.pop(k) for k in MAX_METRICS if k in sums}
        result = all_reduce_sum(dict(sums), self.dist)
        result.update(all_reduce_max(maxima, self.dist))
        result.update(grad_norm=grad_norm, lr=self._last_lr, num_micro_batches=float(steps))
        result["num_tokens"] = float(batch.num_tokens)
        result["num_loss_tokens"] = float(batch.num_loss_tokens)
        result["step_time_s"] = time.perf_counter() - start
        result["logprobs_s"] = logprobs_s  # the reference forward inside this step, if any
        return result

    def _clip_and_step(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        self._last_lr = float(self.optimizer.param_groups[0]["lr"])
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        return grad_norm

    # ---------------------------------------------------------------------- weights out
    def state_dict_for_engines(
        self, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """Full weights with Hugging Face names (exactly ``model.state_dict()``'s keys).

        Tied parameters appear under every name (sharing one tensor). The tensors are a
        snapshot: later training steps do not change them. A collective under FSDP2, where only
        rank 0 gets the tensors. ``dtype`` casts floating tensors (e.g. bf16 for SGLang).
        Under LoRA: the base weights with the adapter merged (`adapter_for_engines` is the
        adapter alone).
        """
        if self.lora is not None:
            from palaestra.trainers.torch_backend.lora import merged_state_dict

            merged = merged_state_dict(self.model, dtype=dtype)
            return {k: v.to(device) for k, v in merged.items()} if str(device) != "cpu" \
                else merged
        sd = ckpt.full_state_dict(self.model, self.dist)
        out: dict[str, torch.Tensor] = {}
        copies: dict[int, torch.Tensor] = {}  # data_ptr -> copy, so tied weights stay shared
        for name, tensor in sd.items():
            key = tensor.data_ptr()
            if key not in copies:
                copies[key] = _for_engines(tensor, dtype, device)
            out[name] = copies[key]
        return out

    def iter_engine_weight_buckets(
        self, bucket_bytes: int = 512 << 20, *, dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu", every_rank: bool = False,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """``state_dict_for_engines`` cut into lists of at most ``bucket_bytes`` (>= 1 tensor).

        ``every_rank`` (FSDP2): every rank gets the full tensors, gathered one parameter at a
        time as the buckets are taken (each rank then feeds the engine beside it: the ipc path
        of a colocated trainer group), instead of the whole state dict on rank 0 alone.
        """
        from palaestra.engines.weights.weight_transfer import bucketize

        if every_rank and self.dist.is_distributed:
            if self.lora is not None:
                raise ConfigError("every rank's full weights are not built under LoRA: use "
                                  "engine.weight_sync.kind = 'tensor' for a LoRA trainer group")
            return bucketize(self._gathered_weights(dtype, device), bucket_bytes)
        return bucketize(self.state_dict_for_engines(dtype=dtype, device=device).items(),
                         bucket_bytes)

    def _gathered_weights(self, dtype: torch.dtype | None, device: str | torch.device
                          ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter's full tensor on every rank, in state-dict order (a collective per
        parameter: every rank must take all of them); tied names share one gathered copy."""
        copies: dict[int, torch.Tensor] = {}
        # keep_vars: the Parameter objects themselves, so tied names meet the same object
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            key = id(tensor)
            if key not in copies:
                sharded = hasattr(tensor, "full_tensor")  # a gathered DTensor is a fresh copy
                full = tensor.full_tensor() if sharded else tensor
                copies[key] = _for_engines(full, dtype, device, copy=not sharded)
            yield name, copies[key]

    def adapter_for_engines(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """Under LoRA: (the adapter's tensors under peft's names, its peft config) as a
        snapshot; None under full fine-tuning."""
        if self.lora is None:
            return None
        from palaestra.trainers.torch_backend.lora import adapter_config, adapter_state

        return adapter_state(self.model), adapter_config(self.model)

    # ----------------------------------------------------------------------- checkpoints
    def save(self, directory: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
        """Checkpoint model, optimizer, scheduler, step and RNG into ``directory``."""
        state = {"model_path": str(self.model_path), "config": self.config.model_dump()}
        return ckpt.save_checkpoint(
            directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            step=self.step, info=self.dist, extra={**state, **(extra or {})},
            trainable_only=self.lora is not None,  # LoRA: the adapter, not the frozen base
        )

    def load(self, directory: str | Path) -> dict[str, Any]:
        """Restore a checkpoint written by ``save``; returns its state (``step``, ``extra``)."""
        state = ckpt.load_checkpoint(
            directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            info=self.dist, trainable_only=self.lora is not None,
        )
        self.step = int(state["step"])
        return state

    def export_hf(self, directory: str | Path, *, dtype: torch.dtype | None = None) -> Path:
        """Save a ``from_pretrained``-loadable model and the source tokenizer into ``directory``
        (under LoRA: the base with the adapter merged)."""
        if self.lora is not None:
            return ckpt.export_state_dict(
                directory, self.state_dict_for_engines(dtype=dtype),
                model=self.model.get_base_model(),  # type: ignore[operator]
                source_path=self.model_path)
        return ckpt.export_hf(
            directory, model=self.model, info=self.dist, source_path=self.model_path, dtype=dtype
        )

    def export_adapter(self, directory: str | Path) -> Path:
        """Under LoRA: a peft adapter folder (``PeftModel.from_pretrained(base, directory)``)."""
        if self.lora is None:
            raise ConfigError("export_adapter needs trainer.torch.lora (this is full fine-tuning:"
                              " use export_hf)")
        from palaestra.trainers.torch_backend.lora import save_adapter

        return save_adapter(self.model, directory)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # ------------------------------------------------------------- colocated GPU memory
    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to host memory (while a colocated
        engine serves) and free the GPU cache; `onload` brings them back. No-op on CPU."""
        self._move_state(torch.device("cpu"))

    def onload(self) -> None:
        self._move_state(self.device)

    def _move_state(self, device: torch.device) -> None:
        if self.device.type == "cpu":
            return
        models = [m for m in (self.model, self.ref_model, self.teacher_model) if m is not None]
        for model in models:
            for p in model.parameters():
                p.data = p.data.to(device, non_blocking=True)
                if p.grad is not None:
                    p.grad = p.grad.to(device, non_blocking=True)
            for name, buf in model.named_buffers():
                buf.data = buf.data.to(device, non_blocking=True)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state[key] = value.to(device, non_blocking=True)
        torch.cuda.synchronize()
        if device.type == "cpu":
            torch.cuda.empty_cache()

    def memory(self) -> dict[str, float]:
        """GPU memory of this process (GiB): allocated, reserved, peak allocated (0 on CPU)."""
        if self.device.type != "cuda":
            return {"allocated_gib": 0.0, "reserved_gib": 0.0, "peak_gib": 0.0}
        gib = 1024**3
        return {"allocated_gib": torch.cuda.memory_allocated(self.device) / gib,
                "reserved_gib": torch.cuda.memory_reserved(self.device) / gib,
                "peak_gib": torch.cuda.max_memory_allocated(self.device) / gib}


def _for_engines(tensor: torch.Tensor, dtype: torch.dtype | None, device: str | torch.device,
                 *, copy: bool = True) -> torch.Tensor:
    """The engines' tensor: floating ones cast to ``dtype`` (others keep theirs), on ``device``,
    detached; ``copy`` (a live parameter, which later steps change): never the same memory."""
    target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to(device=device, dtype=target, copy=copy)


__all__ = ["TorchBackend", "seed_everything"]
