"""The embedded engine on a tiny random Qwen3-MoE: logits, greedy tokens, logprobs and routed
experts against transformers' own ``Qwen3MoeForCausalLM`` (fp32, CPU)."""

from __future__ import annotations

import asyncio
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from palaestra.engine import SamplingParams
from palaestra.engines.bitwise.decoder_config import MoEConfig
from palaestra.engines.local.local import LocalEngine
from palaestra.engines.local.model import Decoder
from palaestra.engines.local.moe import NO_EXPERT

pytestmark = pytest.mark.numerics  # MoE engine logprobs against the HF forward

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def _hf_moe(norm_topk_prob: bool = True, seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    config = Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=256,
        eos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # a router with spread-out logits: no near-ties in the top-k
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def hf_model():
    return _hf_moe()


def _reference(hf_model, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """HF logits [T, V] and the top-k expert ids [T, K] of each layer (None where dense)."""
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_router_logits=True)
    k = hf_model.config.num_experts_per_tok
    sparse = MoEConfig.from_hf(hf_model.config, hf_model.config.num_hidden_layers).sparse_layers
    router = iter(out.router_logits)
    routes: list[torch.Tensor | None] = []
    for i in range(hf_model.config.num_hidden_layers):
        routes.append(torch.topk(next(router).softmax(-1), k, dim=-1).indices
                      if i in sparse else None)
    return out.logits[0], routes


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 96, (int(torch.randint(3, 20, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def test_config_reads_sparse_layers(hf_model) -> None:
    moe = MoEConfig.from_hf(hf_model.config, 3)
    assert moe.sparse_layers == (0, 2) and moe.top_k == 2 and moe.norm_topk_prob
    hf_model.config.decoder_sparse_step = 2
    try:
        assert MoEConfig.from_hf(hf_model.config, 3).sparse_layers == ()
    finally:
        hf_model.config.decoder_sparse_step = 1


@pytest.mark.parametrize("norm", [True, False])
def test_full_forward_matches_hf_logits_and_routes(norm: bool) -> None:
    hf = _hf_moe(norm_topk_prob=norm, seed=1)
    dec = Decoder.from_hf_model(hf)
    ids = _prompts(1, seed=3)[0] + list(range(2, 40))
    ref_logits, ref_routes = _reference(hf, ids)
    logits = dec.prefill_full(torch.tensor(ids))
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    for mine, ref in zip(dec.last_routes, ref_routes):
        if ref is None:
            assert mine is None
        else:
            assert torch.equal(mine.sort(-1).values, ref.sort(-1).values)


def test_loads_the_per_expert_checkpoint_layout(tmp_path, hf_model) -> None:
    """save_pretrained writes ``mlp.experts.{e}.gate_proj.weight``; the engine reads it."""
    hf_model.save_pretrained(tmp_path)
    dec = Decoder.from_pretrained(tmp_path, "cpu", torch.float32)
    ids = list(range(5, 30))
    torch.testing.assert_close(dec.prefill_full(torch.tensor(ids)), _reference(hf_model, ids)[0],
                               atol=1e-4, rtol=1e-4)
    # a partial push by either name lands in the fused tensor
    w = torch.randn(16, 32)
    dec.load_weights([("model.layers.2.mlp.experts.3.up_proj.weight", w)])
    assert torch.equal(dec.weight("model.layers.2.mlp.experts.gate_up_proj")[3, 16:], w)


async def test_engine_greedy_logprobs_and_routes_match_hf(hf_model) -> None:
    engine = LocalEngine(hf_model=hf_model, device="cpu", max_running=4,
                         prefix_cache_tokens=4096)
    try:
        prompts = _prompts(5, seed=7)
        shared = list(range(10, 30))  # two requests share a prefix: the second reuses its KV
        prompts += [shared + [3, 4], shared + [5]]
        gens = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
        later = await engine.generate(shared + [6, 7], GREEDY)
        assert later.cached_tokens > 0
        for p, gen in [*zip(prompts, gens), (shared + [6, 7], later)]:
            with torch.no_grad():
                ref = hf_model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
            assert list(gen.token_ids) == ref[0, len(p):].tolist()
            full = p + list(gen.token_ids)
            logits, routes = _reference(hf_model, full)
            ref_lp = torch.log_softmax(logits[len(p) - 1 : -1], -1)
            ref_lp = ref_lp.gather(1, torch.tensor(gen.token_ids)[:, None])[:, 0]
            assert max(abs(a - b) for a, b in zip(gen.logprobs, ref_lp.tolist())) < 1e-4
            got = gen.meta["routed_experts"]
            assert got.dtype == torch.int16 and got.shape == (len(full) - 1, 3, 2)
            for i, ref_ids in enumerate(routes):
                if ref_ids is None:
                    assert (got[:, i] == NO_EXPERT).all()
                else:
                    assert torch.equal(got[:, i].long().sort(-1).values,
                                       ref_ids[:-1].sort(-1).values)
    finally:
        await engine.close()


async def test_dense_models_return_no_routes(model_dir) -> None:
    engine = LocalEngine(model_dir, device="cpu")
    try:
        gen = await engine.generate([3, 4, 5], GREEDY)
        assert "routed_experts" not in gen.meta
    finally:
        await engine.close()


@pytest.fixture(scope="module")
def moe_tiny_dir(tmp_path_factory) -> str:
    from palaestra.tiny_model import build_model

    return str(build_model(tmp_path_factory.mktemp("moe-tiny"), "moe-tiny"))


def test_init_model_moe_tiny_is_a_qwen3_moe(moe_tiny_dir: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(moe_tiny_dir)
    assert cfg.model_type == "qwen3_moe" and cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    hf = AutoModelForCausalLM.from_pretrained(moe_tiny_dir).eval()
    dec = Decoder.from_pretrained(moe_tiny_dir, "cpu", torch.float32)
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(dec.prefill_full(torch.tensor(ids)), ref, atol=1e-4, rtol=1e-4)


async def test_server_returns_sglang_routed_experts(moe_tiny_dir: str, model_dir: str) -> None:
    """Our /generate speaks SGLang's return_routed_experts; SGLangClient decodes it."""
    import aiohttp

    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.engines.serve.serve import start_server

    engine = LocalEngine(moe_tiny_dir, device="cpu")
    server = await start_server(engine)
    client = SGLangClient(server.url, retries=0, routed_experts=(2, 2))
    plain = SGLangClient(server.url, retries=0)
    try:
        prompt = list(range(5, 25))
        local = await engine.generate(prompt, GREEDY)
        remote = await client.generate(prompt, GREEDY)
        assert remote.token_ids == local.token_ids
        assert torch.equal(remote.meta["routed_experts"], local.meta["routed_experts"])
        assert "routed_experts" not in (await plain.generate(prompt, GREEDY)).meta
    finally:
        await client.close()
        await plain.close()
        await server.close()
        await engine.close()
    dense = LocalEngine(model_dir, device="cpu")
    server = await start_server(dense)
    try:
        async with aiohttp.ClientSession() as s, s.post(server.url + "/generate", json={
                "input_ids": [3, 4], "return_routed_experts": True}) as r:
            assert r.status == 400 and "mixture-of-experts" in await r.text()
    finally:
        await server.close()
        await dense.close()
