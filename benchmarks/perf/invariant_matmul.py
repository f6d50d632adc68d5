"""Batch-invariant Triton matmul (`invariant_triton.bmm_nt`) vs torch (cuBLAS) on the GPU.

The linears of a Qwen3-0.6B-like model (hidden 1024, fused q/k/v 4096 <- 1024, o 1024 <- 2048,
fused gate/up 6144 <- 1024, down 1024 <- 3072, lm_head 151,936 <- 1024), ``y = x @ W.T`` with
``x`` ``[M, K]`` and the weight ``[N, K]`` as the model stores it, at M = 1, 16, 64, 256, 4096
(decode batches to a prefill/training chunk), bfloat16 by default. From the repository root on a
CUDA machine with Triton::

    PYTHONPATH=$PWD/src python3 benchmarks/perf/invariant_matmul.py --out invariant_matmul.json

For each (linear, M) it reports:

- **time per call** of ``torch.nn.functional.linear`` (cuBLAS, what the model runs now) and of
  ``bmm_nt(x[None], W[None])``: the mean over replays of a CUDA graph of ``--calls`` back-to-back
  calls (no launch overhead, as in the engine's decode graphs), in microseconds, and their ratio;
- **throughput**: TFLOP/s of each, and the fraction of the HBM bound (weight + input + output
  bytes over ``--peak-bw-gbs``, 4,800 GB/s for an H200) that matters at small M;
- **checks**: max |error| of both against a float32 matmul of the same inputs (TF32 off), and
  whether row 0 of the M-row call equals the 1-row call bit for bit (it must for bmm_nt; torch's
  is printed to show that cuBLAS is not batch invariant).

``--sweep`` also times other tile configurations (``name=BMxBNxBK/warps/stages`` through the
kernel's private ``tiles`` argument: each is batch invariant, but they differ from one another in
bits, so one must be chosen for the engine and the trainer alike), so `TILES` can be chosen
from numbers. A last line sums one forward's linears (``--layers`` layers of q/k/v, o, gate/up
and down, plus the lm_head) per M for both. Imports only torch, triton and palaestra's engine.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from palaestra.benchmarks.perf.decode_attention import graph_time_us

#: (name, N, K) of y = x @ W.T, W [N, K]: Qwen3-0.6B (16 query heads, 8 key/value heads of 128)
LINEARS = [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024),
           ("down", 1024, 3072), ("lm_head", 151936, 1024)]
LAYERS = 28
PEAK_BW_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}
#: --sweep: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) besides the module's `TILES`
SWEEP = {"m64n32k64_w4s3": (64, 32, 64, 4, 3), "m64n64k64_w4s3": (64, 64, 64, 4, 3),
         "m64n128k64_w4s3": (64, 128, 64, 4, 3), "m128n128k64_w8s3": (128, 128, 64, 8, 3),
         "m16n64k128_w4s3": (16, 64, 128, 4, 3), "m64n64k32_w4s4": (64, 64, 32, 4, 4)}


def _checks(x: Any, w: Any) -> dict[str, Any]:
    """Errors against a float32 matmul and the row-0 bitwise check, for both paths."""
    import torch
    import torch.nn.functional as F

    from palaestra.engines.bitwise.invariant_triton import bmm_nt

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        want = F.linear(x.float(), w.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    ours = bmm_nt(x[None], w[None])[0]
    theirs = F.linear(x, w)
    return {
        "torch_err": float((theirs.float() - want).abs().max()),
        "bmm_nt_err": float((ours.float() - want).abs().max()),
        "bmm_nt_row0_invariant": bool(torch.equal(bmm_nt(x[None, :1], w[None])[0], ours[:1])),
        "torch_row0_invariant": bool(torch.equal(F.linear(x[:1], w), theirs[:1])),
    }


def _sweep(x: Any, w: Any, calls: int, replays: int, configs: dict[str, Any]
           ) -> dict[str, Any]:
    """Time and row-0 invariance of the kernel in each configuration of ``configs``."""
    import torch

    from palaestra.engines.bitwise.invariant_triton import _bmm_nt_forward

    out: dict[str, Any] = {}
    for name, tiles in configs.items():
        def call(t: Any = tiles, rows: Any = x) -> Any:
            return _bmm_nt_forward(rows[None], w[None], rows.dtype, tiles=t)

        out[f"{name}_us"] = graph_time_us(call, calls, replays)
        out[f"{name}_row0_invariant"] = bool(torch.equal(call(rows=x[:1])[0], call()[0, :1]))
    return out


def measure(name: str, n: int, k: int, m: int, dtype: Any, calls: int, replays: int,
            peak: float, sweep: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """One (linear, M): times, throughput and checks of torch and bmm_nt (and of the ``sweep``
    configurations)."""
    import torch
    import torch.nn.functional as F

    from palaestra.engines.bitwise.invariant_triton import bmm_nt

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(dtype)
    elem = x.element_size()
    flops = 2 * m * n * k
    bound_us = (n * k + m * k + m * n) * elem / (peak * 1e9) * 1e6
    row: dict[str, Any] = {"linear": name, "n": n, "k": k, "m": m, "dtype": str(dtype),
                           "hbm_bound_us": bound_us}
    row["torch_us"] = graph_time_us(lambda: F.linear(x, w), calls, replays)
    row["bmm_nt_us"] = graph_time_us(lambda: bmm_nt(x[None], w[None]), calls, replays)
    for path in ("torch", "bmm_nt"):
        row[f"{path}_tflops"] = flops / (row[f"{path}_us"] * 1e-6) / 1e12
        row[f"{path}_fraction_of_bound"] = bound_us / row[f"{path}_us"]
    row["slowdown"] = row["bmm_nt_us"] / row["torch_us"]
    row.update(_checks(x, w))
    row.update(_sweep(x, w, calls, replays, sweep))
    return row


def _forward_totals(rows: list[dict[str, Any]], layers: int) -> dict[str, dict[str, float]]:
    """Per (dtype, M): one forward's linears (``layers`` layers + the lm_head), both paths."""
    totals: dict[str, dict[str, float]] = {}
    for r in rows:
        key = f"{r['dtype']} M={r['m']}"
        t = totals.setdefault(key, {"torch_us": 0.0, "bmm_nt_us": 0.0})
        times = 1 if r["linear"] == "lm_head" else layers
        t["torch_us"] += times * r["torch_us"]
        t["bmm_nt_us"] += times * r["bmm_nt_us"]
    return totals


