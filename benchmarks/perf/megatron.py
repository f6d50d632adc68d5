"""Megatron backend vs a plain HF/PyTorch training step: throughput, MFU and weight-sync time.

Launch (one GPU, megatron-core installed), from the repository root::

    python -m palaestra.benchmarks.perf.megatron --models 0.6b,1.7b --seq 4096 --json out.json

For each Qwen3-shaped random-init model (0.6B, 1.7B, 4B shapes, vocabulary 151936, tied
embeddings) it builds the HF model, converts its weights into a Megatron `GPTModel` (SDPA layer
spec unless transformer-engine is installed) and times, on the same batch of ``--seqs``
sequences of ``--seq`` tokens (one sequence per micro-batch, gradient accumulation over all):

- Megatron: `MegatronBackend.train_step` (SFT loss, bf16 weights, fp32 master weights, Adam);
- HF/PyTorch: the HF model with fp32 weights under bf16 autocast, fused AdamW, gradient clipping
  (the PyTorch backend's default precision), same loss;
- weight sync: Megatron -> HF-named buckets -> copied into a bf16 HF model on the same GPU.

MFU = tokens/s x training FLOPs per token (6N + causal attention, see trainers.megatron.flops)
over the bf16 matmul rate measured here (8192^3 GEMM) and over the 989 TFLOP/s datasheet figure.
Also reports the max |logprob difference| between Megatron (bf16) and HF (bf16) on one sequence.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

DATASHEET_TFLOPS = 989.0
SHAPES = ("0.6b", "1.7b", "4b")  # Qwen3 model cards, from palaestra.model_shapes.NAMED_SHAPES


def qwen3_config(name: str) -> dict[str, Any]:
    """The HF config fields of the Qwen3 model card ``name`` ("1.7b")."""
    from palaestra.model_shapes import NAMED_SHAPES

    return dict(NAMED_SHAPES[f"qwen3-{name}"])


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    """Measured bf16 GEMM rate on random data (the MFU ceiling)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync()
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def _timed(fn: Any, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return times


def hf_train_step_fn(model: Any, batch: Any, optimizer: Any) -> Any:
    """One HF/PyTorch optimizer step over the batch, one sequence per micro-batch."""
    import torch
    import torch.nn.functional as F

    seqs = [t.cuda() for t in batch.token_ids]
    n_tokens = sum(int(t.numel()) - 1 for t in seqs)

    def step() -> None:
        for ids in seqs:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids[None]).logits
            loss = F.cross_entropy(logits[0, :-1].float(), ids[1:], reduction="sum") / n_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def logprob_diff(backend: Any, hf_bf16: Any, ids: Any) -> dict[str, float]:
    """Max/mean |logprob| difference, Megatron vs an HF model, on one sequence."""
    import torch

    from palaestra.trainers.batching import TrainBatch

    batch = TrainBatch(token_ids=(ids,), loss_mask=(torch.zeros(ids.shape[0]),))
    ours = backend.forward_logprobs(batch)[0][1:]
    with torch.no_grad():
        logits = hf_bf16(ids[None].cuda()).logits[0, :-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, ids[1:, None].cuda())[:, 0].cpu()
    diff = (ours - ref).abs()
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean())}


