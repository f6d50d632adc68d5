"""The SDK against a real server: list the model, train a LoRA client, sample what it learned,
compare sampler and trainer logprobs, and run the RL losses."""

from __future__ import annotations

import math
from typing import Any

import pytest
from tinker_testing import (
    API_KEY,
    BASE,
    COMPLETION,
    PROMPT,
    completion_datum,
    completion_logprobs,
    greedy,
    train_steps,
)


@pytest.fixture(scope="module")
def trained(service: Any) -> tuple[Any, list[float]]:
    client = service.create_lora_training_client(base_model=BASE, rank=32, seed=0).result(
        timeout=60)
    losses = train_steps(client, completion_datum(PROMPT, COMPLETION), 15)
    return client, losses


def test_the_server_lists_its_model(server: Any, model_dir: str) -> None:
    import tinker

    caps = tinker.RestClient(base_url=server.url, api_key=API_KEY).get_server_capabilities(
    ).result(timeout=30)
    names = [m.model_name for m in caps.supported_models]
    assert BASE in names and any(n.endswith("tiny") and n != BASE for n in names)
    assert all(m.trainable and m.sampleable for m in caps.supported_models)


def test_a_lora_client_halves_the_cross_entropy_in_15_steps(trained: Any) -> None:
    client, losses = trained
    info = client.get_info()
    assert info.lora_rank == 32 and info.model_data.model_name == BASE
    final = completion_datum(PROMPT, COMPLETION)
    after = client.forward([final], "cross_entropy").result(timeout=60).metrics["loss:sum"]
    assert after < losses[0] / 2, (losses, after)


def test_the_sampler_reproduces_the_completion_and_matches_the_trainer(trained: Any) -> None:
    from tinker import types

    client, _ = trained
    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    assert greedy(sampler, PROMPT, len(COMPLETION)) == COMPLETION
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), 3,
                         types.SamplingParams(max_tokens=8, temperature=1.0, seed=7, stop=[])
                         ).result(timeout=60)
    assert len(res.sequences) == 3
    for seq in res.sequences:
        trainer_lps = completion_logprobs(client, PROMPT, seq.tokens)
        assert max(abs(a - b) for a, b in zip(seq.logprobs, trainer_lps)) < 0.05
    # compute_logprobs scores the prompt with the same adapter
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + COMPLETION)).result(
        timeout=60)
    assert scored[0] is None
    trainer_lps = completion_logprobs(client, PROMPT, COMPLETION)
    assert max(abs(a - b) for a, b in zip(scored[len(PROMPT):], trainer_lps)) < 0.05


def test_sampling_is_seeded_and_stops_where_asked(trained: Any) -> None:
    from tinker import types

    client, _ = trained
    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, top_k=50, seed=3)
    a = sampler.sample(prompt, 2, params).result(timeout=60)
    b = sampler.sample(prompt, 2, params).result(timeout=60)
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    stop_at = COMPLETION[2]
    res = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0,
                                                         stop=[stop_at])).result(timeout=60)
    assert res.sequences[0].tokens == COMPLETION[:3] and res.sequences[0].stop_reason == "stop"
    top = sampler.sample(types.ModelInput.from_ints(PROMPT + COMPLETION[:2]), 1,
                         types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                         topk_prompt_logprobs=3).result(timeout=60)
    assert top.topk_prompt_logprobs is not None and top.topk_prompt_logprobs[-1][0][0] == \
        COMPLETION[1]


def _rl_datums(sampler: Any, n: int) -> list[Any]:
    """rl_loop.py's datums: sampled tokens, the sampler's logprobs, centred rewards."""
    from tinker import types

    res = sampler.sample(types.ModelInput.from_ints(PROMPT), n,
                         types.SamplingParams(max_tokens=5, temperature=1.0, seed=11, stop=[])
                         ).result(timeout=60)
    rewards = [float(s.tokens[0] % 2) for s in res.sequences]
    mean = sum(rewards) / n
    ob = len(PROMPT) - 1
    datums = []
    for seq, r in zip(res.sequences, rewards):
        ids = PROMPT + seq.tokens[:-1]
        datums.append(types.Datum(
            model_input=types.ModelInput.from_ints(ids),
            loss_fn_inputs={"target_tokens": [0] * ob + seq.tokens,
                            "logprobs": [0.0] * ob + list(seq.logprobs),
                            "advantages": [0.0] * ob + [r - mean + 0.25] * len(seq.tokens)}))
    return datums


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_rl_losses_run_on_sampled_data(service: Any, loss_fn: str) -> None:
    from tinker import types

    client = service.create_lora_training_client(base_model=BASE, rank=8, seed=1).result(
        timeout=60)
    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    datums = _rl_datums(sampler, 4)
    out = client.forward_backward(datums, loss_fn).result(timeout=60)
    assert math.isfinite(out.metrics["loss:sum"]) and len(out.loss_fn_outputs) == 4
    ob = len(PROMPT) - 1
    for datum, lo in zip(datums, out.loss_fn_outputs):
        sampler_lps = datum.loss_fn_inputs["logprobs"].tolist()[ob:]
        trainer_lps = lo["logprobs"].tolist()[ob:]
        assert max(abs(a - b) for a, b in zip(sampler_lps, trainer_lps)) < 0.05
    before = completion_logprobs(client, PROMPT, COMPLETION)
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    assert completion_logprobs(client, PROMPT, COMPLETION) != before


def test_importance_sampling_at_ratio_one_is_the_weighted_cross_entropy(service: Any) -> None:
    """At the sampler's own logprobs the ratio is 1, so the loss is -sum(advantages)."""
    client = service.create_lora_training_client(base_model=BASE, rank=8, seed=2).result(
        timeout=60)
    sampler = client.save_weights_and_get_sampling_client().result(timeout=60)
    datums = _rl_datums(sampler, 2)
    out = client.forward(datums, "importance_sampling").result(timeout=60)
    expected = -sum(sum(d.loss_fn_inputs["advantages"].tolist()) for d in datums)
    assert out.metrics["loss:sum"] == pytest.approx(expected, abs=1e-3)
