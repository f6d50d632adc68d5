"""Weight routes: save_weights (``save_state``), load_weights (``load_state*`` and clients made
from a checkpoint), save_weights_for_sampler (named sampler checkpoints and the snapshots behind
``save_weights_and_get_sampling_client``).

A snapshot is the adapter as it is now, loaded into the engine under its own name with a
sampler id; each training model keeps its last ``--snapshots-kept`` snapshots loaded (an older
one's sampler id answers 404). ``kind="inflight"`` (weights shared by samplers and updated in
place) is refused: every sampler here samples fixed weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from palaestra.tinker_api.errors import ApiError, not_served
from palaestra.tinker_api.futures import Result
from palaestra.tinker_api.registry import Checkpoint, Sampler, TrainingModel, check_name
from palaestra.tinker_api.training_ops import add_model, check_optimizer, future_answer
from palaestra.tinker_api.web_io import SERVER_KEY, read_model

if TYPE_CHECKING:
    from palaestra.tinker_api.server import TinkerServer


def _new_checkpoint(server: TinkerServer, model: TrainingModel, kind: str, name: str | None,
                    overwrite: bool, metadata: dict[str, str] | None) -> Checkpoint:
    name = check_name(name or f"{kind}-{len(model.checkpoints):06d}")
    ckpt = Checkpoint(model.model_id, kind, name,
                      server.registry.checkpoint_dir(model.model_id, kind, name),
                      user_metadata=metadata)
    if ckpt.checkpoint_id in model.checkpoints and not overwrite:
        raise ApiError(f"checkpoint {ckpt.path} exists; pass overwrite=True or another name")
    return ckpt


async def save_weights(request: web.Request) -> web.Response:
    from tinker.types import SaveWeightsRequest, SaveWeightsResponse

    server = request.app[SERVER_KEY]
    req = await read_model(request, SaveWeightsRequest)
    model = server.registry.model(req.model_id)
    ckpt = _new_checkpoint(server, model, "training", req.path, req.overwrite, req.user_metadata)

    async def work() -> Result:
        await server.compute(server.trainer.save, model.model_id, ckpt.directory, optimizer=True)
        model.checkpoints[ckpt.checkpoint_id] = ckpt
        return Result(json=SaveWeightsResponse(path=ckpt.path).model_dump(mode="json"))

    return future_answer(server.futures.submit(work()), model.model_id)


async def load_weights(request: web.Request) -> web.Response:
    from tinker.types import LoadWeightsRequest, LoadWeightsResponse

    from palaestra.tinker_api.trainer import read_spec

    server = request.app[SERVER_KEY]
    req = await read_model(request, LoadWeightsRequest)
    ckpt = server.registry.checkpoint(req.path)
    if ckpt.kind != "training":
        raise ApiError(f"{req.path} is a sampler checkpoint; load_state takes a training "
                       "checkpoint (tinker://.../weights/...)")
    if req.optimizer_config is not None:
        check_optimizer(req.optimizer_config)
    if req.session_id is not None:  # a new training client from the checkpoint
        server.registry.session(req.session_id)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        source = server.registry.models.get(ckpt.model_id)
        base_model = server.base_model(req.base_model or (
            source.base_model if source else server.config.names[0]))
        spec = read_spec(ckpt.directory)
        metadata = {str(k): str(v) for k, v in (req.user_metadata or {}).items()}
    else:
        model_id = str(req.model_id)
        server.registry.model(model_id)

    async def work() -> Result:
        if req.session_id is not None:
            await add_model(server, model_id, str(req.session_id), base_model, spec, metadata)
        await server.compute(server.trainer.load, model_id, ckpt.directory,
                             optimizer=req.optimizer)
        return Result(json=LoadWeightsResponse(path=req.path, model_id=model_id)
                      .model_dump(mode="json"))

    return future_answer(server.futures.submit(work()), model_id)


async def _snapshot(server: TinkerServer, model: TrainingModel, sampler_id: str) -> str:
    """The adapter as it is now, loaded in the engine as a new sampler; old ones unloaded."""
    state, config = await server.compute(server.trainer.export_adapter, model.model_id)
    model.snapshots += 1
    adapter = f"{model.model_id}#{model.snapshots}"
    await server.sampler.load(adapter, state, config)
    server.registry.samplers[sampler_id] = Sampler(sampler_id, model.base_model, adapter)
    mine = [s for s in server.registry.samplers.values()
            if s.adapter and s.adapter.startswith(f"{model.model_id}#") and s.model_path is None]
    for old in mine[:-server.config.snapshots_kept]:
        if await server.sampler.unload(str(old.adapter)):
            server.registry.samplers.pop(old.sampler_id, None)
    return sampler_id


async def save_weights_for_sampler(request: web.Request) -> web.Response:
    from tinker.types import SaveWeightsForSamplerRequest, SaveWeightsForSamplerResponseInternal

    server = request.app[SERVER_KEY]
    req = await read_model(request, SaveWeightsForSamplerRequest)
    model = server.registry.model(req.model_id)
    if req.kind != "snapshot":
        raise not_served(f"kind={req.kind!r} sampling clients", "every sampler of this server "
                         "samples fixed weights; use kind='snapshot'")
    if req.path is None:
        if req.sampling_session_seq_id is None:
            raise ApiError("save_weights_for_sampler needs a path or a sampling_session_seq_id")
        sampler_id = f"{model.session_id}:sample:{req.sampling_session_seq_id}"

        async def snapshot() -> Result:
            await _snapshot(server, model, sampler_id)
            return Result(json=SaveWeightsForSamplerResponseInternal(
                sampling_session_id=sampler_id).model_dump(mode="json"))

        return future_answer(server.futures.submit(snapshot()), model.model_id)
    ckpt = _new_checkpoint(server, model, "sampler", req.path, False, req.user_metadata)

    async def save() -> Result:
        await server.compute(server.trainer.save, model.model_id, ckpt.directory,
                             optimizer=False)
        model.checkpoints[ckpt.checkpoint_id] = ckpt
        return Result(json=SaveWeightsForSamplerResponseInternal(path=ckpt.path)
                      .model_dump(mode="json"))

    return future_answer(server.futures.submit(save()), model.model_id)


async def save_weights_external(request: web.Request) -> web.Response:
    raise not_served("save_weights_external", "external (Hugging Face) exports are not "
                     "written; save_weights_for_sampler writes a peft adapter folder under the "
                     "checkpoint directory")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/v1/save_weights", save_weights)
    app.router.add_post("/api/v1/load_weights", load_weights)
    app.router.add_post("/api/v1/save_weights_for_sampler", save_weights_for_sampler)
    app.router.add_post("/api/v1/save_weights_external", save_weights_external)


__all__ = ["add_routes"]
