"""Datums and steps the SDK tests share (SDK types only)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: the key the test server requires, and the name it serves the tiny model under
API_KEY = "tml-palaestra-test"
BASE = "palaestra/tiny"
PROMPT = [5, 17, 42, 99, 7]
COMPLETION = [311, 12, 640, 77, 501, 23]


def completion_datum(prompt: Sequence[int], completion: Sequence[int]) -> Any:
    """Next-token targets over prompt + completion, weighted on the completion only."""
    from tinker import types

    ids = [*prompt, *completion]
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": weights})


def train_steps(client: Any, datum: Any, steps: int, lr: float = 5e-3) -> list[float]:
    """``steps`` cross-entropy steps on one datum; the loss before each step."""
    from tinker import types

    losses = []
    for _ in range(steps):
        fwd = client.forward_backward([datum], "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fwd.result(timeout=60).metrics["loss:sum"])
        opt.result(timeout=60)
    return losses


def completion_logprobs(client: Any, prompt: Sequence[int], completion: Sequence[int]
                        ) -> list[float]:
    """The trainer's ``forward`` logprobs of the completion tokens."""
    out = client.forward([completion_datum(prompt, completion)], "cross_entropy").result(
        timeout=60)
    logprobs = out.loss_fn_outputs[0]["logprobs"].tolist()
    return logprobs[len(prompt) - 1:]


def greedy(sampler: Any, prompt: Sequence[int], n_tokens: int) -> list[int]:
    """The greedy continuation (EOS does not stop it)."""
    from tinker import types

    params = types.SamplingParams(max_tokens=n_tokens, temperature=0.0, stop=[])
    res = sampler.sample(types.ModelInput.from_ints(list(prompt)), 1, params).result(timeout=60)
    return list(res.sequences[0].tokens)
