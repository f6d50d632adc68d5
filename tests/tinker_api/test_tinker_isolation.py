"""Several training clients on one base model: each trains its own adapter with its own
optimizer, and samplers of every one of them share the engine without mixing them up."""

from __future__ import annotations

import threading
from typing import Any

from tinker_testing import (
    BASE,
    PROMPT,
    completion_datum,
    completion_logprobs,
    greedy,
    train_steps,
)

OTHER = [88, 140, 9, 402, 61, 230]
FIRST = [311, 12, 640, 77, 501, 23]


def test_two_clients_train_at_once_without_touching_each_others_weights(service: Any) -> None:
    # a client trained alone: the reference trajectory
    solo = service.create_lora_training_client(base_model=BASE, rank=32, seed=5).result(
        timeout=60)
    solo_losses = train_steps(solo, completion_datum(PROMPT, FIRST), 12)

    a = service.create_lora_training_client(base_model=BASE, rank=32, seed=5).result(timeout=60)
    b = service.create_lora_training_client(base_model=BASE, rank=16, seed=6).result(timeout=60)
    idle = service.create_lora_training_client(base_model=BASE, rank=8, seed=7).result(
        timeout=60)
    idle_before = completion_logprobs(idle, PROMPT, FIRST)
    results: dict[str, list[float]] = {}

    def run(name: str, client: Any, completion: list[int]) -> None:
        results[name] = train_steps(client, completion_datum(PROMPT, completion), 12)

    threads = [threading.Thread(target=run, args=("a", a, FIRST)),
               threading.Thread(target=run, args=("b", b, OTHER))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    # b's steps interleaved with a's changed nothing of a's: the same losses as alone
    assert results["a"] == solo_losses
    assert results["b"][-1] < results["b"][0] / 2
    # the untouched client still has the base model's logprobs
    assert completion_logprobs(idle, PROMPT, FIRST) == idle_before
    # each sampler serves its own adapter, sampled side by side in one engine
    samplers = [c.save_weights_and_get_sampling_client().result(timeout=60) for c in (a, b)]
    outs: dict[int, list[int]] = {}

    def sample(i: int) -> None:
        outs[i] = greedy(samplers[i], PROMPT, len(FIRST))

    threads = [threading.Thread(target=sample, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert outs[0] == FIRST and outs[1] == OTHER