def main(argv: list[str] | None = None) -> int:
    import torch

    from palaestra.engines.bitwise import invariant_triton as inv

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", default="1,16,64,256,4096", help="rows per call, comma-separated")
    p.add_argument("--linears", default=",".join(n for n, _, _ in LINEARS),
                   help="which of " + ", ".join(n for n, _, _ in LINEARS))
    p.add_argument("--dtypes", default="bfloat16", help="comma-separated: bfloat16,float32")
    p.add_argument("--layers", type=int, default=LAYERS, help="layers in the forward total")
    p.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--peak-bw-gbs", type=float, default=None)
    p.add_argument("--sweep", action="store_true", help="also time other tile configurations")
    p.add_argument("--out", default=None, help="write the results here as JSON "
                                               "(default: $OUT/invariant_matmul.json if $OUT)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("invariant_matmul benchmark: needs a CUDA GPU (it times Triton "
                         "kernels against cuBLAS); none is visible here")
    if not inv.available("cuda"):
        raise SystemExit("invariant_matmul benchmark: needs the triton package")
    name = torch.cuda.get_device_name()
    peak = args.peak_bw_gbs or next((v for k, v in PEAK_BW_GBS.items() if k in name), 4800.0)
    wanted = args.linears.split(",")
    sweep = SWEEP if args.sweep else {}
    print(f"{name}: tiles {inv.BLOCK_M}x{inv.BLOCK_N}x{inv.BLOCK_K}, {inv.NUM_WARPS} warps, "
          f"{inv.NUM_STAGES} stages; peak {peak:.0f} GB/s", flush=True)
    rows = []
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        for lin, n, k in (x for x in LINEARS if x[0] in wanted):
            for m in (int(v) for v in args.ms.split(",")):
                row = measure(lin, n, k, m, dtype, args.calls, args.replays, peak, sweep)
                rows.append(row)
                print(f"{dname} {lin} {n}<-{k} M={m}: torch {row['torch_us']:.1f} us, "
                      f"bmm_nt {row['bmm_nt_us']:.1f} us (x{row['slowdown']:.2f}); err torch "
                      f"{row['torch_err']:.2e} bmm_nt {row['bmm_nt_err']:.2e}; row 0 invariant "
                      f"bmm_nt {row['bmm_nt_row0_invariant']} torch "
                      f"{row['torch_row0_invariant']}", flush=True)
    print("\n| dtype | linear | N <- K | M | torch us | bmm_nt us | bmm_nt / torch | "
          "torch TFLOP/s | bmm_nt TFLOP/s | bmm_nt % of HBM bound | invariant |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['dtype'].removeprefix('torch.')} | {r['linear']} | {r['n']} <- {r['k']} | "
              f"{r['m']} | {r['torch_us']:.1f} | {r['bmm_nt_us']:.1f} | {r['slowdown']:.2f} | "
              f"{r['torch_tflops']:.1f} | {r['bmm_nt_tflops']:.1f} | "
              f"{100 * r['bmm_nt_fraction_of_bound']:.1f} | {r['bmm_nt_row0_invariant']} |")
    if sweep:
        print("\n| dtype | linear | M | " + " | ".join(["TILES", *sweep]) + " |  (us per call)")
        print("|---|---|---:|" + "---:|" * (1 + len(sweep)))
        for r in rows:
            cells = [f"{r['bmm_nt_us']:.1f}"] + [
                f"{r[f'{c}_us']:.1f}" + ("" if r[f"{c}_row0_invariant"] else " (NOT INVARIANT)")
                for c in sweep]
            print(f"| {r['dtype'].removeprefix('torch.')} | {r['linear']} | {r['m']} | "
                  + " | ".join(cells) + " |")
    totals = _forward_totals(rows, args.layers)
    if all(x in wanted for x, _, _ in LINEARS):
        print(f"\none forward's linears ({args.layers} layers + lm_head):")
        for key, t in totals.items():
            print(f"  {key}: torch {t['torch_us'] / 1e3:.2f} ms, bmm_nt "
                  f"{t['bmm_nt_us'] / 1e3:.2f} ms (x{t['bmm_nt_us'] / t['torch_us']:.2f})")
    ok = all(r["bmm_nt_row0_invariant"] for r in rows)
    print(f"\nbmm_nt row 0 bitwise equal to the 1-row call everywhere: {ok}")
    result = {"device": name, "peak_bw_gbs": peak, "invariant": ok, "rows": rows,
              "forward_totals": totals, "args": vars(args), "sweep": sweep,
              "tiles": {"block_m": inv.BLOCK_M, "block_n": inv.BLOCK_N, "block_k": inv.BLOCK_K,
                        "num_warps": inv.NUM_WARPS, "num_stages": inv.NUM_STAGES}}
    out = args.out or (os.path.join(os.environ["OUT"], "invariant_matmul.json")
                       if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
