"""LocalEngine vs Hugging Face ``generate``: decode throughput and a multi-turn tool-use workload.

CPU (the tiny local models; no downloads), from the repository root::

    python -m palaestra.benchmarks.perf.engine --size 10m --batches 1,8,32,64 --json engine.json

GPU (random-init Qwen3-0.6B shape, bf16, CUDA graphs)::

    python -m palaestra.benchmarks.perf.engine --device cuda --shape qwen3-0.6b --batch 256

``--decode-attention triton`` runs decode attention through the split-KV kernel
(`palaestra.engines.local.decode_attention`) instead of the dense batched GEMMs;
``--no-graph-sampling`` samples after each graph replay instead of inside the graph.

Sections:

- **throughput**: B prompts of random lengths in ``--prompt-len LO:HI`` each generate
  ``--new-tokens`` tokens (EOS ignored, so both sides produce the same count). LocalEngine gets
  all B requests at once; HF ``generate`` gets them as one left-padded batch. Reported: output
  tokens/s end to end (prefill included) and decode tokens/s, i.e. ``B * (N - 1)`` over the time
  of an N-token run minus that of a 1-token run (same method for both sides).
- **multi-turn** (CPU): E episodes of 4 turns of tool use; the prompt is the real chat template
  with two tool schemas, every turn appends 32 sampled tokens and a tool response (a calculator
  value, a Search-R1-style result of three short documents, a value). LocalEngine runs the
  episodes concurrently with session ids (prefix reuse, and the shared system prompt is
  prefilled once); HF runs each turn as one batch over the whole conversation so far.
- **GPU**: decode tokens/s at ``--batch`` and its fraction of the memory-bandwidth bound: each
  decode step must read every weight once plus each request's KV cache, so at most
  ``B / ((weight bytes + KV bytes read) / peak bandwidth)`` tokens/s.

Numbers on a shared CPU machine move with its load: every measurement is the best of
``--repeats`` runs, and the table shows the load average. Imports only torch, transformers and
palaestra (no ray, gymnasium or openai).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from palaestra.contracts import ChatTool, Tokenizer

PEAK_BW_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0}
QWEN3_SHAPES = ("qwen3-0.6b", "qwen3-1.7b")  # model cards in palaestra.model_shapes.NAMED_SHAPES


def _prompts(n: int, lo: int, hi: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(rng.randrange(lo, hi))]
            for _ in range(n)]


def _best(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        times.append(fn())
    return min(times)


# ----------------------------------------------------------------------------------- engines
def _engine_run(engine: Any, prompts: list[list[int]], new_tokens: int) -> float:
    from palaestra.engine import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)

    async def go() -> float:
        await engine.flush_cache()
        t = time.perf_counter()
        gens = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        dt = time.perf_counter() - t
        assert all(len(g.token_ids) == new_tokens for g in gens)
        return dt

    return asyncio.run(go())


def _hf_run(model: Any, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    import torch

    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as generate wants for decoder-only models
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    with torch.inference_mode():
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
    assert out.shape[1] == width + new_tokens
    return dt


def throughput(engine: Any, hf: Any, batches: list[int], lo: int, hi: int, new_tokens: int,
               repeats: int, vocab: int, device: str, run_hf: bool = True) -> list[dict[str, Any]]:
    rows = []
    for b in batches:
        prompts = _prompts(b, lo, hi, seed=b, vocab=vocab)
        row: dict[str, Any] = {"batch": b, "prompt_tokens": sum(map(len, prompts)),
                               "new_tokens": new_tokens}
        sides = [("engine", lambda n: _engine_run(engine, prompts, n))]
        if run_hf:
            sides.append(("hf", lambda n: _hf_run(hf, prompts, n, device)))
        for name, run in sides:
            run(2)  # warm-up (allocations, graphs, kernels)
            full = _best(lambda: run(new_tokens), repeats)
            one = _best(lambda: run(1), repeats)
            row[f"{name}_e2e_tok_s"] = b * new_tokens / full
            row[f"{name}_decode_tok_s"] = b * (new_tokens - 1) / max(full - one, 1e-9)
            row[f"{name}_s"] = full
        if run_hf:
            row["decode_speedup"] = row["engine_decode_tok_s"] / row["hf_decode_tok_s"]
            row["e2e_speedup"] = row["engine_e2e_tok_s"] / row["hf_e2e_tok_s"]
        rows.append(row)
        print(_fmt_row(row), flush=True)
    return rows


def _fmt_row(row: dict[str, Any]) -> str:
    parts = [f"B={row['batch']:>3}"]
    for side in ("engine", "hf"):
        if f"{side}_decode_tok_s" in row:
            parts.append(f"{side}: decode {row[f'{side}_decode_tok_s']:8.0f} tok/s, "
                         f"e2e {row[f'{side}_e2e_tok_s']:8.0f} tok/s")
    if "decode_speedup" in row:
        parts.append(f"x{row['decode_speedup']:.2f} decode, x{row['e2e_speedup']:.2f} e2e")
    return " | ".join(parts)


# -------------------------------------------------------------------------------- multi-turn
def _episode_tokens(tokenizer: Tokenizer) -> tuple[list[int], list[list[int]]]:
    """The first prompt (system with a tool schema + a question) and 3 tool-response deltas."""
    tools: list[ChatTool] = [{"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {"type": "object", "properties": {"expression": {
            "type": "string", "description": "the expression, e.g. 12 * (3 + 4)"}},
            "required": ["expression"]}}},
        {"type": "function", "function": {
            "name": "search", "description": "Search a document index for information.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                           "required": ["query"]}}}]
    messages = [
        {"role": "system", "content": "You are a careful assistant. Use the tools to compute "
                                      "every number; answer with the final value."},
        {"role": "user", "content": "A shop sells 17 boxes of 24 pencils and 9 boxes of 36 "
                                    "pencils. How many pencils are there, and what is the "
                                    "total price at 3 dollars per dozen?"}]
    first = tokenizer.encode(str(tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False)),
        add_special_tokens=False)
    # tool results: a calculator value, a search result of three short documents (Search-R1
    # style), another calculator value
    rng = random.Random(0)
    words = ("pencil box dozen price store school supply wooden graphite count total each "
             "pack sold dollars cents retail wholesale order unit").split()
    docs = "\n".join(f"Doc {i + 1}(Title: {' '.join(rng.choice(words) for _ in range(4))}) "
                     + " ".join(rng.choice(words) for _ in range(25)) for i in range(3))
    results = ('{"result": 408}', docs, '{"result": 183}')
    deltas = []
    for result in results:
        text = (f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{result}\n"
                "</tool_response><|im_end|>\n<|im_start|>assistant\n")
        deltas.append(tokenizer.encode(text, add_special_tokens=False))
    return first, deltas


def multi_turn(engine: Any, hf: Any, tokenizer: Tokenizer, episodes: int, turn_tokens: int,
               repeats: int) -> dict[str, Any]:
    from palaestra.engine import SamplingParams

    first, deltas = _episode_tokens(tokenizer)
    turns = len(deltas) + 1
    params = SamplingParams(max_new_tokens=turn_tokens, temperature=0, ignore_eos=True)

    def run_engine() -> float:
        async def episode(e: int) -> None:
            ids = [*first[:-3], 10 + e, *first[-3:]]  # episodes differ from the question on
            for t in range(turns):
                gen = await engine.generate(ids, params, session_id=f"ep{e}")
                ids = ids + list(gen.token_ids) + (deltas[t] if t < len(deltas) else [])

        async def go() -> float:
            await engine.flush_cache()
            t0 = time.perf_counter()
            await asyncio.gather(*(episode(e) for e in range(episodes)))
            return time.perf_counter() - t0

        return asyncio.run(go())

    def run_hf() -> float:
        convs = [[*first[:-3], 10 + e, *first[-3:]] for e in range(episodes)]
        total = 0.0
        for t in range(turns):
            total += _hf_run(hf, convs, turn_tokens, "cpu")
            # the generated ids are not needed for timing: greedy tokens of a random model;
            # append the same count so the next turn's prompt has the right length
            convs = [c + [11] * turn_tokens + (deltas[t] if t < len(deltas) else [])
                     for c in convs]
        return total

    run_engine()
    before = dict(engine.stats)
    t_engine = _best(run_engine, repeats)
    after = engine.stats
    t_hf = _best(run_hf, repeats)
    generated = episodes * turns * turn_tokens
    runs = repeats
    row = {
        "episodes": episodes, "turns": turns, "turn_tokens": turn_tokens,
        "first_prompt_tokens": len(first) + 1, "engine_s": t_engine, "hf_s": t_hf,
        "engine_tok_s": generated / t_engine, "hf_tok_s": generated / t_hf,
        "speedup": t_hf / t_engine,
        "engine_prefill_tokens_per_run": (after["prefill_tokens"] - before["prefill_tokens"]) // runs,
        "engine_cached_tokens_per_run": (after["cached_tokens"] - before["cached_tokens"]) // runs,
    }
    print(f"multi-turn: {episodes} episodes x {turns} turns | engine {row['engine_tok_s']:.0f} "
          f"tok/s ({row['engine_prefill_tokens_per_run']} prompt tokens computed, "
          f"{row['engine_cached_tokens_per_run']} reused) | hf {row['hf_tok_s']:.0f} tok/s | "
          f"x{row['speedup']:.2f}", flush=True)
    return row


# -------------------------------------------------------------------------------------- GPU
def gpu_model(shape: str) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from palaestra.model_shapes import NAMED_SHAPES

    card = {k: v for k, v in NAMED_SHAPES[shape].items() if k != "model_type"}
    config = Qwen3Config(**card, eos_token_id=151645, pad_token_id=151643)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()  # type: ignore[arg-type]  # transformers' .to stub
    return model


def bandwidth_bound(engine: Any, batch: int, prompt_tokens: int, new_tokens: int,
                    peak_gbs: float) -> float:
    """Tokens/s if every decode step only read the weights and the live KV once."""
    weights = engine.decoder.num_bytes()
    kv_token = engine.cache.bytes_per_token
    avg_ctx = prompt_tokens / batch + new_tokens / 2
    step_bytes = weights + batch * avg_ctx * kv_token
    return batch / (step_bytes / (peak_gbs * 1e9))


def run_gpu(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from palaestra.engines.local.local import LocalEngine

    name = torch.cuda.get_device_name()
    peak = args.peak_bw_gbs or next((v for k, v in PEAK_BW_GBS.items() if k in name), None)
    model = gpu_model(args.shape)
    lo, hi = (int(x) for x in args.prompt_len.split(":"))
    engine = LocalEngine(hf_model=model, device="cuda", dtype=torch.bfloat16,
                         max_running=args.batch, max_model_len=hi + args.new_tokens + 8,
                         max_prefill_tokens=16384, prefix_cache_tokens=0,
                         cuda_graphs=not args.no_cuda_graphs, decode_steps=args.decode_steps,
                         decode_attention=args.decode_attention)
    if engine._graphs is not None:
        engine._graphs.sample_in_graph = not args.no_graph_sampling
    rows = throughput(engine, model, [args.batch], lo, hi, args.new_tokens, args.repeats,
                      151936, "cuda", run_hf=not args.no_hf)
    row = rows[0]
    bound = bandwidth_bound(engine, args.batch, row["prompt_tokens"], args.new_tokens,
                            peak or float("nan"))
    row.update(device=name, shape=args.shape, peak_bw_gbs=peak, bandwidth_bound_tok_s=bound,
               engine_fraction_of_bound=row["engine_decode_tok_s"] / bound,
               weight_bytes=engine.decoder.num_bytes(), kv_bytes_per_token=engine.cache.bytes_per_token,
               cuda_graph_captures=getattr(engine._graphs, "captures", 0),
               decode_steps=engine.decode_steps, decode_attention=engine.decode_attention,
               sample_in_graph=bool(engine._graphs and engine._graphs.sample_in_graph))
    if "hf_decode_tok_s" in row:
        row["hf_fraction_of_bound"] = row["hf_decode_tok_s"] / bound
    print(f"{name}: engine decode ({engine.decode_attention} attention) "
          f"{row['engine_decode_tok_s']:.0f} tok/s = "
          f"{100 * row['engine_fraction_of_bound']:.1f}% of the bandwidth bound "
          f"({bound:.0f} tok/s at {peak} GB/s)", flush=True)
    asyncio.run(engine.close())
    return {"gpu": row}


# ------------------------------------------------------------------------------------- main
def run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from palaestra.engines.local.local import LocalEngine
    from palaestra.tiny_model import build_model

    torch.set_num_threads(args.threads)
    path = Path(args.model_dir or f"/tmp/palaestra-bench-{args.size}")
    if not (path / "config.json").is_file():
        build_model(path, args.size)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    batches = [int(b) for b in args.batches.split(",")]
    lo, hi = (int(x) for x in args.prompt_len.split(":"))
    engine = LocalEngine(str(path), device="cpu", max_running=max(batches),
                         prefix_cache_tokens=0)
    out: dict[str, Any] = {"load_average_before": os.getloadavg()}
    out["throughput"] = throughput(engine, hf, batches, lo, hi, args.new_tokens, args.repeats,
                                   hf.config.vocab_size, "cpu")
    asyncio.run(engine.close())
    if args.episodes:
        engine = LocalEngine(str(path), device="cpu", max_running=args.episodes)
        out["multi_turn"] = multi_turn(engine, hf, tokenizer, args.episodes, args.turn_tokens,
                                       args.repeats)
        asyncio.run(engine.close())
    out["load_average_after"] = os.getloadavg()
    return out


def print_table(result: dict[str, Any]) -> None:
    rows = result.get("throughput") or ([result["gpu"]] if "gpu" in result else [])
    print("\n| batch | engine decode tok/s | HF decode tok/s | speedup | engine e2e tok/s | "
          "HF e2e tok/s | speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['engine_decode_tok_s']:.0f} | "
              f"{r.get('hf_decode_tok_s', float('nan')):.0f} | {r.get('decode_speedup', float('nan')):.2f}x | "
              f"{r['engine_e2e_tok_s']:.0f} | {r.get('hf_e2e_tok_s', float('nan')):.0f} | "
              f"{r.get('e2e_speedup', float('nan')):.2f}x |")
    mt = result.get("multi_turn")
    if mt:
        print(f"\nmulti-turn ({mt['episodes']} episodes x {mt['turns']} turns, "
              f"{mt['turn_tokens']} tokens/turn): engine {mt['engine_tok_s']:.0f} tok/s, HF "
              f"{mt['hf_tok_s']:.0f} tok/s, {mt['speedup']:.2f}x")
    if "gpu" in result:
        g = result["gpu"]
        print(f"\nGPU {g['device']} {g['shape']} batch {g['batch']}: "
              f"{100 * g['engine_fraction_of_bound']:.1f}% of the bandwidth bound")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--size", default="10m", help="tiny-model size on CPU (micro/tiny/small/10m)")
    p.add_argument("--model-dir", default=None, help="CPU model directory (built if missing)")
    p.add_argument("--batches", default="1,8,32,64", help="CPU batch sizes")
    p.add_argument("--prompt-len", default=None, help="LO:HI prompt lengths (CPU 32:256, GPU 64:192)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per request (CPU 64, GPU 256)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (both sides)")
    p.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    p.add_argument("--episodes", type=int, default=8, help="multi-turn episodes (0 = skip)")
    p.add_argument("--turn-tokens", type=int, default=32, help="tokens sampled per turn")
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(QWEN3_SHAPES))
    p.add_argument("--batch", type=int, default=256, help="GPU batch")
    p.add_argument("--peak-bw-gbs", type=float, default=None, help="GPU memory bandwidth")
    p.add_argument("--no-hf", action="store_true", help="GPU: skip the HF generate baseline")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--decode-steps", type=int, default=None,
                   help="LocalEngine decode steps per host sync (default: 8 on CUDA, 1 on CPU)")
    p.add_argument("--decode-attention", default="dense", choices=("dense", "triton", "auto"),
                   help="GPU: LocalEngine's decode attention (dense GEMMs or the split-KV kernel)")
    p.add_argument("--no-graph-sampling", action="store_true",
                   help="GPU: sample after each CUDA graph replay, not inside the graph")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    args.prompt_len = args.prompt_len or ("64:192" if gpu else "32:256")
    args.new_tokens = args.new_tokens or (256 if gpu else 64)
    result = run_gpu(args) if gpu else run_cpu(args)
    result["args"] = vars(args)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
