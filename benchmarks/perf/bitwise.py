"""The cost of bitwise on-policy mode: engine throughput, train step and the logprob gap, default
vs bitwise side by side on one model and device.

Launch from the repository root::

    python -m palaestra.benchmarks.perf.bitwise --size small --json out.json          # CPU
    python -m palaestra.benchmarks.perf.bitwise --model DIR --device cuda --json out.json
    python -m palaestra.benchmarks.perf.bitwise --size qwen3-0.6b --device cuda --json out.json

``--size qwen3-0.6b`` builds Qwen3-0.6B's real model card (head_dim 128, the 151,936-entry
vocabulary: `palaestra.benchmarks.perf.shapes`); ``qwen3-0.6b-legacy`` the shape of the figures
before 2026-12-04.

For each mode (``default``: each side's fast kernels; ``bitwise``: the shared batch-invariant
forward, `palaestra.engines.bitwise.forward`) it builds a `LocalEngine`, samples
``--requests`` random prompts x ``--new-tokens`` tokens at temperature 1 (all submitted at once,
after one warm-up call), then hands the sampled sequences to a `TorchBackend` of the same mode:
the largest |trainer - engine| logprob over the sampled tokens, and the median of ``--steps``
GRPO train steps on them. Printed as a table, written as JSON with the bitwise/default ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


async def _sample(engine: Any, prompts: list[list[int]], new_tokens: int
                  ) -> tuple[list[Any], float]:
    from palaestra.engine import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    await engine.generate(prompts[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    out = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return list(out), time.perf_counter() - start


def _batch(prompts: list[list[int]], gens: list[Any]) -> Any:
    import torch

    from palaestra.trainers.batching import TrainBatch

    ids: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    adv: list[torch.Tensor] = []
    rollout: list[torch.Tensor] = []
    for i, (p, g) in enumerate(zip(prompts, gens)):
        ids.append(torch.tensor(list(p) + list(g.token_ids)))
        mask = torch.tensor([0.0] * len(p) + [1.0] * len(g.token_ids))
        masks.append(mask)
        adv.append(mask * (1.0 if i % 2 else -1.0))
        rollout.append(torch.tensor([0.0] * len(p) + list(g.logprobs)))
    return TrainBatch(token_ids=tuple(ids), loss_mask=tuple(masks), advantages=tuple(adv),
                      rollout_logprobs=tuple(rollout),
                      group_ids=tuple(f"g{i // 4}" for i in range(len(ids))))


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(model: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One mode's engine tok/s, logprob gap and train step time."""
    import random

    import torch

    from palaestra.engines.local.local import LocalEngine
    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    rng = random.Random(0)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(16, 64))]
               for _ in range(args.requests)]
    engine = LocalEngine(model, device=args.device, max_running=args.requests,
                         bitwise=mode == "bitwise")

    async def run() -> tuple[list[Any], float]:
        try:
            return await _sample(engine, prompts, args.new_tokens)
        finally:
            await engine.close()

    gens, seconds = asyncio.run(run())
    tokens = sum(len(g.token_ids) for g in gens)
    backend = TorchBackend(model, TorchBackendConfig(device=args.device, on_policy=mode, lr=1e-6))
    batch = _batch(prompts, gens)
    trainer = backend.forward_logprobs(batch)
    gap = max(float((lp - rp)[m > 0].abs().max())
              for lp, rp, m in zip(trainer, batch.rollout_logprobs, batch.loss_mask))
    times = []
    for _ in range(args.steps + 1):
        _sync(args.device)
        start = time.perf_counter()
        backend.train_step(batch, LossConfig(preset="grpo"))
        _sync(args.device)
        times.append(time.perf_counter() - start)
    del backend
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"mode": mode, "engine_tok_s": tokens / seconds, "engine_s": seconds,
            "tokens": tokens, "max_abs_logprob_diff": gap,
            "train_step_s": statistics.median(times[1:]), "train_tokens": batch.num_tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="HF model folder (default: build --size)")
    parser.add_argument("--size", default="small",
                        help="a tiny_model size, or a named shape built from its real model "
                        "card (qwen3-0.6b; qwen3-0.6b-legacy: the shape before 2026-12-04)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from palaestra.benchmarks.perf.shapes import build_shape_model

            model = build_shape_model(args.size, Path(tmp) / "model")
        rows = [measure(model, mode, args) for mode in ("default", "bitwise")]
    default, bitwise = rows
    print(f"{'mode':8} {'engine tok/s':>13} {'train step s':>13} {'max |dlogp|':>12}")
    for r in rows:
        print(f"{r['mode']:8} {r['engine_tok_s']:13.1f} {r['train_step_s']:13.3f} "
              f"{r['max_abs_logprob_diff']:12.3g}")
    result = {"device": args.device, "model": str(args.model or args.size),
              "requests": args.requests, "new_tokens": args.new_tokens, "rows": rows,
              "engine_speed_ratio": bitwise["engine_tok_s"] / default["engine_tok_s"],
              "train_time_ratio": bitwise["train_step_s"] / default["train_step_s"]}
    print(f"bitwise / default: engine speed {result['engine_speed_ratio']:.2f}x, "
          f"train step time {result['train_time_ratio']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
