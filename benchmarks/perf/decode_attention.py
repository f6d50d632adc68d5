"""Decode attention on the GPU: the engine's dense path vs the grouped split-KV Triton kernel.

One decode step's attention of one layer, at the Qwen3-0.6B head layout (16 query heads, 8
key/value heads, head_dim 128, bf16) over a slot cache of ragged rows, from the repository root
on a CUDA machine with Triton::

    PYTHONPATH=$PWD/src python3 benchmarks/perf/decode_attention.py --json decode_attention.json

For each batch (``--batches``) and length range (``--lengths``: rows of uniform random lengths,
the key-length bucket rounded up to 64 as the engine's CUDA graphs do) it reports:

- **exactness**: max |error| of each path against a float32 reference (`dense_reference`), in
  bf16 and in float32 (the engine's tests run float32: the kernel must be within 1e-4 there),
  and whether a CUDA graph captured once replays correctly after the lengths change in place;
- **time per call**: the mean over replays of a CUDA graph of ``--calls`` back-to-back calls
  (what the engine's decode graph replays: no launch overhead), in microseconds;
- **fraction of the HBM bound**: the bytes a call must read (each row's live keys and values
  once, the queries, the output) over the peak bandwidth (``--peak-bw-gbs``, 4,800 GB/s for an
  H200), divided by the measured time; the device-to-device copy rate measured here is printed
  as the practical ceiling. The dense path reads every row to the bucket (its own bytes are in
  the JSON) but is scored on the same useful bytes, so the two fractions compare directly.

``--sweep`` also times a few kernel configurations (tile, warps, pipeline depth, chunking) so
the default can be chosen from numbers. Imports only torch, triton and palaestra's engine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B (and 1.7B) attention
PEAK_BW_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}


def _dense_attention(q: Any, k: Any, v: Any, mask: Any, scale: float, key_len: int) -> Any:
    """The dense path of `Decoder.decode` for one layer (the mask is built once per step)."""
    import torch

    b = q.shape[0]
    d = q.shape[-1]
    rep = q.shape[1] // k.shape[1]
    keys = k[:b, :, :key_len].reshape(b * k.shape[1], key_len, d)
    vals = v[:b, :, :key_len].reshape(b * k.shape[1], key_len, d)
    scores = torch.baddbmm(mask, q.reshape(b * k.shape[1], rep, d), keys.transpose(1, 2),
                           alpha=scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(vals.dtype)
    return torch.bmm(probs, vals).view(b, q.shape[1], d)


def _dense_mask(lengths: Any, key_len: int, dtype: Any) -> Any:
    import torch

    b = lengths.shape[0]
    mask = torch.zeros(b, 1, key_len, device=lengths.device, dtype=dtype)
    dead = torch.arange(key_len, device=lengths.device)[None, :] >= lengths[:, None]
    mask.masked_fill_(dead.unsqueeze(1), float("-inf"))
    rep = HEADS // KV_HEADS
    return mask.expand(b, KV_HEADS * rep, key_len).reshape(b * KV_HEADS, rep, key_len)


def _inputs(batch: int, lo: int, hi: int, dtype: Any, seed: int, dev: str = "cuda"
            ) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (batch,), generator=gen, dtype=torch.int32)
    key_len = -(-int(lengths.max()) // 64) * 64
    cap = key_len + 64
    # q is a view of the fused projection, as in the engine: [B, H + 2 * KV, D] sliced
    qkv = torch.randn(batch, HEADS + 2 * KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
    k = torch.randn(batch, KV_HEADS, cap, HEAD_DIM, device=dev, dtype=dtype)
    v = torch.randn(batch, KV_HEADS, cap, HEAD_DIM, device=dev, dtype=dtype)
    return {"q": qkv[:, :HEADS], "k": k, "v": v, "lengths": lengths.to(dev), "key_len": key_len}


def graph_time_us(fn: Any, calls: int, replays: int) -> float:
    """Mean time of one call, from replays of a CUDA graph holding ``calls`` calls."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def _copy_gbs() -> float:
    """Device-to-device copy rate (bytes read + written), the practical bandwidth ceiling."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us(lambda: dst.copy_(src), calls=10, replays=10)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def _errors(batch: int, lo: int, hi: int, seed: int) -> dict[str, float]:
    """Max |error| vs the float32 reference: both paths in bf16 and in float32."""
    import torch

    from palaestra.engines.local.decode_attention import decode_attention, dense_reference

    out: dict[str, float] = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        x = _inputs(batch, lo, hi, dtype, seed)
        scale = HEAD_DIM ** -0.5
        want = dense_reference(x["q"], x["k"], x["v"], x["lengths"], scale)
        mask = _dense_mask(x["lengths"], x["key_len"], dtype)
        dense = _dense_attention(x["q"], x["k"], x["v"], mask, scale, x["key_len"])
        kernel = decode_attention(x["q"], x["k"], x["v"], x["lengths"], scale, x["key_len"])
        out[f"dense_err_{name}"] = float((dense.float() - want).abs().max())
        out[f"kernel_err_{name}"] = float((kernel.float() - want).abs().max())
        del x, want, dense, kernel, mask
        torch.cuda.empty_cache()
    return out


def _graph_replay_exact(batch: int, lo: int, hi: int, seed: int) -> float:
    """Capture the kernel once, change the lengths in place, replay: max |error| vs reference."""
    import torch

    from palaestra.engines.local.decode_attention import decode_attention, dense_reference

    x = _inputs(batch, lo, hi, torch.float32, seed)
    scale = HEAD_DIM ** -0.5
    lengths = x["lengths"]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_attention(x["q"], x["k"], x["v"], lengths, scale, x["key_len"])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(x["q"], x["k"], x["v"], lengths, scale, x["key_len"])
    gen = torch.Generator().manual_seed(seed + 1)
    new = torch.randint(1, x["key_len"] + 1, (batch,), generator=gen, dtype=torch.int32)
    new[0] = 1
    lengths.copy_(new.to(lengths.device))
    graph.replay()
    torch.cuda.synchronize()
    return float((out - dense_reference(x["q"], x["k"], x["v"], lengths, scale)).abs().max())


def measure(batch: int, lo: int, hi: int, calls: int, replays: int, peak: float,
            configs: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    import torch

    from palaestra.engines.local.decode_attention import decode_attention, num_splits

    x = _inputs(batch, lo, hi, torch.bfloat16, seed)
    q, k, v, lengths, key_len = x["q"], x["k"], x["v"], x["lengths"], x["key_len"]
    scale = HEAD_DIM ** -0.5
    elem = k.element_size()
    live = int(lengths.sum())
    io = 2 * batch * HEADS * HEAD_DIM * elem  # queries in, output out
    useful = 2 * live * KV_HEADS * HEAD_DIM * elem + io
    padded = 2 * batch * key_len * KV_HEADS * HEAD_DIM * elem + io
    bound_us = useful / (peak * 1e9) * 1e6
    row: dict[str, Any] = {"batch": batch, "key_len": key_len, "mean_length": live / batch,
                           "useful_bytes": useful, "dense_bytes": padded, "hbm_bound_us": bound_us}
    mask = _dense_mask(lengths, key_len, q.dtype)
    row["dense_us"] = graph_time_us(
        lambda: _dense_attention(q, k, v, mask, scale, key_len), calls, replays)
    for name, config in configs.items():
        us = graph_time_us(
            lambda c=config: decode_attention(q, k, v, lengths, scale, key_len, config=c),
            calls, replays)
        splits, chunk = num_splits(batch, KV_HEADS, key_len, config)
        row[f"{name}_us"] = us
        row[f"{name}_splits"] = splits
        row[f"{name}_chunk"] = chunk
        row[f"{name}_fraction_of_bound"] = bound_us / us
    row["dense_fraction_of_bound"] = bound_us / row["dense_us"]
    row["kernel_speedup"] = row["dense_us"] / row["kernel_us"]
    row.update(_errors(batch, lo, hi, seed))
    row["graph_replay_err_fp32"] = _graph_replay_exact(batch, lo, hi, seed)
    return row


def sweep_configs() -> dict[str, Any]:
    from palaestra.engines.local.decode_attention import DEFAULT, KernelConfig

    return {
        "kernel": DEFAULT,
        "b32_s3": KernelConfig(block_n=32, num_stages=3),
        "b64_s3": KernelConfig(num_stages=3),
        "b64_s4": KernelConfig(num_stages=4),
        "b64_w8": KernelConfig(num_warps=8),
        "b128_s2": KernelConfig(block_n=128, min_chunk=128),
        "b128_w8_s3": KernelConfig(block_n=128, num_warps=8, num_stages=3, min_chunk=128),
        "t2k": KernelConfig(target_programs=2048),
        "t32k": KernelConfig(target_programs=32768),
        "t32k_c64": KernelConfig(target_programs=32768, min_chunk=64),
        "c256": KernelConfig(min_chunk=256),
        "one_chunk": KernelConfig(target_programs=1),
    }


def main(argv: list[str] | None = None) -> int:
    import torch

    from palaestra.engines.local.decode_attention import DEFAULT

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="256,64")
    p.add_argument("--lengths", default="200:1500,64:448",
                   help="LO:HI row lengths (uniform), comma-separated ranges (the second default "
                        "is the engine benchmark's: prompts 64-192 plus up to 256 new tokens)")
    p.add_argument("--calls", type=int, default=28, help="calls per captured graph (layers)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--peak-bw-gbs", type=float, default=None)
    p.add_argument("--sweep", action="store_true", help="also time other kernel configurations")
    p.add_argument("--json", default=None, help="write the results here (default: $OUT/...)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention benchmark: needs a CUDA GPU")
    name = torch.cuda.get_device_name()
    peak = args.peak_bw_gbs or next((v for k, v in PEAK_BW_GBS.items() if k in name), 4800.0)
    configs = sweep_configs() if args.sweep else {"kernel": DEFAULT}
    copy = _copy_gbs()
    print(f"{name}: peak {peak:.0f} GB/s, device copy {copy:.0f} GB/s "
          f"({100 * copy / peak:.0f}% of peak)", flush=True)
    rows = []
    spans = [tuple(int(x) for x in span.split(":")) for span in args.lengths.split(",")]
    for (lo, hi), b in ((s, int(x)) for s in spans for x in args.batches.split(",")):
        row = measure(b, lo, hi, args.calls, args.replays, peak, configs)
        row["lengths"] = f"{lo}:{hi}"
        rows.append(row)
        print(f"B={b}, lengths {lo}:{hi}: dense {row['dense_us']:.1f} us "
              f"({100 * row['dense_fraction_of_bound']:.1f}%"
              f" of bound), kernel {row['kernel_us']:.1f} us "
              f"({100 * row['kernel_fraction_of_bound']:.1f}%), x{row['kernel_speedup']:.2f}; "
              f"err bf16 dense {row['dense_err_bf16']:.2e} kernel {row['kernel_err_bf16']:.2e}, "
              f"fp32 dense {row['dense_err_fp32']:.2e} kernel {row['kernel_err_fp32']:.2e}, "
              f"graph replay {row['graph_replay_err_fp32']:.2e}", flush=True)
    print("\n| batch | lengths | key len | mean len | config | splits x chunk | us/call | "
          "% of HBM bound |")
    print("|---:|---|---:|---:|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['lengths']} | {r['key_len']} | {r['mean_length']:.0f} | "
              f"dense | padded | "
              f"{r['dense_us']:.1f} | {100 * r['dense_fraction_of_bound']:.1f} |")
        for c in configs:
            print(f"| {r['batch']} | {r['lengths']} | {r['key_len']} | {r['mean_length']:.0f} | "
                  f"{c} | "
                  f"{r[f'{c}_splits']} x {r[f'{c}_chunk']} | {r[f'{c}_us']:.1f} | "
                  f"{100 * r[f'{c}_fraction_of_bound']:.1f} |")
    ok = all(r["kernel_err_fp32"] <= 1e-4 and r["graph_replay_err_fp32"] <= 1e-4 for r in rows)
    print(f"\nexact in fp32 (<= 1e-4, graph replay included): {ok}")
    result = {"device": name, "peak_bw_gbs": peak, "copy_gbs": copy, "exact_fp32": ok,
              "configs": {c: vars(cfg) for c, cfg in configs.items()}, "rows": rows,
              "args": vars(args)}
    out = args.json or (os.path.join(os.environ["OUT"], "decode_attention.json")
                        if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {out}")
    return 0 if ok and all(math.isfinite(r["kernel_us"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
