"""palaestra vs TRL's GRPOTrainer: wall time per GRPO step and reward, side by side on one machine.

Same model (a locally built ~10M-parameter Qwen3), same prompts (Calculator questions), same
reward (share of digit characters in the reply, a dense reward both can climb), same group size,
batch, completion length, learning rate and number of steps. Each side runs in its own
subprocess, one after the other, with the same thread count; TRL runs with ``--trl-python`` (a
venv where trl is installed, as TRL may pin other transformers versions) or this interpreter.

    python benchmarks/perf/vs_trl.py --steps 3 --json runs/vs_trl.json
    python benchmarks/perf/vs_trl.py --device cuda --json benchmarks/perf/results_vs_trl_gpu.json

On ``--device cuda`` both sides take the GPU workload of ``loop.py`` (a random-init Qwen3-0.6B
shape, 32 prompts x 8, 256 new tokens, lr 1e-5): bf16 compute over fp32 master weights on both
sides (palaestra's torch backend default on CUDA; TRL's ``bf16=True``), HF ``generate`` on the TRL
side (vLLM is not installable there), the embedded engine on ours. ``speedup`` is TRL's mean step
over ours, the first (warm-up) step of each left out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REWARD_SRC = '''
def digit_share(text):
    text = text.strip()
    return sum(c.isdigit() for c in text) / max(1, len(text))
'''

ENV_MODULE = '''
"""Calculator questions, one turn; reward = share of digit characters (benchmark only)."""
import palaestra.envs as envs
from palaestra.envs import Env, StepResult
from palaestra.envs.calculator import make_task
from palaestra.types import Message
''' + REWARD_SRC + '''

class DigitsEnv(Env):
    step_in_thread = False

    def sample_task(self, rng):
        return make_task(rng, 10, 999, 2, ("+", "-", "*"))

    def initial_messages(self, task):
        return [Message("user", task["question"])]

    def on_action(self, action):
        return StepResult(reward=digit_share(action.content), terminated=True)


envs.register("bench/Digits-v0", entry_point=DigitsEnv)
'''

PALAESTRA_SIDE = '''
import json, sys, time
sys.path.insert(0, sys.argv[1])
from palaestra.config import load_config
from palaestra.run.config import TrainConfig
from palaestra.run.train import train
cfg = load_config(TrainConfig, sys.argv[2])
t0 = time.perf_counter()
train(cfg)
rows = [json.loads(l) for l in open(cfg.out + "/metrics.jsonl")]
rl = [r for r in rows if r["phase"] == "rl"]
parts = {"rollout_s": "time/rollout_s", "train_s": "time/train_s", "logprobs_s": "train/logprobs_s",
         "weight_sync_s": "time/weight_sync_s"}
print(json.dumps({"step_s": [r["time/step_s"] for r in rl], "reward": [r["reward_mean"] for r in rl],
                  "breakdown": {k: [r.get(v) for r in rl] for k, v in parts.items()},
                  "total_s": time.perf_counter() - t0}))
'''

TRL_SIDE = '''
import json, sys, time
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
''' + REWARD_SRC + '''
model_dir, out, steps, prompts, group, tokens, lr, seed, _, device = sys.argv[1:11]
steps, prompts, group, tokens = int(steps), int(prompts), int(group), int(tokens)
import numpy as np
rng = np.random.default_rng(int(seed))
sys.path.insert(0, sys.argv[9])
from palaestra.envs.calculator import make_task
rows = [{"prompt": [{"role": "user", "content": make_task(rng, 10, 999, 2, ("+", "-", "*"))["question"]}]}
        for _ in range(prompts * steps)]
def reward(completions, **kw):
    return [digit_share(c[0]["content"] if isinstance(c, list) else c) for c in completions]
class Timer(TrainerCallback):
    def __init__(self): self.t, self.times, self.rewards, self.gen, self.gen_s = None, [], [], [], 0.0
    def on_step_begin(self, args, state, control, **kw): self.t, self.gen_s = time.perf_counter(), 0.0
    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self.t)
        self.gen.append(self.gen_s)
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "reward" in logs: self.rewards.append(logs["reward"])
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
gpu = device == "cuda"
timer = Timer()
hf_generate = model.generate
def timed_generate(*a, **kw):  # the rollout part of TRL's step (HF generate)
    if gpu: torch.cuda.synchronize()
    t = time.perf_counter()
    out = hf_generate(*a, **kw)
    if gpu: torch.cuda.synchronize()
    timer.gen_s += time.perf_counter() - t
    return out
model.generate = timed_generate
cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=prompts * group, num_generations=group,
                 generation_batch_size=prompts * group, max_completion_length=tokens,
                 learning_rate=float(lr), max_steps=steps, logging_steps=1, report_to=[], use_cpu=not gpu,
                 bf16=gpu, save_strategy="no", temperature=1.0, beta=0.0, seed=int(seed),
                 loss_type="grpo", scale_rewards="group")
trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=Dataset.from_list(rows),
                      processing_class=tok, callbacks=[timer])
t0 = time.perf_counter()
trainer.train()
print(json.dumps({"step_s": timer.times, "reward": timer.rewards, "breakdown": {"generate_s": timer.gen},
                  "total_s": time.perf_counter() - t0}))
'''


def _last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no result line in the output:\n{text[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=None, help="default: 3 (cpu), 4 (cuda)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=None, help="default: 128 (cpu), 256 (cuda)")
    parser.add_argument("--size", default=None,
                        help="default: 10m (cpu), qwen3-0.6b (cuda: the real model card; "
                        "qwen3-0.6b-legacy: the shape of the figures before 2026-12-04)")
    parser.add_argument("--lr", type=float, default=None, help="default: 1e-4 (cpu), 1e-5 (cuda)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trl-python", default=sys.executable)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    gpu = args.device == "cuda"
    args.steps = args.steps or (4 if gpu else 3)
    args.tokens = args.tokens or (256 if gpu else 128)
    args.size = args.size or ("qwen3-0.6b" if gpu else "10m")
    args.lr = args.lr or (1e-5 if gpu else 1e-4)

    from palaestra.benchmarks.perf.shapes import build_shape_model

    work = Path(tempfile.mkdtemp(prefix="vs_trl_"))
    # a named shape from its real model card (the padded quickstart tokenizer), *-legacy the
    # shapes of the figures before 2026-12-04, else a tiny_model size
    model_dir = build_shape_model(args.size, work / "model",
                                  max_position_embeddings=2048 if gpu else 1024)
    (work / "bench_digits.py").write_text(ENV_MODULE)
    config = work / "palaestra.toml"
    config.write_text(f'''
out = "{work / "palaestra-run"}"
seed = 0
[model]
path = "{model_dir}"
[env]
id = "bench_digits:bench/Digits-v0"
[agent]
max_context = {2048 if gpu else 1024}
tools_in_prompt = false
drift_rate = 0.0
[rollout]
batch_size = {args.prompts}
group_size = {args.group}
max_new_tokens = {args.tokens}
temperature = 1.0
cluster = "local"
num_workers = 1
[engine]
device = "{args.device}"
max_running = {args.prompts * args.group}
[trainer]
steps = {args.steps}
[trainer.torch]
device = "{args.device}"
lr = {args.lr}
pack_sequences = false
[trainer.loss]
preset = "grpo"
[eval]
num_tasks = 1
[checkpoint]
interval = 1000
[logging]
progress = false
tensorboard = false
''')
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    results: dict[str, Any] = {}
    for name, cmd in (
        ("palaestra", [sys.executable, "-c", PALAESTRA_SIDE, str(work), str(config)]),
        ("trl", [args.trl_python, "-c", TRL_SIDE, str(model_dir), str(work / "trl-run"),
                 str(args.steps), str(args.prompts), str(args.group), str(args.tokens),
                 str(args.lr), "0", str(work), args.device]),
    ):
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            results[name] = {"error": proc.stderr[-1500:]}
            continue
        results[name] = _last_json(proc.stdout)
        results[name]["wall_s"] = time.perf_counter() - start
    print(f"{'system':10s} {'s/step (mean)':>14s} {'s/step (last)':>14s} {'reward first':>13s} {'reward last':>12s}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:10s} ERROR: {r['error'].strip().splitlines()[-1] if r['error'].strip() else ''}")
            continue
        steps, rewards = r["step_s"], r["reward"]
        print(f"{name:10s} {sum(steps) / len(steps):14.2f} {steps[-1]:14.2f} "
              f"{rewards[0]:13.3f} {rewards[-1]:12.3f}")
    if all("step_s" in r for r in results.values()):
        def steady(steps: list[float]) -> float:  # the first step warms up (graphs, allocator)
            kept = steps[1:] or steps
            return sum(kept) / len(kept)

        speedup = steady(results["trl"]["step_s"]) / steady(results["palaestra"]["step_s"])
        results["speedup"] = speedup
        print(f"palaestra is {speedup:.2f}x TRL per step (steady steps: the first left out)")
    results["settings"] = vars(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
