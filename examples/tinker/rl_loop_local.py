"""Run tinker-cookbook's ``recipes/rl_loop.py`` against a local ``palaestra tinker-server``.

The recipe is imported and run unchanged (its ``main(Config)``); three things stand in for what
this offline machine cannot download:

- the tokenizer: the tiny model's, registered under the recipe's ``model_name`` with the
  cookbook's own ``register_tokenizer`` (the server serves the model under that name with
  ``--base-model-name``), so the recipe's Qwen3 renderer formats the chat;
- the data set: ``datasets.load_dataset("openai/gsm8k", "main")`` returns a local data set in
  GSM8K's format (``question``, ``answer`` ending in ``#### N``): "Copy this number: N" tasks
  whose answers are skewed (half are 7), so a tiny model can raise its reward in a short run by
  learning the answer distribution (and, with more steps, the copy);
- a warm start: a random-init model never writes ``\\boxed{}``, so the reward would stay 0 and
  every group would be skipped. A few supervised steps teach the answer *format* with random
  digits (no task knowledge: the reward after it is chance, ~10%), then the recipe resumes from
  that state with ``create_training_client_from_state_with_optimizer``, through its own
  checkpoint file (``checkpoint_utils.save_checkpoint``).

    palaestra init-model --out runs/tiny-model --size tiny
    palaestra tinker-server --model runs/tiny-model --port 8000 \\
        --base-model-name Qwen/Qwen3-4B-Instruct-2507
    python examples/tinker/rl_loop_local.py --base-url http://127.0.0.1:8000 \\
        --model-dir runs/tiny-model --log-path runs/rl-loop

The reward per step is in ``<log-path>/metrics.jsonl`` (``reward/total``); the script prints
the first and last steps' mean reward.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

MODEL_NAME = "Qwen/Qwen3-4B-Instruct-2507"
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."


def local_gsm8k(n: int, seed: int, skew: float) -> object:
    """A GSM8K-format data set of copy tasks (the recipe reads ``question`` and ``answer``)."""
    import datasets

    rng = random.Random(seed)
    # skewed, as answers of real data sets are: a share ``skew`` of the tasks are "7"
    digits = [7 if rng.random() < skew else rng.randrange(10) for _ in range(n)]
    rows = {"question": [f"Copy this number: {d}." for d in digits],
            "answer": [f"The number is {d}.\n#### {d}" for d in digits]}
    return datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)})


def warm_start(args: argparse.Namespace, tokenizer: object) -> None:
    """Teach the answer format with random digits, and save the state where the recipe
    resumes from."""
    import tinker
    from tinker import types
    from tinker_cookbook import checkpoint_utils, model_info, renderers

    renderer = renderers.get_renderer(model_info.get_recommended_renderer_name(MODEL_NAME),
                                      tokenizer)
    service = tinker.ServiceClient(base_url=args.base_url)
    client = service.create_lora_training_client(base_model=MODEL_NAME, rank=32, seed=0).result()
    rng = random.Random(1)
    end = renderer.get_stop_sequences()[0]
    for _ in range(args.warm_start_steps):
        batch = []
        for _ in range(16):
            question = f"Copy this number: {rng.randrange(10)}.{SUFFIX}"
            prompt = renderer.build_generation_prompt([{"role": "user", "content": question}])
            reply = tokenizer.encode(f"\\boxed{{{rng.randrange(10)}}}",  # type: ignore[attr-defined]
                                     add_special_tokens=False) + [end]
            ids = prompt.to_ints() + reply
            weights = [0.0] * (prompt.length - 1) + [1.0] * len(reply)
            batch.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                     loss_fn_inputs={"target_tokens": ids[1:],
                                                     "weights": weights}))
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=args.warm_start_lr)).result()
    checkpoint_utils.save_checkpoint(training_client=client, name="warm-start",
                                     log_path=args.log_path, loop_state={"batch": 0},
                                     kind="state")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--log-path", default="runs/rl-loop")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--warm-start-steps", type=int, default=60)
    parser.add_argument("--warm-start-lr", type=float, default=5e-3)
    parser.add_argument("--skew", type=float, default=0.5,
                        help="share of tasks whose answer is 7 (0: uniform digits)")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_API_KEY", "tml-local")

    import datasets
    from tinker_cookbook import tokenizer_utils
    from tinker_cookbook.recipes import rl_loop
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer_utils.register_tokenizer(MODEL_NAME, lambda: tokenizer)
    data = local_gsm8k(args.steps * args.batch_size, seed=0, skew=args.skew)
    datasets.load_dataset = lambda *a, **k: data  # the recipe's only download
    graded: list[tuple[bool, float]] = []  # (the answer is 7, reward), in the recipe's order
    grade = rl_loop.get_reward

    def get_reward(response: str, answer: str) -> float:  # the recipe's reward, observed
        reward = grade(response, answer)
        graded.append((answer.endswith("#### 7"), reward))
        return reward

    rl_loop.get_reward = get_reward
    Path(args.log_path).mkdir(parents=True, exist_ok=True)
    warm_start(args, tokenizer)
    rl_loop.main(rl_loop.Config(
        base_url=args.base_url, log_path=args.log_path, model_name=MODEL_NAME,
        batch_size=args.batch_size, group_size=args.group_size,
        learning_rate=args.learning_rate, lora_rank=32, save_every=0, max_tokens=16,
        ttl_seconds=None, max_steps=args.steps, loss_fn="importance_sampling"))
    rows = [json.loads(line) for line in (Path(args.log_path) / "metrics.jsonl").open()]
    rewards = [r["reward/total"] for r in rows if "reward/total" in r]
    k = max(1, len(rewards) // 5)
    print(f"reward: first {k} steps {sum(rewards[:k]) / k:.3f}, last {k} steps "
          f"{sum(rewards[-k:]) / k:.3f} ({len(rewards)} steps)")
    per_step = args.batch_size * args.group_size
    for label, part in (("first", graded[:k * per_step]), ("last", graded[-k * per_step:])):
        sevens = [r for seven, r in part if seven]
        others = [r for seven, r in part if not seven]
        print(f"{label} {k} steps: reward on '7' tasks {sum(sevens) / max(len(sevens), 1):.3f}, "
              f"on the other tasks {sum(others) / max(len(others), 1):.3f}")


if __name__ == "__main__":
    main()
