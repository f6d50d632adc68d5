"""Check a Tinker server with the ``tinker`` SDK alone (no palaestra import).

    palaestra init-model --out runs/tiny-model --size tiny
    palaestra tinker-server --model runs/tiny-model --port 8000 &
    python examples/tinker/sdk_check.py --base-url http://127.0.0.1:8000

It lists the models, trains a LoRA client to say a fixed completion, samples it greedily, checks
the sampler's logprobs against the trainer's ``forward``, runs an ``importance_sampling`` step,
sends an out-of-vocabulary token (refused) and trains two clients at once; each check prints its
numbers, and the exit status is 1 if one fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import tinker
from tinker import types

PROMPT = "what is 2 + 3 ?"
COMPLETION = " the answer is 5"
OTHER = " five is the result"


def datum(prompt: list[int], completion: list[int]) -> types.Datum:
    ids = prompt + completion
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": weights})


def train(client: tinker.TrainingClient, d: types.Datum, steps: int, lr: float) -> list[float]:
    losses = []
    for _ in range(steps):
        fwd = client.forward_backward([d], "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fwd.result().metrics["loss:sum"])
        opt.result()
    return losses


def greedy(sampler: tinker.SamplingClient, prompt: list[int], n: int) -> list[int]:
    params = types.SamplingParams(max_tokens=n, temperature=0.0, stop=[])
    return list(sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result()
                .sequences[0].tokens)


def check(name: str, ok: bool, detail: str, failures: list[str]) -> None:
    print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def main() -> int:
    parser = argparse.ArgumentParser(description="check a Tinker server with the SDK")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--base-model", default=None, help="default: the first listed model")
    parser.add_argument("--lr", type=float, default=5e-3)
    args = parser.parse_args()
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    failures: list[str] = []
    t0 = time.perf_counter()

    caps = tinker.RestClient(base_url=args.base_url).get_server_capabilities().result()
    names = [m.model_name for m in caps.supported_models]
    base = args.base_model or names[0]
    check("list models", base in names, f"{names}", failures)

    service = tinker.ServiceClient(base_url=args.base_url)
    client = service.create_lora_training_client(base_model=base, rank=32, seed=0).result()
    tok = client.get_tokenizer()
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    completion = tok.encode(COMPLETION, add_special_tokens=False)
    losses = train(client, datum(prompt, completion), 15, args.lr)
    final = client.forward([datum(prompt, completion)], "cross_entropy").result()
    after = final.metrics["loss:sum"]
    check("cross-entropy halves in 15 steps", after < losses[0] / 2,
          f"{losses[0]:.3f} -> {after:.3f}", failures)

    sampler = client.save_weights_and_get_sampling_client().result()
    got = greedy(sampler, prompt, len(completion))
    check("greedy sample is the completion", got == completion, repr(tok.decode(got)), failures)

    res = sampler.sample(types.ModelInput.from_ints(prompt), 4,
                         types.SamplingParams(max_tokens=8, temperature=1.0, seed=1, stop=[])
                         ).result()
    diff = 0.0
    for seq in res.sequences:
        out = client.forward([datum(prompt, list(seq.tokens))], "cross_entropy").result()
        trainer_lps = out.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1:]
        diff = max(diff, max(abs(a - b) for a, b in zip(seq.logprobs, trainer_lps)))
    check("sampler vs trainer logprobs", diff < 0.05, f"max |diff| {diff:.2e}", failures)

    ob = len(prompt) - 1
    rl = [types.Datum(model_input=types.ModelInput.from_ints(prompt + list(s.tokens[:-1])),
                      loss_fn_inputs={"target_tokens": [0] * ob + list(s.tokens),
                                      "logprobs": [0.0] * ob + list(s.logprobs),
                                      "advantages": [0.0] * ob + [1.0 - i / 2] * len(s.tokens)})
          for i, s in enumerate(res.sequences)]
    out = client.forward_backward(rl, "importance_sampling").result()
    client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    check("importance_sampling step", len(out.loss_fn_outputs) == 4,
          f"loss:sum {out.metrics['loss:sum']:.3f}", failures)

    vocab = len(tok)
    try:
        bad = types.Datum(model_input=types.ModelInput.from_ints([1, vocab + 10]),
                          loss_fn_inputs={"target_tokens": [2, 3]})
        client.forward_backward([bad], "cross_entropy").result()
        check("out-of-vocabulary token refused", False, "accepted", failures)
    except tinker.BadRequestError as exc:
        alive = len(greedy(sampler, prompt, 2)) == 2
        check("out-of-vocabulary token refused", alive, f"{exc.status_code}: "
              f"{exc.body.get('error') if isinstance(exc.body, dict) else exc}; server still "
              f"samples: {alive}", failures)

    solo = service.create_lora_training_client(base_model=base, rank=32, seed=9).result()
    solo_losses = train(solo, datum(prompt, completion), 8, args.lr)
    a = service.create_lora_training_client(base_model=base, rank=32, seed=9).result()
    b = service.create_lora_training_client(base_model=base, rank=16, seed=10).result()
    other = tok.encode(OTHER, add_special_tokens=False)
    results: dict[str, list[float]] = {}
    threads = [threading.Thread(target=lambda: results.__setitem__(
                   "a", train(a, datum(prompt, completion), 8, args.lr))),
               threading.Thread(target=lambda: results.__setitem__(
                   "b", train(b, datum(prompt, other), 8, args.lr)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    same = results["a"] == solo_losses
    check("two clients train at once, isolated", same and results["b"][-1] < results["b"][0],
          f"a's losses identical to a solo run: {same}; b {results['b'][0]:.2f} -> "
          f"{results['b'][-1]:.2f}", failures)
    service.close("success").result()
    print(f"{len(failures)} failed, {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