def bench_model(name: str, args: argparse.Namespace, peak: float) -> dict[str, Any]:
    import torch
    import transformers

    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.megatron.arch import arch_from_hf_config
    from palaestra.trainers.megatron.backend import MegatronBackend
    from palaestra.trainers.megatron.config import MegatronBackendConfig
    from palaestra.trainers.megatron.flops import param_count, train_flops_per_token
    from palaestra.trainers.megatron.weight_sync import module_copier

    cfg_dict = qwen3_config(name)
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg_dict.items() if k != "model_type"})
    arch = arch_from_hf_config(hf_cfg)  # what the HF model really is (rope_theta included)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    hf = hf.float().train()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, arch.vocab_size, (args.seq,), generator=g) for _ in range(args.seqs)]
    masks = [torch.cat([torch.zeros(1), torch.ones(args.seq - 1)]) for _ in seqs]
    batch = TrainBatch(token_ids=tuple(seqs), loss_mask=tuple(masks))
    tokens = args.seqs * args.seq
    flops_tok = train_flops_per_token(arch, args.seq)
    row: dict[str, Any] = {"model": f"qwen3-{name}", "params": param_count(arch).total,
                           "seq": args.seq, "tokens_per_step": tokens,
                           "fused_swiglu": args.fused_swiglu,
                           "micro_batch_tokens": args.micro_batch_tokens or args.seq,
                           "packed_attention": args.packed_attention,
                           "train_flops_per_token": flops_tok, "matmul_peak_tflops": peak}

    def rates(times: list[float]) -> dict[str, float]:
        t = statistics.median(times)
        tps = tokens / t
        return {"step_s": t, "tokens_per_s": tps,
                "mfu_measured_peak": tps * flops_tok / (peak * 1e12),
                "mfu_datasheet": tps * flops_tok / (DATASHEET_TFLOPS * 1e12)}

    if not args.skip_megatron:
        backend = MegatronBackend(hf_cfg, MegatronBackendConfig(
            dtype="bfloat16", lr=1e-5,
            max_tokens_per_micro_batch=args.micro_batch_tokens or args.seq,
            recompute=args.recompute, fused_swiglu=args.fused_swiglu,
            packed_attention=args.packed_attention),
            hf_state_dict=hf.state_dict())
        with torch.device("cuda"):
            hf_bf16 = transformers.AutoModelForCausalLM.from_config(
                hf_cfg, attn_implementation="sdpa").eval()
        for p in hf_bf16.parameters():  # not .to(): that would round RoPE's fp32 inv_freq too
            p.data = p.data.to(torch.bfloat16)
        copy = module_copier(hf_bf16)
        backend.sync_weights(copy)
        row["logprob_diff_bf16"] = logprob_diff(backend, hf_bf16, seqs[0])
        row["logprob_diff_vs_hf_fp32"] = logprob_diff(backend, hf, seqs[0])
        torch.cuda.reset_peak_memory_stats()
        sft = LossConfig(preset="sft")
        row["megatron"] = rates(_timed(lambda: backend.train_step(batch, sft), args.warmup,
                                       args.steps))
        row["megatron"]["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if args.profile:
            row["megatron_profile"] = kernel_profile(lambda: backend.train_step(batch, sft))
        sync_times = [backend.sync_weights(copy, bucket_bytes=args.bucket_mb << 20).seconds
                      for _ in range(args.sync_reps)]
        gather_times = [backend.sync_weights(lambda b: None, bucket_bytes=args.bucket_mb << 20
                                             ).seconds for _ in range(args.sync_reps)]
        stats = backend.sync_weights(copy, bucket_bytes=args.bucket_mb << 20)
        row["weight_sync"] = {"to_hf_module_s": statistics.median(sync_times),
                              "gather_only_s": statistics.median(gather_times),
                              "bytes": stats.num_bytes, "tensors": stats.num_tensors,
                              "buckets": stats.num_buckets}
        del backend, hf_bf16, copy
        gc.collect()
        torch.cuda.empty_cache()
    if not args.skip_hf:
        torch.cuda.reset_peak_memory_stats()
        opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, fused=True)
        row["hf_torch"] = rates(_timed(hf_train_step_fn(hf, batch, opt), args.warmup, args.steps))
        row["hf_torch"]["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        del opt
    if "megatron" in row and "hf_torch" in row:
        row["speedup_vs_hf"] = row["hf_torch"]["step_s"] / row["megatron"]["step_s"]
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return row


KERNEL_KINDS = (  # first match wins; names of CUDA kernels as the profiler reports them
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul")),
    ("optimizer", ("multi_tensor", "adam")),
    ("softmax/logprob", ("softmax", "logsumexp", "cross_entropy", "nll")),
    ("norm", ("norm",)),
    ("copy/cast", ("copy", "convert", "cast", "memcpy", "memset", "fill")),
    ("communication", ("nccl",)),
)


def kernel_profile(step: Any, top: int = 15) -> dict[str, Any]:
    """GPU time of one ``step()`` by kernel kind (torch.profiler), and the costliest kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        _sync()
    kernels: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.name] = kernels.get(evt.name, 0.0) + evt.device_time / 1e6
    by_kind: dict[str, float] = {}
    members: dict[str, list[tuple[str, float]]] = {}
    for name, seconds in kernels.items():
        low = name.lower().replace("nocast", "")  # "gpu_kernel_impl_nocast" is no cast kernel
        kind = next((k for k, keys in KERNEL_KINDS if any(x in low for x in keys)),
                     "elementwise/other")
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds
        members.setdefault(kind, []).append((name, seconds))
    total = sum(by_kind.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    print(f"kernel time of one step: {total:.3f} s")
    for kind, seconds in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<20}{seconds:>8.3f} s {seconds / total:>6.1%}")
    for name, seconds in ranked:
        print(f"    {seconds:>8.4f} s  {name[:110]}")
    top_by_kind = {k: [{"name": n[:160], "seconds": t} for n, t in sorted(v, key=lambda x: -x[1])[:6]]
                   for k, v in members.items()}
    return {"total_kernel_s": total, "by_kind_s": by_kind,
            "top_kernels": [{"name": n, "seconds": s} for n, s in ranked],
            "top_by_kind": top_by_kind}


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'model':<12}{'impl':<10}{'step s':>8}{'tok/s':>10}{'MFU meas':>10}"
            f"{'MFU 989':>9}{'mem GiB':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        for impl in ("megatron", "hf_torch"):
            if impl in r:
                m = r[impl]
                print(f"{r['model']:<12}{impl:<10}{m['step_s']:>8.3f}{m['tokens_per_s']:>10.0f}"
                      f"{m['mfu_measured_peak']:>10.1%}{m['mfu_datasheet']:>9.1%}"
                      f"{m['peak_mem_gib']:>9.1f}")
        if "speedup_vs_hf" in r:
            print(f"{'':<12}speedup megatron/hf: {r['speedup_vs_hf']:.2f}x")
        if "weight_sync" in r:
            w = r["weight_sync"]
            print(f"{'':<12}weight sync -> HF module: {w['to_hf_module_s'] * 1e3:.1f} ms "
                  f"(gather only {w['gather_only_s'] * 1e3:.1f} ms, {w['bytes'] / 1e9:.2f} GB, "
                  f"{w['buckets']} buckets)")
        if "logprob_diff_bf16" in r:
            d = r["logprob_diff_bf16"]
            e = r["logprob_diff_vs_hf_fp32"]
            print(f"{'':<12}logprob |megatron bf16 - hf bf16|: max {d['max_abs']:.3g}, "
                  f"mean {d['mean_abs']:.3g}; vs hf fp32: max {e['max_abs']:.3g}, "
                  f"mean {e['mean_abs']:.3g}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="0.6b,1.7b", help=f"comma list of {list(SHAPES)}")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--seqs", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps (median)")
    parser.add_argument("--sync-reps", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=1024)
    parser.add_argument("--recompute", action="store_true", help="full activation recompute")
    parser.add_argument("--fused-swiglu", action="store_true",
                        help="megatron's compiled SwiGLU (MegatronBackendConfig.fused_swiglu)")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="Megatron micro-batch token budget (default: one sequence)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one Megatron step: GPU time by kernel kind")
    parser.add_argument("--packed-attention", choices=["auto", "varlen", "per_sequence"],
                        default="auto", help="MegatronBackendConfig.packed_attention")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-megatron", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    import torch

    from palaestra.trainers.megatron.parallel import ParallelConfig, init_parallel

    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    init_parallel(ParallelConfig())
    peak = matmul_tflops()
    print(f"device: {torch.cuda.get_device_name()}, bf16 GEMM {peak:.0f} TFLOP/s, "
          f"torch {torch.__version__}")
    rows = []
    for name in args.models.split(","):
        rows.append(bench_model(name.strip(), args, peak))
        print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "matmul_peak_tflops": peak,
                       "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
