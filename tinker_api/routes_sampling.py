"""Sampling routes: sampling sessions (base model or a sampler checkpoint), ``asample`` and
``compute_logprobs`` (a one-token sample that returns the prompt's logprobs).

Served: ``num_samples``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``
(strings or token ids), ``seed``, per-token logprobs of the samples, prompt logprobs (all or the
last n) and top-k prompt logprobs. Refused with a 400: top-k logprobs of sampled tokens,
``target_prompt_logprobs``, ``prompt_alt_tokens_k`` and ``record_stability_info``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from palaestra.tinker_api.errors import ApiError, not_served
from palaestra.tinker_api.futures import Result
from palaestra.tinker_api.registry import Sampler
from palaestra.tinker_api.sampler import SampleSpec
from palaestra.tinker_api.validate import check_sample
from palaestra.tinker_api.web_io import SERVER_KEY, answer, read_model
from palaestra.tinker_api.wire import encode_sample_response

if TYPE_CHECKING:
    from tinker.types import SampleRequest

    from palaestra.tinker_api.server import TinkerServer

DEFAULT_MAX_TOKENS = 256


async def _sampler_for_path(server: TinkerServer, model_path: str, sampler_id: str) -> Sampler:
    """A sampler checkpoint's adapter, loaded into the engine once."""
    ckpt = server.registry.checkpoint(model_path)
    source = server.registry.models.get(ckpt.model_id)
    adapter = f"{ckpt.model_id}/{ckpt.checkpoint_id}"
    await server.sampler.load_folder(adapter, str(ckpt.directory))
    base = source.base_model if source else server.config.names[0]
    return Sampler(sampler_id, base, adapter, model_path)


async def create_sampling_session(request: web.Request) -> web.Response:
    from tinker.types import CreateSamplingSessionRequest, CreateSamplingSessionResponse

    server = request.app[SERVER_KEY]
    req = await read_model(request, CreateSamplingSessionRequest)
    server.registry.session(req.session_id)
    sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
    if req.model_path:
        sampler = await _sampler_for_path(server, req.model_path, sampler_id)
    else:
        sampler = Sampler(sampler_id, server.base_model(req.base_model), None)
    server.registry.samplers[sampler_id] = sampler
    return answer(CreateSamplingSessionResponse(sampling_session_id=sampler_id))


async def join_sampling_session(request: web.Request) -> web.Response:
    from tinker.types import JoinSamplingSessionRequest, JoinSamplingSessionResponse

    server = request.app[SERVER_KEY]
    req = await read_model(request, JoinSamplingSessionRequest)
    server.registry.sampler(req.sampling_session_id)
    session = server.registry.session(req.sampling_session_id.split(":")[0])
    session.sampler_clients += 1
    return answer(JoinSamplingSessionResponse(client_counter=session.sampler_clients))


async def get_sampler(request: web.Request) -> web.Response:
    from tinker.types import GetSamplerResponse

    sampler = request.app[SERVER_KEY].registry.sampler(request.match_info["sampler_id"])
    return answer(GetSamplerResponse(sampler_id=sampler.sampler_id,
                                     base_model=sampler.base_model,
                                     model_path=sampler.model_path))


def _refuse_unserved(req: SampleRequest) -> None:
    if req.topk_sample_logprobs:
        raise not_served("topk_sample_logprobs", "the engine returns the sampled token's "
                         "logprob only")
    if req.target_prompt_logprobs is not None:
        raise not_served("target_prompt_logprobs", "use include_prompt_logprobs or "
                         "topk_prompt_logprobs")
    if req.prompt_alt_tokens_k:
        raise not_served("prompt_alt_tokens_k", "prompt positions are not re-sampled")
    if req.record_stability_info:
        raise not_served("record_stability_info", "no stability information is recorded")


async def asample(request: web.Request) -> web.Response:
    from tinker.types import SampleRequest

    server = request.app[SERVER_KEY]
    req = await read_model(request, SampleRequest)
    _refuse_unserved(req)
    if req.sampling_session_id is not None:
        sampler = server.registry.sampler(req.sampling_session_id)
    elif req.model_path:
        sampler = await _sampler_for_path(server, req.model_path, "")
    else:
        sampler = Sampler("", server.base_model(req.base_model), None)
    try:
        prompt = req.prompt.to_ints()
    except ValueError as exc:
        raise not_served("non-text prompt chunks", "the served models take text tokens "
                         "only") from exc
    params = req.sampling_params
    spec = SampleSpec(params.max_tokens if params.max_tokens is not None else DEFAULT_MAX_TOKENS,
                      params.temperature, params.top_p, params.top_k, params.seed, params.stop,
                      bool(req.prompt_logprobs), req.topk_prompt_logprobs,
                      req.prompt_logprobs_last_n)
    check_sample(prompt, req.num_samples, spec.max_tokens, server.limits)
    last_n = spec.prompt_logprobs_last_n
    if (spec.prompt_logprobs or spec.topk_prompt_logprobs) and (
            len(prompt) < 2 or (last_n is not None and not 1 <= last_n < len(prompt))):
        raise ApiError(f"prompt logprobs need a prompt of 2+ tokens and prompt_logprobs_last_n "
                       f"within 1..{len(prompt) - 1} (prompt: {len(prompt)} tokens)")
    if spec.topk_prompt_logprobs < 0 or spec.topk_prompt_logprobs > server.limits.vocab_size:
        raise ApiError(f"topk_prompt_logprobs {spec.topk_prompt_logprobs} is outside "
                       f"0..{server.limits.vocab_size}")

    async def work() -> Result:
        out = await server.sampler.sample(prompt, req.num_samples, spec, sampler.adapter)
        return Result(proto=encode_sample_response(out))

    rid = server.futures.submit(work())
    ids = [f"{rid}:{i}" for i in range(req.num_samples)]
    return web.json_response({"request_id": rid, "sample_sequence_ids": ids})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/v1/create_sampling_session", create_sampling_session)
    app.router.add_post("/api/v1/join_sampling_session", join_sampling_session)
    app.router.add_get("/api/v1/samplers/{sampler_id}", get_sampler)
    app.router.add_post("/api/v1/asample", asample)


__all__ = ["add_routes"]
