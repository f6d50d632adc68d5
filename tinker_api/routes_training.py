"""Training routes: create_model, get_info, forward_backward, optim_step, unload_model.

Each request is checked first (a bad one gets a 400 and is never queued), then queued on the
training thread and answered with a future id; the result arrives through
``retrieve_future``. Weights and checkpoints are in `palaestra.tinker_api.routes_weights`.
"""

from __future__ import annotations

from aiohttp import web

from palaestra.tinker_api.errors import ApiError
from palaestra.tinker_api.futures import Result
from palaestra.tinker_api.training_ops import (
    adam_step,
    add_model,
    check_optimizer,
    future_answer,
    lora_spec,
)
from palaestra.tinker_api.validate import check_batch
from palaestra.tinker_api.web_io import SERVER_KEY, answer, read_json, read_model
from palaestra.tinker_api.wire import (
    PROTO_CONTENT_TYPE,
    decode_forward_backward,
    decode_forward_backward_json,
    encode_forward_backward_output,
)


async def create_model(request: web.Request) -> web.Response:
    from tinker.types import CreateModelRequest, CreateModelResponse

    server = request.app[SERVER_KEY]
    req = await read_model(request, CreateModelRequest)
    server.registry.session(req.session_id)
    base_model = server.base_model(req.base_model)
    check_optimizer(req.optimizer_config)
    spec = lora_spec(req.lora_config)
    model_id = f"{req.session_id}:train:{req.model_seq_id}"
    if model_id in server.registry.models:
        raise ApiError(f"model {model_id!r} already exists (model_seq_id reused)")
    metadata = {str(k): str(v) for k, v in (req.user_metadata or {}).items()}

    async def work() -> Result:
        await add_model(server, model_id, req.session_id, base_model, spec, metadata)
        return Result(json=CreateModelResponse(model_id=model_id).model_dump(mode="json"))

    return future_answer(server.futures.submit(work()), model_id)


async def get_info(request: web.Request) -> web.Response:
    from tinker.types import GetInfoRequest, GetInfoResponse, ModelData

    server = request.app[SERVER_KEY]
    req = await read_model(request, GetInfoRequest)
    model = server.registry.model(req.model_id)
    arch = server.trainer.architecture
    data = ModelData(arch=arch, model_name=model.base_model, tokenizer_id=server.config.names[-1])
    return answer(GetInfoResponse(model_data=data, model_id=model.model_id, is_lora=True,
                                  lora_rank=model.spec.rank, model_name=model.base_model))


async def forward_backward(request: web.Request) -> web.Response:
    server = request.app[SERVER_KEY]
    if request.content_type == PROTO_CONTENT_TYPE:
        batch = decode_forward_backward(await request.read())
    else:
        batch = decode_forward_backward_json(await read_json(request), forward_only=False)
    server.registry.model(batch.model_id)
    check_batch(batch, server.limits)

    async def work() -> Result:
        outputs, metrics = await server.compute(
            server.trainer.forward_backward, batch.model_id, batch.data, batch.loss_fn,
            batch.loss_fn_config, batch.forward_only)
        return Result(proto=encode_forward_backward_output(outputs, metrics))

    return future_answer(server.futures.submit(work()), batch.model_id)


async def optim_step(request: web.Request) -> web.Response:
    from tinker.types import OptimStepRequest, OptimStepResponse

    server = request.app[SERVER_KEY]
    req = await read_model(request, OptimStepRequest)
    server.registry.model(req.model_id)
    step = adam_step(req.optim_params)

    async def work() -> Result:
        metrics = await server.compute(server.trainer.optim_step, req.model_id, step)
        return Result(json=OptimStepResponse(metrics=metrics).model_dump(mode="json"))

    return future_answer(server.futures.submit(work()), req.model_id)


async def unload_model(request: web.Request) -> web.Response:
    from tinker.types import UnloadModelRequest, UnloadModelResponse

    server = request.app[SERVER_KEY]
    req = await read_model(request, UnloadModelRequest)
    server.registry.model(req.model_id)

    async def work() -> Result:
        await server.compute(server.trainer.remove, req.model_id)
        server.registry.models.pop(req.model_id, None)
        return Result(json=UnloadModelResponse(model_id=req.model_id).model_dump(mode="json"))

    return future_answer(server.futures.submit(work()), req.model_id)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/v1/create_model", create_model)
    app.router.add_post("/api/v1/get_info", get_info)
    app.router.add_post("/api/v1/forward_backward", forward_backward)
    app.router.add_post("/api/v1/optim_step", optim_step)
    app.router.add_post("/api/v1/unload_model", unload_model)


__all__ = ["add_routes"]
