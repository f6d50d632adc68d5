"""Train the ``openai``-client shopping agent (agent.py) with GRPO through `AgentEnv`, on the CPU.

    python examples/openai_agent/train.py --out runs/openai-agent

1. Builds the tiny Qwen3-architecture model and tokenizer locally (`palaestra.tiny_model`).
2. Warm start: a short SFT on demonstrations of the agent's own conversations (lookup, calculator,
   answer; a share of them with a wrong final number, so RL has something to fix). The token ids
   are made exactly as the gateway records them (`palaestra.agents.Agent`).
3. GRPO: every step plays ``--tasks`` questions x ``--group`` episodes of `AgentEnv(agent=solve)`
   concurrently through `run_agent_episode` (the agent's own loop, its openai client talking to
   the gateway in front of the embedded `LocalEngine`), turns the recorded samples into a batch
   (`TrainBatch.from_samples`, `compute_advantages` with GRPO), takes one `TorchBackend`
   train step and pushes the weights into the engine.
4. Success rate on held-out questions before and after RL (``eval.jsonl``), the per-step reward
   (``metrics.jsonl``), the final weights (``final/``, loadable by ``palaestra eval``) and
   ``summary.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import agent as shop  # noqa: E402  (the example's agent module, next to this file)


def demo_sample(chat_agent: Any, task: dict[str, Any], rng: random.Random, p_wrong: float) -> Any:
    """Token-exact SFT sample of one ideal conversation (the final number wrong with p_wrong)."""
    from palaestra.rollout.engines.base import Generation
    from palaestra.types import Message

    tok = chat_agent.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    answer = int(task["answer"])
    if rng.random() < p_wrong:
        answer = rng.choice([a for a in range(4, 82) if a != answer])
    turns = [
        ("lookup", {"item": task["item"]}, str(shop.PRICES[task["item"]])),
        ("calculator", {"expression": f"{task['quantity']} * {shop.PRICES[task['item']]}"},
         task["answer"]),
    ]
    chat_agent.start([Message.from_dict(m) for m in shop.initial_messages(task)], shop.TOOLS)
    for name, args, result in turns:
        text = f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'
        ids = list(tok.encode(text, add_special_tokens=False)) + [end]
        message = chat_agent.on_generation(Generation(tuple(ids), (0.0,) * len(ids), "stop"))
        chat_agent.on_observation([Message("tool", result,
                                           tool_call_id=message.tool_calls[0].id)])
    ids = list(tok.encode(f"<answer>{answer}</answer>", add_special_tokens=False)) + [end]
    chat_agent.on_generation(Generation(tuple(ids), (0.0,) * len(ids), "stop"))
    return chat_agent.to_sample(reward=0.0, stop_reason="terminated")


def warm_start(backend: Any, tokenizer: Any, args: argparse.Namespace) -> list[float]:
    from palaestra.agents import make_agent
    from palaestra.trainers.algorithms import LossConfig
    from palaestra.trainers.batching import TrainBatch

    rng = random.Random(args.seed)
    chat_agent = make_agent(tokenizer, "qwen", max_context=2048)
    cfg = LossConfig(preset="sft")
    losses = []
    for step in range(args.sft_steps):
        demos = [demo_sample(chat_agent, shop.make_task(rng.randrange(10**6)), rng, args.p_wrong)
                 for _ in range(args.sft_batch)]
        losses.append(backend.train_step(TrainBatch.from_samples(demos), cfg)["loss"])
        if step % 20 == 0 or step == args.sft_steps - 1:
            print(f"sft {step:4d}  loss {losses[-1]:.3f}", flush=True)
    return losses


async def play(env: Any, chat_agent: Any, engine: Any, sampling: Any, tasks: list[dict],
               group: int, step: int) -> list[Any]:
    from palaestra.rollout.gateway import run_agent_episode

    jobs = [run_agent_episode(env, chat_agent, engine, sampling, task=task,
                              session_id=f"s{step}-{t}-{i}", group_id=f"s{step}-g{t}",
                              env_id="examples/OpenAIShopAgent-v0")
            for t, task in enumerate(tasks) for i in range(group)]
    return list(await asyncio.gather(*jobs))


async def evaluate(env: Any, chat_agent: Any, engine: Any, sampling: Any, n: int,
                   tag: str) -> float:
    tasks = [shop.make_task(10**7 + i) for i in range(n)]  # held out: never trained on
    trajs = await play(env, chat_agent, engine, sampling, tasks, 1, -1)
    rate = sum(t.reward >= 1.0 for t in trajs) / len(trajs)
    errors = sum(t.failed for t in trajs)
    print(f"eval {tag}: success {rate:.3f} over {n} held-out questions ({errors} failed)",
          flush=True)
    return rate


async def main(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from palaestra.agents import load_tokenizer, make_agent
    from palaestra.envs.agent_env import AgentEnv
    from palaestra.rollout.engines.base import SamplingParams
    from palaestra.rollout.engines.local import LocalEngine
    from palaestra.rollout.gateway import close_gateways
    from palaestra.tiny_model import build_model
    from palaestra.trainers.algorithms import LossConfig, compute_advantages
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.torch_backend import TorchBackend, TorchBackendConfig

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    model_dir = args.model or str(build_model(out / "init", "tiny", seed=args.seed))
    tokenizer = load_tokenizer(model_dir)
    backend = TorchBackend(model_dir, TorchBackendConfig(device="cpu", lr=args.sft_lr,
                                                         seed=args.seed))
    sft_losses = warm_start(backend, tokenizer, args) if args.sft_steps else []
    for group in backend.optimizer.param_groups:  # RL with its own learning rate
        group["lr"] = args.lr
    engine = LocalEngine(model_dir, tokenizer=tokenizer, device="cpu", seed=args.seed)
    await engine.update_weights(backend.state_dict_for_engines(), version=0)
    chat_agent = make_agent(tokenizer, "qwen", max_context=1024)
    env = AgentEnv(shop.solve, reward_fn=shop.reward, max_calls=4, timeout_s=300)
    sampling = SamplingParams(max_new_tokens=48, temperature=1.0)
    evals = [{"stage": "sft", "success_rate": await evaluate(
        env, chat_agent, engine, sampling, args.eval_tasks, "after SFT")}]
    cfg = LossConfig(preset="grpo")
    rng = random.Random(args.seed + 1)
    log = (out / "metrics.jsonl").open("w")
    for step in range(args.steps):
        t0 = time.perf_counter()
        tasks = [shop.make_task(rng.randrange(10**6)) for _ in range(args.tasks)]
        trajs = await play(env, chat_agent, engine, sampling, tasks, args.group, step)
        rewards = [t.reward for t in trajs]
        samples = [s for t in trajs if not t.failed for s in t.samples]
        t1 = time.perf_counter()
        metrics: dict[str, float] = {}
        if samples:
            batch = compute_advantages(TrainBatch.from_samples(samples), cfg)
            metrics = backend.train_step(batch, cfg)
            await engine.update_weights(backend.state_dict_for_engines(), version=step + 1)
        row = {"step": step, "phase": "rl", "reward_mean": sum(rewards) / len(rewards),
               "failed": sum(t.failed for t in trajs),
               "prefix_breaks": sum(t.metrics.get("prefix_breaks", 0) for t in trajs),
               "calls_mean": sum(t.metrics.get("calls", 0) for t in trajs) / len(trajs),
               "rollout_s": t1 - t0, "train_s": time.perf_counter() - t1,
               "loss": metrics.get("loss", 0.0)}
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(f"rl {step:3d}  reward {row['reward_mean']:.3f}  calls {row['calls_mean']:.2f}  "
              f"breaks {row['prefix_breaks']:.0f}  rollout {row['rollout_s']:.1f}s  "
              f"train {row['train_s']:.1f}s", flush=True)
    log.close()
    evals.append({"stage": "rl", "success_rate": await evaluate(
        env, chat_agent, engine, sampling, args.eval_tasks, "after RL")})
    (out / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    backend.export_hf(out / "final")
    await close_gateways()
    await engine.close()
    summary = {"sft_final_loss": sft_losses[-1] if sft_losses else None,
               "success_after_sft": evals[0]["success_rate"],
               "success_after_rl": evals[-1]["success_rate"],
               "steps": args.steps, "wall_s": time.perf_counter() - began}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary), flush=True)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/openai-agent")
    p.add_argument("--model", default=None, help="start from this model dir (default: build one)")
    p.add_argument("--sft-steps", type=int, default=120)
    p.add_argument("--sft-batch", type=int, default=16)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--p-wrong", type=float, default=0.5,
                   help="share of demonstrations whose final number is wrong")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps")
    p.add_argument("--tasks", type=int, default=8, help="questions per step")
    p.add_argument("--group", type=int, default=4, help="episodes per question")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-tasks", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
