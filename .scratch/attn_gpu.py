import torch, time, torch.nn.functional as F
B, Hkv, rep, D, L, Lk = 256, 8, 2, 128, 456, 320
dt = torch.bfloat16
K = torch.randn(B, Hkv, L, D, device="cuda", dtype=dt); V = torch.randn_like(K)
q = torch.randn(B, Hkv * rep, D, device="cuda", dtype=dt)
pos = torch.randint(100, Lk, (B,), device="cuda")
keys = torch.arange(Lk, device="cuda")
fmask = torch.zeros(B, 1, 1, Lk, device="cuda").masked_fill_((keys[None] > pos[:, None]).view(B,1,1,Lk), float("-inf"))
bmask = (keys[None] <= pos[:, None]).view(B, 1, 1, Lk)
def t(name, f, n=50):
    for _ in range(3): f()
    torch.cuda.synchronize(); s = time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); ms = (time.perf_counter()-s)/n*1000
    gbs = 2 * B * Hkv * Lk * D * 2 / (ms/1000) / 1e9
    print(f"{name:40s} {ms:.3f} ms  {gbs:.0f} GB/s (K+V read)")
Kv, Vv = K[:, :, :Lk], V[:, :, :Lk]
def manual():
    qg = q.view(B, Hkv, rep, D) * D**-0.5
    s = torch.matmul(qg, Kv.transpose(-1, -2)).float() + fmask
    p = torch.softmax(s, -1).to(dt)
    return torch.matmul(p, Vv)
t("manual matmul", manual)
qg = q.view(B, Hkv, rep, D)
for name, m in (("sdpa q=rep float mask", fmask.to(dt)), ("sdpa q=rep bool mask", bmask)):
    try:
        t(name, lambda: F.scaled_dot_product_attention(qg, Kv, Vv, attn_mask=m))
    except Exception as e: print(name, "ERR", e)
from torch.nn.attention import sdpa_kernel, SDPBackend
for be in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
    try:
        with sdpa_kernel(be):
            t(f"sdpa {be.name} float mask", lambda: F.scaled_dot_product_attention(qg, Kv, Vv, attn_mask=fmask.to(dt)))
    except Exception as e: print(be.name, "ERR", str(e)[:200])
# flash varlen with seqused_k on a [B, L, Hkv, D] cache
Kb = K.transpose(1, 2).contiguous(); Vb = V.transpose(1, 2).contiguous()
try:
    import inspect
    print(torch.ops.aten._flash_attention_forward.default._schema)
    qf = q.view(B, Hkv*rep, D)
    cu_q = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    cu_k = torch.arange(B + 1, device="cuda", dtype=torch.int32) * L
    used = (pos + 1).to(torch.int32)
    def flash():
        return torch.ops.aten._flash_attention_forward(qf, Kb.view(B*L, Hkv, D), Vb.view(B*L, Hkv, D), cu_q, cu_k, 1, L, 0.0, False, False, scale=D**-0.5, seqused_k=used)
    out = flash()[0]
    ref = manual().reshape(B, Hkv*rep, D)
    print("flash varlen vs manual max err", (out.float() - ref.float()).abs().max().item())
    t("flash varlen seqused_k", flash)
except Exception as e: print("flash ERR", str(e)[:400])
# flash via sdpa when no mask (all same length) just for reference
t("sdpa no mask (upper bound ref)", lambda: F.scaled_dot_product_attention(q.view(B, Hkv*rep, 1, D), Kv, Vv, enable_gqa=True))
