"""LoRA adapters in the embedded engine (CPU, fp32): a synced adapter gives the merged model's
greedy tokens and logprobs (both modes), and several adapters serve side by side in one batch."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from palaestra.errors import EngineError
from palaestra.engine import SamplingParams
from palaestra.engines.local.local import LocalEngine
from palaestra.engines.local.lora import LoraAdapter

GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 9], [100, 3, 77], [8, 8, 19, 250, 31, 2], [64, 1]]


def make_adapter(model_dir: str, out: Path, seed: int, targets: list[str]) -> tuple[Path, Path]:
    """A peft adapter with random (non-zero) A and B, and the merged model beside it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(str(out / "adapter"))
    merged = model.merge_and_unload()
    merged.save_pretrained(str(out / "merged"))
    for f in Path(model_dir).iterdir():  # the tokenizer
        if f.name.startswith(("tokenizer", "special", "vocab", "merges")):
            (out / "merged" / f.name).write_bytes(f.read_bytes())
    return out / "adapter", out / "merged"


@pytest.fixture(scope="module")
def adapters(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    root = tmp_path_factory.mktemp("lora")
    (root / "a").mkdir()
    (root / "b").mkdir()
    return {"a": make_adapter(model_dir, root / "a", 1, ["q_proj", "v_proj", "down_proj"]),
            "b": make_adapter(model_dir, root / "b", 2, ["q_proj", "k_proj", "v_proj", "o_proj",
                                                         "gate_proj", "up_proj", "down_proj"])}


async def run_all(engine: LocalEngine, loras: list[str | None]) -> list:
    jobs = [engine.generate(p, GREEDY, lora=lora) for p in PROMPTS for lora in loras]
    return await asyncio.gather(*jobs)


def assert_same(got, want) -> None:
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["merged", "lowrank"])
async def test_synced_adapter_matches_the_merged_model(model_dir: str, adapters, mode: str
                                                       ) -> None:
    import json

    from safetensors.torch import load_file

    adapter_dir, merged_dir = adapters["b"]
    state = load_file(str(adapter_dir / "adapter_model.safetensors"))
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    engine = LocalEngine(model_dir, lora_mode=mode, prefix_cache_tokens=0)
    reference = LocalEngine(str(merged_dir), prefix_cache_tokens=0)
    base = LocalEngine(model_dir, prefix_cache_tokens=0)
    try:
        await engine.update_adapter(state, config, version=3)  # what the trainer's sync calls
        assert engine.weight_version == 3
        got = await run_all(engine, [None])
        want = await run_all(reference, [None])
        plain = await run_all(base, [None])
        for g, w in zip(got, want):
            assert_same(g, w)
        assert any(g.token_ids != p.token_ids for g, p in zip(got, plain))
        # a second version replaces the first exactly (merged: re-merged from the base copy)
        await engine.update_adapter(state, config, version=4)
        for g, w in zip(await run_all(engine, [None]), want):
            assert_same(g, w)
        await engine.unload_lora_adapter("policy")  # back to the base model exactly
        for g, p in zip(await run_all(engine, [None]), plain):
            assert g.token_ids == p.token_ids
            assert g.logprobs == p.logprobs if mode == "merged" else True
    finally:
        for e in (engine, reference, base):
            await e.close()


@pytest.mark.parametrize("mode", ["merged", "lowrank"])
async def test_two_adapters_side_by_side_in_one_batch(model_dir: str, adapters, mode: str
                                                      ) -> None:
    engine = LocalEngine(model_dir, lora_mode=mode, prefix_cache_tokens=0)
    refs = {name: LocalEngine(str(merged), prefix_cache_tokens=0)
            for name, (_, merged) in adapters.items()}
    base = LocalEngine(model_dir, prefix_cache_tokens=0)
    try:
        # "a" is the default (merged into the weights in merged mode); "b" is named per request
        await engine.load_lora_adapter("a", str(adapters["a"][0]), default=True)
        await engine.load_lora_adapter("b", str(adapters["b"][0]))
        assert engine.lora_adapters == ["a", "b"]
        before = engine.stats["prefill_steps"]
        got = await run_all(engine, ["a", "b", None])
        assert engine.stats["prefill_steps"] - before < len(got)  # they shared batches
        want_a = await run_all(refs["a"], [None])
        want_b = await run_all(refs["b"], [None])
        for i in range(len(PROMPTS)):
            assert_same(got[3 * i], want_a[i])
            assert_same(got[3 * i + 1], want_b[i])
            assert_same(got[3 * i + 2], want_a[i])  # no name: the default adapter
        assert any(got[3 * i].token_ids != got[3 * i + 1].token_ids for i in range(len(PROMPTS)))
        with pytest.raises(EngineError, match="no LoRA adapter named 'c'"):
            await engine.generate(PROMPTS[0], GREEDY, lora="c")
        await engine.unload_lora_adapter("a")  # no default any more: unnamed runs the base
        plain = await run_all(base, [None])
        for g, p in zip(await run_all(engine, [None]), plain):
            assert g.token_ids == p.token_ids
    finally:
        for e in (engine, base, *refs.values()):
            await e.close()


def test_bad_adapter_folders_are_refused(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="not a peft adapter folder"):
        LoraAdapter.from_folder("x", tmp_path)
    with pytest.raises(EngineError, match="not a LoRA A/B"):
        LoraAdapter.from_peft("x", {"base_model.model.lm_head.weight": torch.zeros(2, 2)},
                              {"r": 2, "lora_alpha": 4})


def _peft_with_unembedding(model_dir: str, seed: int):
    """A peft model whose adapter also trains lm_head (tied to the embedding here), random
    non-zero A and B, and that adapter as the engine parses it."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj", "lm_head"])
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    state = {k: v for k, v in get_peft_model_state_dict(model, save_embedding_layers=False
                                                        ).items() if "lora_" in k}
    cfg = {"r": 4, "lora_alpha": 8, "use_rslora": False}
    return model.eval(), LoraAdapter.from_peft("head", state, cfg)


def _peft_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            tok = int(logp.argmax())
            ids.append(tok)
            lps.append(float(logp[tok]))
    return ids[len(prompt):], lps


@pytest.mark.parametrize("mode", ["merged", "lowrank"])
async def test_an_adapter_on_the_unembedding_matches_peft(model_dir: str, adapters, mode: str
                                                          ) -> None:
    from palaestra.engines.local.parity import FullLogprobsRequest

    model, head = _peft_with_unembedding(model_dir, 3)
    engine = LocalEngine(model_dir, lora_mode=mode, prefix_cache_tokens=0)
    try:
        await engine.load_lora_adapter("head", adapter=head)
        await engine.load_lora_adapter("b", str(adapters["b"][0]))
        # rows of the head adapter next to rows of another adapter and of the base model
        gens = await run_all(engine, ["head", "b", None])
        for i, prompt in enumerate(PROMPTS):
            tokens, lps = _peft_greedy(model, prompt, GREEDY.max_new_tokens)
            got = gens[3 * i]
            assert list(got.token_ids) == tokens
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(lps),
                                       atol=1e-4, rtol=0)
        seq = PROMPTS[2]
        full = await engine.full_logprobs(FullLogprobsRequest.of(seq, range(1, len(seq))),
                                          lora="head")
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1].float(), -1)
        torch.testing.assert_close(full, want, atol=1e-4, rtol=0)
    finally:
        await engine.close()
