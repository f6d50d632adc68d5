"""`MegatronBackend`: the megatron-core training backend behind the trainers' backend interface.

Same interface as the PyTorch backend: ``forward_logprobs(batch)``, ``train_step(batch,
loss_cfg)``, ``state_dict_for_engines()``, ``save/load`` and ``export_hf``. A model is built from
an HF config (Qwen2, Qwen3, Llama, Qwen3-MoE, DeepSeek-V3), optionally loaded from HF weights,
wrapped in megatron's DDP with the (distributed) mixed-precision optimizer, and trained with
megatron's forward-backward schedule (so pipeline parallelism works) on packed micro-batches cut by
token count. Losses are the shared pure functions (see `losses`): RL, SFT and DPO for a policy,
the clipped value loss for a critic (``critic=True``: a value head instead of the LM head).

Launch: one process per GPU (``torchrun --nproc-per-node N``); a single GPU needs no launcher.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.errors import CheckpointError, ConfigError
from palaestra.trainers.megatron import losses
from palaestra.trainers.megatron.arch import ModelArch, arch_from_hf_config
from palaestra.trainers.megatron.config import MegatronBackendConfig
from palaestra.trainers.megatron.logprobs import shifted_token_logprobs
from palaestra.trainers.megatron.packed_rope import set_positions
from palaestra.trainers.megatron.parallel import ParallelConfig, init_parallel
from palaestra.trainers.megatron.weight_sync import Bucket, SyncStats, iter_hf_buckets, sync_weights
from palaestra.trainers.megatron.weights import (
    iter_hf_weights,
    load_hf_weights,
    unwrap,
    weight_tensors,
)

if TYPE_CHECKING:
    import torch

    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.micro_batches import MicroBatch


def read_hf_state_dict(model_path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory (``*.safetensors``) on CPU."""
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_path}; is it an HF model dir?")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def torch_empty_like_pinned(tensor: torch.Tensor) -> torch.Tensor:
    """An uninitialised host tensor like ``tensor``, pinned when CUDA is here."""
    import torch

    return torch.empty_like(tensor, pin_memory=torch.cuda.is_available())


def _check_layout(arch: ModelArch, c: MegatronBackendConfig, *, use_te: bool) -> None:
    """Refuse the parallel layouts megatron-core cannot train this architecture with."""
    if c.sequence_parallel and not use_te:
        raise ConfigError("sequence_parallel needs transformer-engine (megatron's torch "
                          "RMSNorm does not support it); install it or unset it")
    if arch.mla is not None and c.tp > 1:
        raise ConfigError("multi-latent attention (DeepSeek-V3) is built with tp = 1 for now "
                          "(its down-projections shard differently); use ep and dp instead")
    if arch.moe is not None and c.tp > 1 and not c.sequence_parallel:
        raise ConfigError("megatron-core trains MoE with tp > 1 only with "
                          "sequence_parallel=True (which needs transformer-engine); "
                          "use ep > 1 with tp=1 instead")


