"""Torch backend vs Megatron backend: one GRPO train step on the RL loop's batch, side by side.

Launch (one GPU, megatron-core installed), from the repository root::

    python -m palaestra.benchmarks.perf.train_step --shape qwen3-0.6b --json out.json

The batch is the loop benchmark's (``loop.py`` on CUDA): ``--seqs`` sequences (256 = 32 prompts x
8) of ragged lengths drawn from ``--min-len``..``--max-len`` (the quickstart prompt plus up to 256
sampled tokens), the prompt part masked out, alternating advantages, GRPO loss. Both backends
start from the same random-init HF weights, bf16 compute over fp32 master weights, the same
micro-batch token budget. For each backend it prints the median step time over ``--steps`` (after
``--warmup``), the micro-batch count and, with ``--profile``, the GPU time of one step by kernel
kind and the costliest kernels (torch.profiler), plus the host time not covered by kernels: the
table that says where one backend loses to the other. Each megatron setting named in
``--megatron-variants`` (``name:key=value,key=value``) is timed as its own row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def ragged_batch(seqs: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> Any:
    """``seqs`` random sequences of ragged lengths, the first ~third (the prompt) masked out."""
    import torch

    from palaestra.trainers.batching import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids, masks, adv, rollout = [], [], [], []
    for i in range(seqs):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        prompt = min_len // 2
        ids.append(torch.randint(0, vocab, (n,), generator=g))
        mask = torch.cat([torch.zeros(prompt), torch.ones(n - prompt)])
        masks.append(mask)
        adv.append(mask * (1.0 if i % 2 else -1.0))
        rollout.append(mask * -5.0)
    return TrainBatch(token_ids=tuple(ids), loss_mask=tuple(masks), advantages=tuple(adv),
                      rollout_logprobs=tuple(rollout),
                      group_ids=tuple(f"g{i // 8}" for i in range(seqs)))


def _timed(step: Any, warmup: int, steps: int) -> tuple[list[float], dict[str, float]]:
    import torch

    for _ in range(warmup):
        step()
    times, last = [], {}
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        last = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times, last


def host_profile(step: Any, top: int = 30) -> list[dict[str, Any]]:
    """cProfile of one ``step()``: the functions with the most own (host) time."""
    import cProfile
    import pstats

    import torch

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = [{"function": f"{path.rsplit('/', 2)[-1]}:{line}:{name}", "calls": nc,
             "own_s": tt, "cumulative_s": ct}
            for (path, line, name), (_, nc, tt, ct, _) in stats.stats.items()]  # type: ignore[attr-defined]
    rows.sort(key=lambda r: -r["own_s"])
    for r in rows[:top]:
        print(f"    own {r['own_s']:7.3f} s  cum {r['cumulative_s']:7.3f} s  {r['calls']:>7}  "
              f"{r['function'][:90]}")
    return rows[:top]


def _variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``name:key=value,...`` -> the name and its settings, values parsed as on the command line
    of ``palaestra train`` (TOML literals, else strings)."""
    from palaestra.config import parse_overrides

    name, _, body = spec.partition(":")
    return name, parse_overrides([f"--{item}" for item in body.split(",") if item])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b",
                        help="a named shape built from its real model card (qwen3-0.6b, "
                        "qwen3-1.7b), its *-legacy shape (the figures before 2026-12-04), or "
                        "a tiny_model size")
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=90)
    parser.add_argument("--max-len", type=int, default=346)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--cprofile", action="store_true",
                        help="also the host side of one step: cProfile's top functions")
    parser.add_argument("--torch-settings", default="",
                        help="key=value,... TorchBackendConfig fields (e.g. attn_implementation=varlen)")
    parser.add_argument("--backends", default="torch,megatron")
    parser.add_argument("--megatron-variants", default="default:",
                        help="semicolon-separated name:key=value,... MegatronBackendConfig fields")
    parser.add_argument("--work", default="/tmp/palaestra-train-step")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)

    import torch
    import transformers

    from palaestra.benchmarks.perf.loop import ensure_shape_model
    from palaestra.benchmarks.perf.megatron import kernel_profile
    from palaestra.trainers.algorithms.config import LossConfig

    model_dir = ensure_shape_model(args.shape, Path(args.work) / f"model-{args.shape}")
    hf_cfg = transformers.AutoConfig.from_pretrained(model_dir)
    batch = ragged_batch(args.seqs, args.min_len, args.max_len, hf_cfg.vocab_size)
    loss = LossConfig(preset="grpo")
    rows: list[dict[str, Any]] = []

    def measure(name: str, backend: Any) -> None:
        times, metrics = _timed(lambda: backend.train_step(batch, loss), args.warmup, args.steps)
        row: dict[str, Any] = {
            "backend": name, "step_s": statistics.median(times), "steps_s": times,
            "tokens": batch.num_tokens, "tokens_per_s": batch.num_tokens / statistics.median(times),
            "micro_batches": metrics.get("num_micro_batches"),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
        if args.profile:
            prof = kernel_profile(lambda: backend.train_step(batch, loss))
            row["profile"] = prof
            row["host_not_covered_s"] = row["step_s"] - prof["total_kernel_s"]
        if args.cprofile:
            row["host_profile"] = host_profile(lambda: backend.train_step(batch, loss))
        rows.append(row)
        print(f"{name:<28} step {row['step_s']:.3f} s  {row['tokens_per_s']:,.0f} tok/s  "
              f"micro-batches {row['micro_batches']}", flush=True)

    for backend_name in args.backends.split(","):
        torch.cuda.reset_peak_memory_stats()
        if backend_name == "torch":
            from palaestra.trainers.torch_backend.backend import TorchBackend
            from palaestra.trainers.torch_backend.config import TorchBackendConfig

            _, settings = _variant(f"torch:{args.torch_settings}")
            fields = {"device": "cuda", "lr": 1e-5,
                      "max_tokens_per_micro_batch": args.micro_batch_tokens, **settings}
            backend: Any = TorchBackend(model_dir, TorchBackendConfig(**fields))
            measure("torch", backend)
        else:
            from palaestra.trainers.megatron.backend import MegatronBackend
            from palaestra.trainers.megatron.config import MegatronBackendConfig

            state = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
            for spec in args.megatron_variants.split(";"):
                variant, settings = _variant(spec)
                fields = {"dtype": "bfloat16", "lr": 1e-5,
                          "max_tokens_per_micro_batch": args.micro_batch_tokens, **settings}
                try:
                    backend = MegatronBackend(hf_cfg, MegatronBackendConfig(**fields),
                                              hf_state_dict=state)
                    measure(f"megatron/{variant}", backend)
                except Exception as exc:  # noqa: BLE001 - a variant's failure is a row
                    rows.append({"backend": f"megatron/{variant}", "error": repr(exc)[:500]})
                    print(f"megatron/{variant}: {exc!r}"[:300], flush=True)
                backend = None
        del backend
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
