"""save_state / load_state (with the optimizer), clients made from a checkpoint, sampler
checkpoints and checkpoint listing."""

from __future__ import annotations

import warnings
from typing import Any

from tinker_testing import (
    API_KEY,
    BASE,
    COMPLETION,
    PROMPT,
    completion_datum,
    greedy,
    train_steps,
)


def test_a_client_resumed_with_its_optimizer_continues_the_same_trajectory(
        server: Any, service: Any) -> None:
    import tinker

    datum = completion_datum(PROMPT, COMPLETION)
    a = service.create_lora_training_client(base_model=BASE, rank=8, seed=3).result(timeout=60)
    train_steps(a, datum, 3)
    saved = a.save_state("after-3").result(timeout=60)
    assert saved.path == f"tinker://{a.model_id}/weights/after-3"
    straight = train_steps(a, datum, 3)

    resumed = service.create_training_client_from_state_with_optimizer(saved.path).result(
        timeout=60)
    assert resumed.model_id != a.model_id and resumed.get_info().lora_rank == 8
    assert train_steps(resumed, datum, 3) == straight

    with warnings.catch_warnings():  # load_state is deprecated in the SDK, still served
        warnings.simplefilter("ignore")
        a.load_state_with_optimizer(saved.path).result(timeout=60)
    assert train_steps(a, datum, 3) == straight

    weights_only = service.create_training_client_from_state(saved.path).result(timeout=60)
    assert train_steps(weights_only, datum, 1)[0] == straight[0]  # same weights, fresh Adam

    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    listed = rest.list_checkpoints(a.model_id).result(timeout=30)
    assert [c.tinker_path for c in listed.checkpoints] == [saved.path]
    assert listed.checkpoints[0].checkpoint_type == "training"
    info = rest.get_weights_info_by_tinker_path(saved.path).result(timeout=30)
    assert info.lora_rank == 8 and info.base_model == BASE and info.train_unembed
    run = rest.get_training_run(a.model_id).result(timeout=30)
    assert run.base_model == BASE and run.last_checkpoint is not None


def test_a_sampler_checkpoint_serves_a_new_sampling_client(service: Any) -> None:
    client = service.create_lora_training_client(base_model=BASE, rank=32, seed=0).result(
        timeout=60)
    train_steps(client, completion_datum(PROMPT, COMPLETION), 15)
    path = client.save_weights_for_sampler("final").result(timeout=60).path
    assert path.endswith("/sampler_weights/final")
    sampler = service.create_sampling_client(model_path=path).result(timeout=60)
    assert sampler.get_base_model() == BASE
    assert greedy(sampler, PROMPT, len(COMPLETION)) == COMPLETION
    base = service.create_sampling_client(base_model=BASE).result(timeout=60)
    assert greedy(base, PROMPT, len(COMPLETION)) != COMPLETION
