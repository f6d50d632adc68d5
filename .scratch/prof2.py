import asyncio, time, torch, sys
import torch.nn.functional as F
from palaestra.benchmarks.perf.engine import gpu_model, _prompts
from palaestra.rollout.engines.local import LocalEngine
from palaestra.rollout.engines.base import SamplingParams
# attention formulations
B, Hkv, rep, D, L, Lk = 256, 8, 2, 128, 456, 320
dt = torch.bfloat16
K = torch.randn(B, Hkv, L, D, device="cuda", dtype=dt); V = torch.randn_like(K)
q = torch.randn(B, Hkv * rep, D, device="cuda", dtype=dt)
def t(name, f, n=50):
    for _ in range(3): f()
    torch.cuda.synchronize(); s = time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); print(f"{name:30s} {(time.perf_counter()-s)/n*1000:.3f} ms")
Kv, Vv = K[:, :, :Lk], V[:, :, :Lk]
qg = q.view(B, Hkv, rep, D)
t("qk normal", lambda: torch.matmul(qg, Kv.transpose(-1, -2)))
t("qk transposed", lambda: torch.matmul(Kv, qg.transpose(-1, -2)))
p = torch.softmax(torch.matmul(qg, Kv.transpose(-1, -2)).float(), -1).to(dt)
t("pv normal", lambda: torch.matmul(p, Vv))
t("pv transposed", lambda: torch.matmul(Vv.transpose(-1, -2), p.transpose(-1, -2)))
t("qk einsum mulsum", lambda: (Kv * qg[:, :, :1]).sum(-1))
model = gpu_model("qwen3-0.6b")
eng = LocalEngine(hf_model=model, device="cuda", dtype=torch.bfloat16, max_running=B, max_model_len=456, max_prefill_tokens=16384, prefix_cache_tokens=0)
prompts = _prompts(B, 64, 192, 0, 151936)
async def run(n):
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    await asyncio.gather(*(eng.generate(p, params) for p in prompts))
asyncio.run(run(40))
from torch.profiler import profile, ProfilerActivity
async def prof():
    params = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)
    tasks = [asyncio.create_task(eng.generate(p, params)) for p in prompts]
    while eng.stats["decode_steps"] < 1 + eng._base: await asyncio.sleep(0)
    await asyncio.sleep(0.05)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
        s0 = eng.stats["decode_steps"]; t0 = time.perf_counter()
        while eng.stats["decode_steps"] < s0 + 20: await asyncio.sleep(0)
        print("20 steps", (time.perf_counter()-t0)/20*1000, "ms/step")
    await asyncio.gather(*tasks)
    print(pr.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
eng._base = eng.stats["decode_steps"]
asyncio.run(prof())
