"""The steps shared by the training and weight routes: answering a future, reading the SDK's
LoRA and optimizer settings, and registering a training model with its adapter.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from aiohttp import web

from palaestra.tinker_api.errors import ApiError, not_served
from palaestra.tinker_api.registry import TrainingModel
from palaestra.tinker_api.trainer import AdamStep, LoraSpec

if TYPE_CHECKING:
    from tinker.types import LoraConfig, OptimizerConfig, OptimParams

    from palaestra.tinker_api.server import TinkerServer

MAX_RANK = 512


def future_answer(request_id: str, model_id: str | None = None) -> web.Response:
    """The SDK's ``UntypedAPIFuture``."""
    body: dict[str, object] = {"request_id": request_id}
    if model_id is not None:
        body["model_id"] = model_id
    return web.json_response(body)


def check_optimizer(config: OptimizerConfig) -> None:
    """AdamW only (``Dimuon`` and other families are refused)."""
    kind = config.type
    if kind != "adamw":
        raise not_served(f"optimizer {kind!r}", "this server trains with AdamW only")


def lora_spec(config: LoraConfig | None) -> LoraSpec:
    """The SDK's ``LoraConfig`` as a `LoraSpec` (rank checked)."""
    if config is None:
        raise not_served("full fine-tuning (no lora_config)", "this server trains LoRA "
                         "adapters; use create_lora_training_client")
    if not 1 <= config.rank <= MAX_RANK:
        raise ApiError(f"LoRA rank {config.rank} is outside 1..{MAX_RANK}")
    return LoraSpec(config.rank, config.seed, config.train_mlp, config.train_attn,
                    config.train_unembed)


async def add_model(server: TinkerServer, model_id: str, session_id: str, base_model: str,
                    spec: LoraSpec, user_metadata: dict[str, str] | None) -> TrainingModel:
    """Register a training model and build its adapter (on the training thread)."""
    if model_id in server.registry.models:
        raise ApiError(f"model {model_id!r} already exists (model_seq_id reused)")
    if not spec.targets():
        raise ApiError("set at least one of train_mlp, train_attn, train_unembed")
    model = TrainingModel(model_id, session_id, base_model, spec, user_metadata)
    server.registry.models[model_id] = model
    try:
        await server.compute(server.trainer.create, model_id, spec)
    except BaseException:
        server.registry.models.pop(model_id, None)
        raise
    return model


def adam_step(params: OptimParams) -> AdamStep:
    """The SDK's ``AdamParams`` (finite, non-negative learning rate) as an `AdamStep`."""
    from tinker.types import AdamParams

    if not isinstance(params, AdamParams):
        raise not_served(f"optimizer params {getattr(params, 'type', '?')!r}",
                         "this server trains with AdamW only")
    step = AdamStep(params.learning_rate, params.beta1, params.beta2, params.eps,
                    params.weight_decay, params.grad_clip_norm)
    values = (step.learning_rate, step.beta1, step.beta2, step.eps, step.weight_decay,
              step.grad_clip_norm)
    if not all(math.isfinite(v) for v in values) or step.learning_rate < 0 or \
            not (0 <= step.beta1 < 1 and 0 <= step.beta2 < 1) or step.eps <= 0:
        raise ApiError(f"bad AdamParams {params}: finite values, learning_rate >= 0, betas in "
                       "[0, 1), eps > 0")
    return step


__all__ = ["MAX_RANK", "adam_step", "add_model", "check_optimizer", "future_answer", "lora_spec"]
