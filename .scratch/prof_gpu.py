import asyncio, time, torch, sys
sys.argv = ["x"]
from palaestra.benchmarks.perf.engine import gpu_model, _prompts
from palaestra.rollout.engines.local import LocalEngine
from palaestra.rollout.engines.base import SamplingParams
model = gpu_model("qwen3-0.6b")
B = 256
eng = LocalEngine(hf_model=model, device="cuda", dtype=torch.bfloat16, max_running=B, max_model_len=456, max_prefill_tokens=16384, prefix_cache_tokens=0)
prompts = _prompts(B, 64, 192, 0, 151936)
# instrument
import palaestra.rollout.engines.local as L
times = {"decode": [], "sample": [], "after": [], "prefill": []}
orig_decode, orig_sample, orig_after = eng._decode, eng._sample, eng._after_step
def timed(name, fn):
    def w(*a):
        torch.cuda.synchronize(); t = time.perf_counter(); r = fn(*a); torch.cuda.synchronize()
        times[name].append(time.perf_counter() - t); return r
    return w
eng._sample = timed("sample", orig_sample)
eng._after_step = timed("after", orig_after)
async def run(n):
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    await asyncio.gather(*(eng.generate(p, params) for p in prompts))
    return time.perf_counter() - t
asyncio.run(run(4))
for k in times: times[k].clear()
steps0 = eng.stats["decode_steps"]
dt = asyncio.run(run(256))
steps = eng.stats["decode_steps"] - steps0
print(f"wall {dt:.2f}s, decode steps {steps}, per step {dt/steps*1000:.2f} ms")
for k, v in times.items():
    if v: print(k, f"n={len(v)} mean {sum(v)/len(v)*1000:.3f} ms total {sum(v):.2f}s")
g = eng._graphs
print("captures", g.captures, "replays", g.replays, "graph keys", sorted(g._graphs))
for key, (graph, tb, pb, out) in sorted(g._graphs.items()):
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20): graph.replay()
    torch.cuda.synchronize(); print("replay", key, f"{(time.perf_counter()-t)/20*1000:.3f} ms")
# eager decode for comparison at B=256, lp=512
pos = torch.full((B,), 300, device="cuda"); tok = torch.zeros(B, dtype=torch.long, device="cuda")
with torch.inference_mode():
    for _ in range(3): eng.decoder.decode(tok, pos, eng.cache, 320)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10): eng.decoder.decode(tok, pos, eng.cache, 320)
    torch.cuda.synchronize(); print("eager decode lk=320", (time.perf_counter()-t)/10*1000, "ms")
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        eng.decoder.decode(tok, pos, eng.cache, 320); torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=15))
asyncio.run(eng.close())
