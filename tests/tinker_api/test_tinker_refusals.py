"""Bad input and unserved features get a 4xx that says why, and the server keeps serving."""

from __future__ import annotations

from typing import Any

import pytest
from tinker_testing import API_KEY, BASE, COMPLETION, PROMPT, completion_datum, greedy

VOCAB = 1024


def _post(url: str, path: str, body: dict[str, Any], key: str = API_KEY) -> Any:
    import httpx

    return httpx.post(url + path, json=body, headers={"X-API-Key": key}, timeout=30)


@pytest.fixture(scope="module")
def client(service: Any) -> Any:
    return service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result(timeout=60)


def test_an_out_of_vocabulary_token_is_refused_and_the_server_keeps_serving(
        service: Any, client: Any) -> None:
    import tinker
    from tinker import types

    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, VOCAB + 5]),
                      loss_fn_inputs={"target_tokens": [2, 3, 4]})
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        client.forward_backward([bad], "cross_entropy").result(timeout=60)
    out = client.forward_backward([completion_datum(PROMPT, COMPLETION)], "cross_entropy"
                                  ).result(timeout=60)
    assert out.metrics["loss:sum"] > 0
    sampler = service.create_sampling_client(base_model=BASE).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        sampler.sample(types.ModelInput.from_ints([VOCAB]), 1,
                       types.SamplingParams(max_tokens=2)).result(timeout=60)
    assert len(greedy(sampler, PROMPT, 3)) == 3


def test_mismatched_lengths_and_missing_inputs_are_refused(client: Any) -> None:
    import tinker
    from tinker import types

    short = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
                        loss_fn_inputs={"target_tokens": [2, 3]})
    with pytest.raises(tinker.BadRequestError, match="same length"):
        client.forward([short], "cross_entropy").result(timeout=60)
    no_adv = types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                         loss_fn_inputs={"target_tokens": [2, 3], "logprobs": [0.0, 0.0]})
    with pytest.raises(tinker.BadRequestError, match="advantages"):
        client.forward_backward([no_adv], "ppo").result(timeout=60)


def test_unserved_losses_and_oversized_batches_are_refused(client: Any) -> None:
    import tinker
    from tinker import types

    datum = completion_datum(PROMPT, COMPLETION)
    with pytest.raises(tinker.BadRequestError, match="stable_reinforce"):
        client.forward_backward([datum], "stable_reinforce").result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="max-batch-datums"):
        client.forward_backward([datum] * 65, "cross_entropy").result(timeout=60)
    long = types.Datum(model_input=types.ModelInput.from_ints([3] * 4100),
                       loss_fn_inputs={"target_tokens": [3] * 4100})
    with pytest.raises(tinker.BadRequestError, match="context|max-batch-tokens"):
        client.forward_backward([long], "cross_entropy").result(timeout=60)


def test_unknown_ids_routes_and_keys_get_4xx(server: Any, service: Any) -> None:
    import tinker

    r = _post(server.url, "/api/v1/optim_step",
              {"model_id": "nope:train:0", "adam_params": {"learning_rate": 0.1}})
    assert r.status_code == 404 and "unknown model_id" in r.json()["error"]
    r = _post(server.url, "/api/v1/retrieve_future", {"request_id": "nope"})
    assert r.status_code == 404
    r = _post(server.url, "/api/v1/save_weights_external", {"model_id": "x"})
    assert r.status_code == 400 and "not served" in r.json()["error"]
    r = _post(server.url, "/api/v1/copy_weights", {})
    assert r.status_code == 404 and "does not serve POST /api/v1/copy_weights" in r.json()["error"]
    r = _post(server.url, "/api/v1/create_session", {}, key="tml-wrong")
    assert r.status_code == 401
    with pytest.raises(tinker.BadRequestError, match="not served"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result(
            timeout=60)


def test_unserved_sampling_options_are_refused(service: Any) -> None:
    import tinker
    from tinker import types

    sampler = service.create_sampling_client(base_model=BASE).result(timeout=60)
    prompt = types.ModelInput.from_ints(PROMPT)
    with pytest.raises(tinker.BadRequestError, match="topk_sample_logprobs"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2),
                       topk_sample_logprobs=2).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="num_samples"):
        sampler.sample(prompt, 17, types.SamplingParams(max_tokens=2)).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="2\\+ tokens"):
        sampler.compute_logprobs(types.ModelInput.from_ints([5])).result(timeout=60)
