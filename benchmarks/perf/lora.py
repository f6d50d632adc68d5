"""Full fine-tuning vs LoRA: sync bytes and time, trainer memory, step time, engine decode.

On the quickstart model (CPU)::

    python -m palaestra.benchmarks.perf.lora --json lora_cpu.json

On the Qwen3-0.6B shape (one GPU; vocabulary 151936, bf16 engine)::

    python -m palaestra.benchmarks.perf.lora --size 0.6b --device cuda --json lora_gpu.json

For each trainer (``full``; ``lora`` rank ``--rank``, all-linear) the script builds the torch
backend on a random-init model of that shape, runs ``--reps`` RL steps (GRPO loss) on a synthetic
batch of ``--seqs`` sequences of ``--tokens`` tokens (step time: median), measures the trainer's
state (parameters + gradients + AdamW moments held, bytes; on CUDA also the peak allocated) and
pushes the weights after each step through the run's own `EngineSync` (in process) to a
`LocalEngine`: the full weights for ``full``; the adapter only for ``lora``, to an engine of each
``lora_mode`` (``merged``: merged into its weights per version; ``lowrank``: separate low-rank
GEMMs). Then it times greedy decode of ``--batch`` requests of ``--new-tokens`` tokens on each
engine (the adapter as the default adapter) and on the bare base model. Prints a table, writes
JSON (``--json``).
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


def synthetic_batch(seqs: int, tokens: int, vocab: int, seed: int = 0) -> Any:
    """``seqs`` random sequences of ``tokens`` ids (the first quarter masked out), alternating
    advantages, fixed rollout logprobs: a train batch of a chosen shape (the benchmarks')."""
    import torch

    from palaestra.trainers.batching import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids, masks, adv, rollout = [], [], [], []
    for i in range(seqs):
        ids.append(torch.randint(0, vocab, (tokens,), generator=g))
        mask = torch.tensor([0.0] * (tokens // 4) + [1.0] * (tokens - tokens // 4))
        masks.append(mask)
        adv.append(mask * (1.0 if i % 2 else -1.0))
        rollout.append(mask * -5.0)
    return TrainBatch(token_ids=tuple(ids), loss_mask=tuple(masks), advantages=tuple(adv),
                      rollout_logprobs=tuple(rollout),
                      group_ids=tuple(f"g{i // 8}" for i in range(seqs)))


def _state_bytes(backend: Any) -> dict[str, float]:
    import torch

    params = sum(p.numel() * p.element_size() for p in backend.model.parameters())
    trainable = [p for p in backend.model.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in trainable)  # held during the step
    optim = sum(v.numel() * v.element_size() for st in backend.optimizer.state.values()
                for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"trainable_params": float(sum(p.numel() for p in trainable)),
            "state_mb": (params + grads + optim) / 1e6, "optimizer_mb": optim / 1e6}


async def _decode_s(engines: dict[str, Any], batch: int, new_tokens: int, rounds: int = 5
                    ) -> dict[str, float]:
    """Best-of-``rounds`` seconds of one decode batch per engine, the engines interleaved in
    every round (so a busy spell of the shared CPU hits all of them alike)."""
    from palaestra.engine import SamplingParams

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(16)] for i in range(batch)]
    best = dict.fromkeys(engines, float("inf"))
    for engine in engines.values():  # warm-up
        await asyncio.gather(*(engine.generate(p[:4], SamplingParams(max_new_tokens=2,
                                                                     temperature=0))
                               for p in prompts[:2]))
    for _ in range(rounds):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from palaestra.benchmarks.perf.weight_sync import build_checkpoint
    from palaestra.engines.local.local import LocalEngine
    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.run.fleet.engine_sync import EngineSync
    from palaestra.run.fleet.weight_pushes import build_push
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig
    from palaestra.trainers.torch_backend.lora import LoraSettings

    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="palaestra-lora-bench-"))
    model = build_checkpoint(args.size, tmp / "model")  # "0.6b": Qwen3-0.6B's shapes, on CUDA
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    engine_dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    loss = LossConfig(preset="grpo")
    rows: list[dict[str, Any]] = []
    for kind in ("full", "lora"):
        lora = LoraSettings(rank=args.rank, alpha=2.0 * args.rank) if kind == "lora" else None
        if args.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        backend = TorchBackend(model, TorchBackendConfig(device=args.device, lr=1e-4, lora=lora,
                                                         pack_sequences=args.device == "cuda"))
        batch = synthetic_batch(args.seqs, args.tokens, min(vocab, 1000))
        modes = ("merged", "lowrank") if kind == "lora" else ("full",)
        engines = {m: LocalEngine(model, device=args.device, dtype=engine_dtype,
                                  lora_mode="merged" if m == "full" else m,
                                  cuda_graphs=True) for m in modes}  # lowrank decodes without
        syncs = {m: build_push(EngineSync("in_process", e, bucket_bytes=512 << 20,
                                          dtype=engine_dtype), backend)
                 for m, e in engines.items()}
        steps: list[float] = []
        pushes: dict[str, list[Any]] = {m: [] for m in modes}
        for rep in range(args.reps + 1):
            t0 = time.perf_counter()
            backend.train_step(batch, loss)
            if args.device == "cuda":
                torch.cuda.synchronize()
            if rep:  # the first step allocates the optimizer state
                steps.append(time.perf_counter() - t0)
            for m, sync in syncs.items():
                stats = await sync.push(rep + 1)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                if rep:
                    pushes[m].append(stats)
        mem = _state_bytes(backend)
        peak = torch.cuda.max_memory_allocated() / 1e9 if args.device == "cuda" else 0.0
        base = LocalEngine(model, device=args.device, dtype=engine_dtype)
        decode_s = await _decode_s({**engines, "base": base}, args.batch, args.new_tokens)
        await base.close()
        for m, engine in engines.items():
            decode = decode_s[m]
            rows.append({
                "trainer": kind if kind == "full" else f"lora r{args.rank}", "engine": m,
                "sync_mb": pushes[m][-1].num_bytes / 1e6,
                "sync_ms": 1e3 * statistics.median(p.seconds for p in pushes[m]),
                "step_s": statistics.median(steps), **mem, "cuda_peak_gb": peak,
                "decode_tok_s": args.batch * args.new_tokens / decode,
                "decode_vs_base": decode_s["base"] / decode,
            })
            await engine.close()
        del backend
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", help="tiny (the quickstart model) or a Qwen3 "
                        "card's shape with its 151936 vocabulary: 0.6b, 1.7b (CUDA only)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="decode requests")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import torch

    if args.device == "cpu":
        torch.set_num_threads(1)
    rows = asyncio.run(run(args))
    cols = ["trainer", "engine", "sync_mb", "sync_ms", "step_s", "state_mb", "optimizer_mb",
            "cuda_peak_gb", "decode_tok_s", "decode_vs_base"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                         for c in cols))
    full = next(r for r in rows if r["trainer"] == "full")
    lora = next(r for r in rows if r["engine"] == "merged")
    print(f"sync bytes full / lora: {full['sync_mb'] / lora['sync_mb']:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
