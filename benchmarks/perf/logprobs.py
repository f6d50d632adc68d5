"""The trainer's logprob path: materialised logits vs fused chunks vs Liger; CPU bf16 autocast.

On one GPU (Qwen3-0.6B shapes: hidden 1024, vocabulary 151,936; a packed micro-batch of 16k
tokens of ~200-token sequences)::

    python -m palaestra.benchmarks.perf.logprobs --device cuda --json logprobs_gpu.json

Here, in seconds (a tiny shape), plus the CPU autocast side by side::

    python -m palaestra.benchmarks.perf.logprobs --device cpu --cpu-autocast --json cpu.json

Three tables:

- ``head``: the output layer alone, ``hidden -> token logprobs (+ entropy)``, forward + backward
  of an RL-style loss ``sum(logp * adv) [+ coef * sum(entropy)]``, per path: ``materialised``
  (both backends' former path: ``lm_head`` -> ``[T, V]`` logits -> whole float32 log-softmax
  kept for the backward), ``logits`` (the logits, then the chunked function that both backends
  now use on logits: `palaestra.trainers.megatron.logprobs.vocab_parallel_logprobs`), ``fused``
  (`fused_logprobs`, chunks recomputed in the backward), ``liger`` (Liger's fused linear cross
  entropy for the logprobs + the no-grad fused pass for the entropy metric; where installed, on
  CUDA); once with the entropy as a metric only and once trained (``entropy_coef > 0``; Liger
  has no entropy output, so no liger row there). Median time, peak memory above the inputs,
  max |logprob| / |entropy| difference and max relative gradient difference vs the first row.
- ``step``: `TorchBackend.train_step` (GRPO loss, entropy as metric) on a random-init model
  (``qwen3-0.6b`` on CUDA with varlen attention and 16k-token micro-batches, ``tiny`` on CPU)
  for ``fused_logprobs`` off (chunked logits path) / on and ``kernels`` torch/liger: median step
  time, peak memory, max/mean |logprob diff| of ``forward_logprobs`` vs the first row (on CUDA
  a float32 model) and vs the bf16 logits row.
- ``cpu_autocast`` (``--cpu-autocast``): the same train step in float32 vs bf16 autocast on the
  quickstart ``tiny`` model and the ``10m`` size of ``vs_trl.py``, with the logprob gap.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from palaestra.benchmarks.perf.lora import synthetic_batch


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _packed_row(tokens: int, seq_len: int, vocab: int, device: str) -> tuple[Any, Any]:
    """``input_ids [1, T]`` and ``valid [1, T]`` (False at each sequence's first token)."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    valid = torch.ones(1, tokens, dtype=torch.bool)
    valid[0, ::seq_len] = False
    return ids.to(device), valid.to(device)


def _head_paths(device: str, chunks: list[int]) -> dict[str, Callable[..., Any]]:
    import torch

    from palaestra.trainers.torch_backend.fused_logprobs import shifted_linear_logprobs
    from palaestra.trainers.torch_backend.kernels import liger_installed, liger_linear_logprobs
    from palaestra.trainers.torch_backend.logprobs import shifted_token_logprobs

    def materialised_path(h: Any, w: Any, ids: Any, valid: Any, ent_grad: bool) -> Any:
        # the backends' former path: whole float32 logits kept for the backward
        logits = torch.nn.functional.linear(h, w).float()[:, :-1]
        lse = torch.logsumexp(logits, dim=-1)
        lp = logits.gather(-1, ids[:, 1:, None])[..., 0] - lse
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        if not ent_grad:
            ent = ent.detach()
        pad = lp.new_zeros(lp.shape[0], 1)
        return (torch.where(valid, torch.cat([pad, lp], 1), 0.0),
                torch.where(valid, torch.cat([pad, ent], 1), 0.0))

    def logits_path(h: Any, w: Any, ids: Any, valid: Any, ent_grad: bool) -> Any:
        logits = torch.nn.functional.linear(h, w)
        logp, ent = shifted_token_logprobs(logits, ids, valid, with_entropy=ent_grad)
        if ent is None:
            with torch.no_grad():
                ent = shifted_token_logprobs(logits.detach(), ids, valid, with_entropy=True)[1]
        return logp, ent

    def fused_path(h: Any, w: Any, ids: Any, valid: Any, ent_grad: bool, chunk: int) -> Any:
        logp, ent = shifted_linear_logprobs(h, w, ids, valid, with_entropy=True,
                                            chunk_tokens=chunk)
        assert ent is not None
        return logp, (ent if ent_grad else ent.detach())

    def liger_path(h: Any, w: Any, ids: Any, valid: Any, ent_grad: bool, chunk: int) -> Any:
        mask = valid[:, 1:]
        lp = liger_linear_logprobs(h[:, :-1][mask], w, ids[:, 1:][mask])
        full = lp.new_zeros(mask.shape).masked_scatter(mask, lp)
        logp = torch.cat([full.new_zeros(1, 1), full], dim=1)
        with torch.no_grad():
            ent = shifted_linear_logprobs(h.detach(), w.detach(), ids, valid, with_entropy=True,
                                          chunk_tokens=chunk)[1]
        return logp, ent

    paths: dict[str, Callable[..., Any]] = {"materialised": materialised_path,
                                            "logits": logits_path}
    for chunk in chunks:
        paths[f"fused/{chunk}"] = partial(fused_path, chunk=chunk)
    if device.startswith("cuda") and liger_installed():
        paths["liger"] = partial(liger_path, chunk=chunks[0])
    return paths


def bench_head(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Forward + backward of the output layer's logprob path, per path and entropy mode."""
    import torch

    dev, cuda = args.device, args.device.startswith("cuda")
    hidden, vocab, tokens = (1024, 151_936, 16_384) if cuda else (128, 1024, 2048)
    hidden, vocab, tokens = args.hidden or hidden, args.vocab or vocab, args.tokens or tokens
    ids, valid = _packed_row(tokens, args.seq_len, vocab, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    h0 = torch.randn(1, tokens, hidden, device=dev, generator=g)
    w0 = torch.randn(vocab, hidden, device=dev, generator=g) * hidden ** -0.5
    adv = torch.randn(1, tokens, device=dev, generator=g)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast(
        "cpu", enabled=False)
    rows: list[dict[str, Any]] = []
    for ent_grad in (False, True):
        ref: dict[str, Any] = {}
        for name, fn in _head_paths(dev, args.chunks).items():
            if ent_grad and name == "liger":
                continue
            times, out = [], {}
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            for rep in range(args.reps + 1):
                h = h0.clone().requires_grad_(True)
                w = w0.clone().requires_grad_(True)
                _sync(dev)
                t0 = time.perf_counter()
                with autocast:
                    logp, ent = fn(h, w, ids, valid, ent_grad)
                loss = (logp * adv).sum() + (0.01 * ent.sum() if ent_grad else 0.0)
                loss.backward()
                _sync(dev)
                if rep:
                    times.append(time.perf_counter() - t0)
                out = {"logp": logp.detach(), "ent": ent.detach(), "gh": h.grad, "gw": w.grad}
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0
            if not ref:
                ref = out

            def rel(a: Any, b: Any) -> float:
                return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

            rows.append({
                "path": name, "entropy": "trained" if ent_grad else "metric",
                "tokens": tokens, "hidden": hidden, "vocab": vocab,
                "ms": 1e3 * statistics.median(times), "peak_gib": peak,
                "max_dlogp": float((out["logp"] - ref["logp"]).abs().max()),
                "max_dentropy": float((out["ent"] - ref["ent"]).abs().max()),
                "grad_h_rel": rel(out["gh"], ref["gh"]), "grad_w_rel": rel(out["gw"], ref["gw"]),
            })
            del out, h, w, logp, ent, loss
    return rows


def _time_steps(model: Path, settings: dict[str, Any], batch: Any, reps: int, device: str
                ) -> dict[str, Any]:
    import torch

    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    backend = TorchBackend(model, TorchBackendConfig(device=device, lr=1e-5, **settings))
    logps = backend.forward_logprobs(batch)  # the same initial weights in every row
    loss = LossConfig(preset="grpo")
    times = []
    for rep in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        backend.train_step(batch, loss)
        _sync(device)
        if rep:  # the first step allocates the optimizer state
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    result = {"step_s": statistics.median(times), "peak_gib": peak, "logps": logps,
              "compute_dtype": str(backend.compute_dtype).removeprefix("torch."),
              "kernels": backend.kernels}
    del backend
    return result


def _gap(a: list[Any], b: list[Any]) -> tuple[float, float]:
    import torch

    diffs = torch.cat([(x - y).abs()[1:] for x, y in zip(a, b)])
    return float(diffs.max()), float(diffs.mean())


def _model(size: str, work: Path, device: str) -> Path:
    from palaestra.tiny_model import build_model

    if size == "qwen3-0.6b" and device.startswith("cuda"):
        from palaestra.benchmarks.perf.weight_sync import build_checkpoint

        return build_checkpoint("0.6b", work / size)  # the 151,936-token vocabulary
    return build_model(work / size, size, max_position_embeddings=1024)


def bench_step(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """`TorchBackend.train_step` with the fused path off/on (and Liger's kernels)."""
    from palaestra.trainers.torch_backend.kernels import liger_installed

    cuda = args.device.startswith("cuda")
    size = args.size or ("qwen3-0.6b" if cuda else "tiny")
    model = _model(size, work, args.device)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    seqs, tokens = (160, args.seq_len) if cuda else (16, 64)
    batch = synthetic_batch(args.seqs or seqs, tokens, min(vocab, 1000))
    # the loop's GPU settings (docs/results.md): varlen attention, 16k-token packed micro-batches
    common: dict[str, Any] = {"cpu_autocast": "off", "logprob_chunk_tokens": args.chunks[0]}
    if cuda:
        common.update(attn_implementation="varlen", max_tokens_per_micro_batch=16384)
    torch_kernels = {"kernels": "torch"}
    variants: list[tuple[str, dict[str, Any]]] = [
        ("logits", {"fused_logprobs": False, **torch_kernels}),
        ("fused", {"fused_logprobs": True, **torch_kernels})]
    if cuda:  # the float32 model: the yardstick of the bf16 rows' logprob gaps
        variants.insert(0, ("float32 logits", {"dtype": "float32", "fused_logprobs": False,
                                               **torch_kernels}))
    if cuda and liger_installed():
        variants += [("liger kernels + logits", {"kernels": "liger", "fused_logprobs": False}),
                     ("liger kernels + fused", {"kernels": "liger", "fused_logprobs": True})]
    rows: list[dict[str, Any]] = []
    first: list[Any] | None = None
    second: list[Any] | None = None
    for name, settings in variants:
        r = _time_steps(model, {**common, **settings}, batch, args.reps, args.device)
        logps = r.pop("logps")
        first = first or logps
        gap_max, gap_mean = _gap(logps, first)
        row = {"variant": name, "model": size, "seqs": len(batch.lengths),
               "tokens": int(sum(batch.lengths)), **r, "max_dlogp": gap_max,
               "mean_dlogp": gap_mean}
        if cuda:  # vs the bf16 logits path too
            second = second or (logps if name == "logits" else None)
            if second is not None:
                row["max_dlogp_vs_bf16_logits"], row["mean_dlogp_vs_bf16_logits"] = _gap(
                    logps, second)
        rows.append(row)
    return rows


def bench_cpu_autocast(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """CPU train step in float32 vs bf16 autocast on the tiny, small and 10m models.

    Both backends start from the same weights and step alternately; the time is the fastest
    of ``--reps`` steps (the box is shared: the minimum is the least disturbed reading).
    """
    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig
    from palaestra.trainers.torch_backend.kernels import cpu_has_bf16

    loss = LossConfig(preset="grpo")
    rows = []
    for size, seqs, tokens in (("tiny", 16, 64), ("small", 16, 128), ("10m", 16, 128)):
        model = _model(size, work, "cpu")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        batch = synthetic_batch(seqs, tokens, vocab)
        backends = {mode: TorchBackend(model, TorchBackendConfig(
            device="cpu", lr=1e-5, cpu_autocast=mode, pack_sequences=False))
            for mode in ("off", "bf16")}
        logps = {mode: b.forward_logprobs(batch) for mode, b in backends.items()}
        times: dict[str, list[float]] = {mode: [] for mode in backends}
        for rep in range(args.reps + 1):
            for mode, backend in backends.items():
                t0 = time.perf_counter()
                backend.train_step(batch, loss)
                if rep:
                    times[mode].append(time.perf_counter() - t0)
        for mode, backend in backends.items():
            gap_max, gap_mean = _gap(logps[mode], logps["off"])
            rows.append({"model": size, "autocast": mode, "cpu_bf16": cpu_has_bf16(),
                         "compute_dtype": str(backend.compute_dtype).removeprefix("torch."),
                         "step_s": min(times[mode]),
                         "speedup": min(times["off"]) / min(times[mode]),
                         "max_dlogp": gap_max, "mean_dlogp": gap_mean})
        del backends
    return rows


def _print(title: str, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(f"\n## {title}")
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = [f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys]
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (after 1)")
    parser.add_argument("--tokens", type=int, default=None, help="head: tokens per micro-batch")
    parser.add_argument("--hidden", type=int, default=None, help="head: hidden size")
    parser.add_argument("--vocab", type=int, default=None, help="head: vocabulary")
    parser.add_argument("--seq-len", type=int, default=200, help="tokens per packed sequence")
    parser.add_argument("--chunks", default="4096", help="fused path: tokens per chunk, "
                        "comma-separated (one head row each)")
    parser.add_argument("--size", default=None, help="step: model size (tiny_model.SIZES)")
    parser.add_argument("--seqs", type=int, default=None, help="step: sequences per batch")
    parser.add_argument("--skip", default="", help="comma-separated tables to skip: head,step")
    parser.add_argument("--cpu-autocast", action="store_true",
                        help="also time the CPU train step in float32 vs bf16 autocast")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.chunks = [int(c) for c in args.chunks.split(",")]
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    args.reps = args.reps or (5 if args.device.startswith("cuda") else 3)
    skip = set(filter(None, args.skip.split(",")))
    work = Path(tempfile.mkdtemp(prefix="palaestra-logprobs-bench-"))
    result: dict[str, Any] = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
    if "head" not in skip:
        result["head"] = bench_head(args)
        _print("head: hidden -> logprobs (+entropy), forward+backward", result["head"])
    if "step" not in skip:
        result["step"] = bench_step(args, work)
        _print("step: TorchBackend.train_step", result["step"])
    if args.cpu_autocast:
        result["cpu_autocast"] = bench_cpu_autocast(args, work)
        _print("cpu_autocast: train step float32 vs bf16", result["cpu_autocast"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