class MegatronBackend:
    """A megatron-core GPT model with optimizer, trained on `TrainBatch` es."""

    def __init__(
        self,
        hf_config: Any,
        cfg: MegatronBackendConfig | None = None,
        *,
        hf_state_dict: Mapping[str, torch.Tensor] | None = None,
        model_path: str | os.PathLike[str] | None = None,
    ) -> None:
        import torch

        from palaestra.trainers.megatron.model import (
            build_gpt_model,
            transformer_config,
            transformer_engine_available,
        )

        self.cfg = cfg or MegatronBackendConfig()
        self.hf_config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        self.arch: ModelArch = arch_from_hf_config(self.hf_config)
        c = self.cfg
        if c.critic:
            self.arch = dataclasses.replace(self.arch, value_head=True)
        self.parallel = ParallelConfig(tp=c.tp, pp=c.pp, ep=c.ep, expert_tp=c.expert_tp,
                                       sequence_parallel=c.sequence_parallel)
        te = transformer_engine_available()
        if c.use_transformer_engine == "on" and not te:
            raise ConfigError("use_transformer_engine='on' but transformer-engine is not installed")
        self.use_te = te and c.use_transformer_engine != "off"
        _check_layout(self.arch, c, use_te=self.use_te)
        init_parallel(self.parallel, seed=c.seed)
        if hf_state_dict is None and model_path is not None:
            hf_state_dict = read_hf_state_dict(model_path)
        dtype = torch.bfloat16 if c.dtype == "bfloat16" else torch.float32
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        replay_fields: dict[str, Any] = {}
        if c.routing_replay == "rollout":
            from palaestra.trainers.routing_replay_megatron import config_overrides

            if self.arch.moe is None:
                raise ConfigError("routing_replay = 'rollout' needs an MoE model; this one is "
                                  "dense: set trainer.routing_replay = 'off'")
            replay_fields = config_overrides()
        self.mconfig = transformer_config(
            self.arch, self.parallel, dtype=dtype,
            use_cpu_initialization=self.device.type == "cpu",
            perform_initialization=hf_state_dict is None, recompute=c.recompute,
            bias_activation_fusion=c.fused_swiglu, **replay_fields,
        )
        # read by SDPAttention (the TransformerConfig has no field for it)
        self.mconfig.palaestra_packed_attention = c.packed_attention
        model = build_gpt_model(self.arch, self.parallel, config=self.mconfig, use_te=self.use_te)
        self.routing_replay: Any = None
        if c.routing_replay == "rollout":
            from megatron.core import parallel_state as ps

            from palaestra.trainers.routing_replay_megatron import MegatronRoutingReplay

            self.routing_replay = MegatronRoutingReplay(
                model, sequence_parallel=c.sequence_parallel,
                tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=c.tp)
        if hf_state_dict is not None:
            load_hf_weights(model, hf_state_dict, self.arch, fused_norms=self.use_te)
        self.model, self.optimizer = self._wrap(model)
        self.step = 0
        # a trainer group's rank: batches are this data-parallel rank's shard already (with the
        # whole batch's loss weights), results are this shard's (`palaestra.trainers.group`)
        self.local_batches = False
        self._ref_weights: list[torch.Tensor] | None = None  # pinned CPU, one per parameter
        self._policy_weights: list[torch.Tensor] | None = None  # the swap's spill space
        if c.ref_model:
            self._ref_weights = self._host_copy()

    @classmethod
    def from_pretrained(
        cls, model_path: str | os.PathLike[str], cfg: MegatronBackendConfig | None = None
    ) -> MegatronBackend:
        """A backend from an HF model directory (config.json + *.safetensors)."""
        config_file = Path(model_path) / "config.json"
        if not config_file.exists():
            raise CheckpointError(f"{config_file} is missing; is {model_path} an HF model dir?")
        return cls(json.loads(config_file.read_text()), cfg, model_path=model_path)

    # construction --------------------------------------------------------------------------
    def _wrap(self, model: Any) -> tuple[Any, Any]:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        c = self.cfg
        ddp = DistributedDataParallel(
            config=self.mconfig,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=c.distributed_optimizer,
            ),
            module=model,
        )
        opt = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=c.lr, min_lr=c.lr * c.min_lr_ratio,
                weight_decay=c.weight_decay, adam_beta1=c.adam_betas[0],
                adam_beta2=c.adam_betas[1], adam_eps=c.adam_eps,
                clip_grad=c.max_grad_norm or 0.0, bf16=self.mconfig.bf16,
                params_dtype=self.mconfig.params_dtype,
                use_distributed_optimizer=c.distributed_optimizer,
            ),
            [ddp],
        )
        self.mconfig.finalize_model_grads_func = finalize_model_grads
        self.mconfig.no_sync_func = ddp.no_sync
        return ddp, opt

    # helpers -------------------------------------------------------------------------------
    @property
    def _dp(self) -> tuple[int, int]:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    def _local_indices(self, batch: TrainBatch) -> list[int]:
        from palaestra.trainers.micro_batches import split_across_ranks

        rank, size = self._dp
        if size == 1 or self.local_batches:
            return list(range(batch.num_sequences))
        return split_across_ranks(batch.lengths, size, units=batch.units())[rank]

    def _token_stats(self, output: torch.Tensor, mb: MicroBatch, with_entropy: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logprobs, entropy) of a policy's logits, or (values, None) of a critic's output."""
        from megatron.core import parallel_state as ps

        from palaestra.trainers.torch_backend.logprobs import shift_values

        if self.cfg.critic:  # V_t is read before token t: 0 at each sequence's first token
            return shift_values(output[..., 0].float(), mb.position_ids > 0), None
        logits = output
        if self.cfg.logits_temperature != 1.0:
            logits = logits / self.cfg.logits_temperature
        tp = ps.get_tensor_model_parallel_world_size()
        return shifted_token_logprobs(
            logits, mb.input_ids, vocab_size=self.arch.vocab_size,
            vocab_start=ps.get_tensor_model_parallel_rank() * logits.shape[-1],
            tp_group=ps.get_tensor_model_parallel_group() if tp > 1 else None,
            with_entropy=with_entropy,
        )

    def _forward(self, model: Any, mb: MicroBatch) -> torch.Tensor:
        import torch
        from megatron.core.packed_seq_params import PackedSeqParams

        lengths = [n for _, _, n in mb.spans]
        ids, pos = mb.input_ids, mb.position_ids
        width = ids.shape[1]
        # sequence parallelism splits the packed row over TP ranks: pad it with a dummy sequence
        pad = (-width) % self.parallel.tp if self.parallel.sequence_parallel else 0
        if pad:
            ids = torch.cat([ids, ids.new_zeros(1, pad)], dim=1)
            pos = torch.cat([pos, torch.arange(pad, device=pos.device)[None]], dim=1)
            lengths = [*lengths, pad]
        cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        cu_dev = cu.to(self.device)
        # Without TE, megatron applies THD RoPE per sequence and reads the boundaries with
        # .tolist(): reading them from a host copy (the "_padded" fields, which only RoPE uses
        # then; there is no padding) saves two device syncs per layer. TE needs device tensors.
        host = None if self.use_te else cu
        packed = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu_dev, cu_seqlens_kv=cu_dev,
            cu_seqlens_q_padded=host, cu_seqlens_kv_padded=host,
            max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths),
        )
        set_positions(unwrap(model), pos[0])  # one RoPE rotation per row (see packed_rope)
        if self.routing_replay is not None:
            self.routing_replay.before_forward(mb.routed_experts, ids.shape[1])
        out = model(input_ids=ids, position_ids=pos, attention_mask=None, packed_seq_params=packed)
        if self.routing_replay is not None:
            self.routing_replay.after_forward()
        if pad and unwrap(model).post_process:
            out = out[:, :width]
        return out

    def _run_schedule(
        self, mbs: list[MicroBatch], loss_fn: Callable[[MicroBatch, torch.Tensor], Any],
        forward_only: bool,
    ) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step_func(data_iterator: Iterator[MicroBatch], model: Any) -> Any:
            mb = next(data_iterator).to(self.device)
            return self._forward(model, mb), partial(loss_fn, mb)

        try:
            return get_forward_backward_func()(
                forward_step_func=step_func, data_iterator=iter(mbs), model=[self.model],
                num_microbatches=len(mbs), seq_length=max(mb.input_ids.shape[1] for mb in mbs),
                micro_batch_size=1, forward_only=forward_only,
            )
        finally:
            if self.routing_replay is not None:
                self.routing_replay.finish()

    # interface -----------------------------------------------------------------------------
    def _forward_all(self, batch: TrainBatch, with_entropy: bool
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from palaestra.trainers.micro_batches import make_micro_batches

        local = self._local_indices(batch)
        result: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        if local:
            mbs = make_micro_batches(batch, self.cfg.forward_max_tokens, pack=True, fields={},
                                     subset=local)

            def collect(mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, Any]:
                logp, ent = self._token_stats(logits, mb, with_entropy=with_entropy)
                ents = mb.unpack(ent) if ent is not None else [None] * len(mb.indices)
                per_seq = {i: (lp.float().cpu(), None if e is None else e.float().cpu())
                           for i, lp, e in zip(mb.indices, mb.unpack(logp), ents)}
                return logits.sum() * 0.0, per_seq

            self.model.eval()
            with torch.no_grad():
                for out in self._run_schedule(mbs, collect, forward_only=True):
                    result.update(out)
            self.model.train()
        gathered: list[Any] = [result]
        if dist.get_world_size() > 1 and not self.local_batches:
            # the last pipeline stage of each DP rank holds results; share them with everyone
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result if ps.is_pipeline_last_stage() else {})
        merged: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for part in gathered:
            merged.update(part)
        logps = [merged[i][0] for i in range(batch.num_sequences)]
        ents = [merged[i][1] for i in range(batch.num_sequences)] if with_entropy else None
        return logps, ents  # type: ignore[return-value]

    # reference policy: weights swapped in from pinned host memory ------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for _, p in sorted(weight_tensors(unwrap(self.model)))]

    def _host_copy(self) -> list[torch.Tensor]:
        import torch

        pin = torch.cuda.is_available()
        return [p.detach().to("cpu", copy=True).pin_memory() if pin
                else p.detach().to("cpu", copy=True) for p in self._params()]

    def _copy_params(self, src: list[torch.Tensor] | None, dst: list[torch.Tensor] | None
                     ) -> None:
        import torch

        params = self._params()
        with torch.no_grad():
            for i, p in enumerate(params):
                if dst is not None:
                    dst[i].copy_(p, non_blocking=True)
                if src is not None:
                    p.copy_(src[i], non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the host buffers are reused: finish before returning

    def _ref_forward(self, batch: TrainBatch, with_entropy: bool
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if self._ref_weights is None:
            raise ConfigError(
                "forward_logprobs(ref=True) needs the reference policy: set "
                "MegatronBackendConfig(ref_model=True) (trainer.megatron.ref_model = true), or "
                "precompute ref_logprobs"
            )
        if self._policy_weights is None:
            self._policy_weights = [torch_empty_like_pinned(t) for t in self._ref_weights]
        self._copy_params(self._ref_weights, self._policy_weights)  # policy out, reference in
        try:
            return self._forward_all(batch, with_entropy=with_entropy)
        finally:
            self._copy_params(self._policy_weights, None)  # the policy back, bit for bit

    def forward_logprobs(self, batch: TrainBatch, *, ref: bool = False) -> list[torch.Tensor]:
        """``log pi(token_t | tokens_<t)`` of every token (0 at position 0), one per sequence.

        float32 on CPU, aligned with ``Sample.logprobs_T``. Collective over the model- and
        data-parallel groups; every rank gets the whole result. ``ref=True`` evaluates the
        reference policy (needs ``ref_model=True``).
        """
        self._refuse_if_critic("forward_logprobs", "forward_values()")
        if ref:
            return self._ref_forward(batch, with_entropy=False)[0]
        return self._forward_all(batch, with_entropy=False)[0]

    def forward_values(self, batch: TrainBatch) -> list[torch.Tensor]:
        """A critic's values ``V_t`` (estimated before token ``t``), float32 on CPU, one per
        sequence (0 at position 0), as TorchBackend.forward_values."""
        if not self.cfg.critic:
            raise ConfigError("forward_values() needs MegatronBackendConfig(critic=True)")
        return self._forward_all(batch, with_entropy=False)[0]

    def _refuse_if_critic(self, what: str, instead: str) -> None:
        if self.cfg.critic:
            raise ConfigError(f"this backend is a critic (a value head, no LM head): {what} "
                              f"does not apply; use {instead}")

    def forward_logprobs_with_entropy(
        self, batch: TrainBatch, *, ref: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Token logprobs and the entropy of each next-token distribution (same alignment)."""
        self._refuse_if_critic("forward_logprobs_with_entropy", "forward_values()")
        logps, ents = (self._ref_forward(batch, with_entropy=True) if ref
                       else self._forward_all(batch, with_entropy=True))
        assert ents is not None
        return logps, ents

    def train_step(self, batch: TrainBatch, loss_cfg: LossConfig, *,
                   loss_weights: Sequence[torch.Tensor] | None = None) -> dict[str, float]:
        """One optimizer step on ``batch`` under ``loss_cfg`` (an algorithms.LossConfig).

        Returns the batch-level metrics (summed over micro-batches and data-parallel ranks) plus
        ``grad_norm``, ``lr`` and ``update_ok``. ``loss_weights``: per-sequence aggregation
        weights computed over the whole batch (a trainer group's rank gets its shard and these).
        """

        from palaestra.trainers.loss_inputs import loss_micro_batches, runs_ref_forward
        from palaestra.trainers.torch_backend.optim import lr_multiplier

        start = time.perf_counter()
        critic = self.cfg.critic
        logprobs_s = 0.0
        if runs_ref_forward(batch, loss_cfg, critic=critic,
                            has_reference=self._ref_weights is not None):
            batch = batch.replace(ref_logprobs=self.forward_logprobs(batch, ref=True))
            logprobs_s = time.perf_counter() - start
        local = self._local_indices(batch)
        mbs = loss_micro_batches(
            batch, loss_cfg, critic=critic, max_tokens=self.cfg.max_tokens_per_micro_batch,
            pack=True, loss_weights=loss_weights, sharded=self.local_batches, subset=local)
        if not local:  # the batch was still checked; this rank has nothing to train on
            mbs = []
        if not mbs:
            raise ConfigError("this data-parallel rank got no sequences; use a bigger batch")
        # the schedule divides each micro-batch loss by their number and DDP averages over DP;
        # the shared losses are already normalised over the whole batch, so undo both.
        scale = float(len(mbs) * self._dp[1])
        with_entropy = losses.needs_entropy(loss_cfg) and not critic

        def loss_fn(mb: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, Any]:
            stats, entropy = self._token_stats(output, mb, with_entropy)
            if critic:
                loss, metrics = losses.critic_loss(loss_cfg, mb, stats)
            else:
                loss, metrics = losses.micro_batch_loss(loss_cfg, mb, stats, entropy)
            return loss * scale, {k: v.detach().float() for k, v in metrics.items()}

        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * lr_multiplier(self.step, self.cfg)  # type: ignore[arg-type]
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outs = self._run_schedule(mbs, loss_fn, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        self.step += 1
        metrics = self._reduced_metrics(outs)
        metrics.update(grad_norm=float(grad_norm or 0.0), update_ok=float(bool(ok)),
                       lr=float(self.optimizer.param_groups[0]["lr"]),
                       # the bookkeeping keys TorchBackend reports, which the loop logs
                       num_tokens=float(batch.num_tokens),
                       num_loss_tokens=float(batch.num_loss_tokens),
                       num_micro_batches=float(len(mbs)),
                       step_time_s=time.perf_counter() - start,
                       logprobs_s=logprobs_s)  # the reference forward inside this step
        return metrics

    def _reduced_metrics(self, outs: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """The micro-batches' metrics summed (maxed: `MAX_METRICS`) over micro-batches,
        data-parallel ranks and pipeline stages."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from palaestra.trainers.algorithms.objective import MAX_METRICS

        names = sorted({k for o in outs for k in o})
        if ps.get_pipeline_model_parallel_world_size() > 1:
            # only the last stage computed losses: take its metric names everywhere
            all_names: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
            dist.all_gather_object(all_names, names, group=ps.get_pipeline_model_parallel_group())
            names = max(all_names, key=len)
        zero = torch.zeros((), device=self.device)
        maxed = [k for k in names if k in MAX_METRICS]  # e.g. the largest logprob mismatch
        names = [k for k in names if k not in MAX_METRICS]
        sums = torch.stack([sum((o[k] for o in outs if k in o), zero) for k in names]) \
            if names else torch.zeros(0, device=self.device)
        maxima = torch.stack([torch.stack([o[k] for o in outs if k in o] or [zero]).max()
                              for k in maxed]) if maxed else torch.zeros(0, device=self.device)
        if ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(sums, group=ps.get_data_parallel_group())
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(sums, group=ps.get_pipeline_model_parallel_group())
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX,
                            group=ps.get_pipeline_model_parallel_group())
        metrics = {k: float(v) for k, v in zip(names, sums.tolist())}
        metrics.update({k: float(v) for k, v in zip(maxed, maxima.tolist())})
        return metrics

    def state_dict_for_engines(
        self, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """Full weights under HF names (the HF model's ``state_dict()`` keys), a snapshot.

        Tied models list ``lm_head.weight`` too, sharing the embedding's tensor. Collective over
        TP/EP; with PP each stage returns its own layers. ``dtype`` casts (e.g. bf16 for SGLang).
        """
        self._refuse_if_critic("engine weights", "export_hf() to save the value model")
        out: dict[str, torch.Tensor] = {}
        for name, tensor in iter_hf_weights(self.model, self.arch):
            out[name] = tensor.detach().to(device=device, dtype=dtype or tensor.dtype, copy=True)
        if self.arch.tie_embeddings and "model.embed_tokens.weight" in out:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def iter_engine_weight_buckets(
        self, bucket_bytes: int = 512 << 20, *, dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> Iterator[Bucket]:
        """HF-named full tensors in buckets of at most ``bucket_bytes``, streamed on the device.

        Not snapshots: consume each bucket before the next train_step. Tied heads appear once
        (as ``model.embed_tokens.weight``), as in HF checkpoints.
        """
        self._refuse_if_critic("engine weights", "export_hf() to save the value model")
        return iter_hf_buckets(self.model, self.arch, bucket_bytes=bucket_bytes, dtype=dtype,
                               device=device)

    def sync_weights(self, consumer: Callable[[Bucket], None], bucket_bytes: int = 1 << 30
                     ) -> SyncStats:
        """Push the weights to ``consumer`` bucket by bucket and time it (see weight_sync)."""
        self._refuse_if_critic("weight sync", "export_hf() to save the value model")
        return sync_weights(self.model, self.arch, consumer, bucket_bytes=bucket_bytes)

    # checkpoints ---------------------------------------------------------------------------
    def _rank_dir(self, path: Path) -> Path:
        from megatron.core import parallel_state as ps

        return path / (f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
                       f"_{ps.get_pipeline_model_parallel_rank():03d}"
                       f"_{ps.get_expert_model_parallel_rank():03d}")

    def _inner_optimizers(self) -> list[Any]:
        """The torch optimizers over this rank's (fp32 main) parameter shards."""
        chained = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        return [o.optimizer for o in chained]

    def save(self, path: str | os.PathLike[str], *, extra: dict[str, Any] | None = None) -> Path:
        """Model, optimizer state, fp32 main weights and step; a directory per model rank.

        The optimizer file is per data-parallel rank (the distributed optimizer shards it), so
        `load` needs the same parallel layout.
        """
        import torch
        from megatron.core import parallel_state as ps

        root = Path(path)
        rank_dir = self._rank_dir(root)
        rank_dir.mkdir(parents=True, exist_ok=True)
        dp_rank = ps.get_data_parallel_rank()
        if dp_rank == 0:
            torch.save({"model": unwrap(self.model).state_dict(), "step": self.step,
                        "extra": extra or {}}, rank_dir / "model.pt")
        inner = self._inner_optimizers()
        torch.save({
            "state": [o.state_dict() for o in inner],
            "main": [[p.detach().cpu() for g in o.param_groups for p in g["params"]]
                     for o in inner],
        }, rank_dir / f"optim_dp{dp_rank:03d}.pt")
        if dp_rank == 0 and ps.get_tensor_model_parallel_rank() == 0:
            (root / "config.json").write_text(json.dumps(self.hf_config, indent=1, default=str))
        return root

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore what `save` wrote (same parallel layout); returns ``step`` and ``extra``."""
        import torch
        from megatron.core import parallel_state as ps

        rank_dir = self._rank_dir(Path(path))
        model_file = rank_dir / "model.pt"
        optim_file = rank_dir / f"optim_dp{ps.get_data_parallel_rank():03d}.pt"
        for f in (model_file, optim_file):
            if not f.exists():
                raise CheckpointError(f"{f} is missing; was it saved with this parallel layout?")
        state = torch.load(model_file, map_location="cpu", weights_only=False)
        optim = torch.load(optim_file, map_location="cpu", weights_only=False)
        inner = self._inner_optimizers()
        if len(optim["state"]) != len(inner):
            raise CheckpointError(f"{optim_file} holds {len(optim['state'])} optimizers, "
                                  f"this run has {len(inner)}")
        with torch.no_grad():
            unwrap(self.model).load_state_dict(state["model"], strict=True)
            for o, o_state, mains in zip(inner, optim["state"], optim["main"]):
                params = [p for g in o.param_groups for p in g["params"]]
                if [tuple(p.shape) for p in params] != [tuple(m.shape) for m in mains]:
                    raise CheckpointError(f"{optim_file} was saved with another layout")
                for p, m in zip(params, mains):
                    p.copy_(m)
                o.load_state_dict(o_state)
        self.step = int(state["step"])
        extra = state.get("extra", {})
        return {**extra, "step": self.step, "extra": extra}  # extras at the top, as TorchBackend

    def export_hf(self, path: str | os.PathLike[str], *, dtype: torch.dtype | None = None,
                  shard_bytes: int = 4 << 30) -> Path:
        """Write an HF checkpoint (safetensors shards + index + config.json) of the current weights.

        Collective; only global rank 0 writes. Pipeline parallelism: not yet (each stage holds
        its own layers).
        """
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from safetensors.torch import save_file

        if ps.get_pipeline_model_parallel_world_size() > 1:
            raise ConfigError("export_hf does not support pp > 1 yet; save() and convert offline")
        out = Path(path)
        writer = dist.get_rank() == 0
        if writer:
            out.mkdir(parents=True, exist_ok=True)
        index: dict[str, str] = {}
        buckets = iter_hf_buckets(self.model, self.arch, bucket_bytes=shard_bytes, dtype=dtype)
        for k, bucket in enumerate(buckets):
            if not writer:
                continue
            name = f"model-{k:05d}.safetensors"
            save_file({n: t.detach().contiguous().cpu() for n, t in bucket}, str(out / name),
                      metadata={"format": "pt"})
            index.update({n: name for n, _ in bucket})
        if writer:
            (out / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": index}, indent=1))
            (out / "config.json").write_text(json.dumps(self._export_config(), indent=1,
                                                        default=str))
        return out

    def _export_config(self) -> dict[str, Any]:
        """The HF config of the export: a critic is an ``*ForTokenClassification`` of one label."""
        if not self.cfg.critic:
            return self.hf_config
        causal = (self.hf_config.get("architectures") or ["ForCausalLM"])[0]
        head = causal.replace("ForCausalLM", "ForTokenClassification")
        labels = {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
        return {**self.hf_config, **labels, "architectures": [head],
                "classifier_dropout": 0.0, "tie_word_embeddings": False}

    def num_parameters(self) -> int:
        """Parameters of the full model (all ranks together), as the HF model counts them."""
        from palaestra.trainers.megatron.flops import param_count

        return param_count(self.arch).total
