"""LocalEngine against transformers: same greedy tokens, same logprobs, same results batched or not,
prefix reuse, weight updates, request control."""

from __future__ import annotations

import asyncio

import pytest
import torch

from palaestra.errors import EngineError
from palaestra.engine import Engine, SamplingParams
from palaestra.engines.local.local import LocalEngine
from palaestra.engines.local.sampling import token_logprobs

from engine_testing import ForcedTokens, prompts

GREEDY = SamplingParams(max_new_tokens=16, temperature=0)


def reference_logprobs(hf_model, prompt: list[int], output: list[int], temperature: float):
    """Logprobs of ``output`` from one full forward pass of the transformers model."""
    full = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = hf_model(full).logits[0, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor(output), temperature)


async def test_is_an_engine(engine: LocalEngine) -> None:
    assert isinstance(engine, Engine)
    assert await engine.health()


async def test_greedy_matches_hf_generate(engine: LocalEngine, hf_model) -> None:
    for prompt in prompts(4, lo=5, hi=30, seed=1):
        gen = await engine.generate(prompt, GREEDY)
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                    pad_token_id=0)[0, len(prompt):].tolist()
        assert list(gen.token_ids) == ref[: len(gen.token_ids)]
        assert len(gen.token_ids) == len(ref)  # both stop at EOS or at 16 tokens
        assert gen.finish_reason == ("stop" if ref[-1] == 2 else "length")


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
async def test_logprobs_match_a_full_forward_pass(engine: LocalEngine, hf_model,
                                                  temperature: float) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_p=0.9, seed=7,
                            ignore_eos=True)
    results = await asyncio.gather(*(engine.generate(p, params) for p in prompts(3, seed=2)))
    for prompt, gen in zip(prompts(3, seed=2), results):
        ref = reference_logprobs(hf_model, prompt, list(gen.token_ids), temperature)
        got = torch.tensor(gen.logprobs)
        assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
        assert all(lp <= 0 for lp in gen.logprobs)


async def test_continuous_batching_equals_one_at_a_time(engine: LocalEngine) -> None:
    batch = prompts(32, lo=2, hi=60, seed=3)
    # staggered arrivals: requests join while others decode, and leave at different lengths
    async def late(i: int, p: list[int]):
        await asyncio.sleep(0.002 * (i % 5))
        n = 4 + i % 7
        return await engine.generate(p, SamplingParams(max_new_tokens=n, temperature=0,
                                                       ignore_eos=True))

    together = await asyncio.gather(*(late(i, p) for i, p in enumerate(batch)))
    assert engine.stats["decode_steps"] < sum(len(g.token_ids) for g in together) / 4
    await engine.flush_cache()
    single = LocalEngine(engine.model_path, prefix_cache_tokens=0)
    try:
        for i, (p, g) in enumerate(zip(batch, together)):
            alone = await single.generate(p, SamplingParams(max_new_tokens=4 + i % 7,
                                                            temperature=0, ignore_eos=True))
            assert alone.token_ids == g.token_ids
            assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(g.logprobs),
                                  atol=1e-4)
    finally:
        await single.close()


async def test_seeded_sampling_does_not_depend_on_the_batch(engine: LocalEngine) -> None:
    p = prompts(1, lo=10, hi=11, seed=4)[0]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50, seed=11,
                            ignore_eos=True)
    alone = await engine.generate(p, params)
    others = [engine.generate(q, SamplingParams(max_new_tokens=12, temperature=1.0))
              for q in prompts(6, seed=5)]
    crowded, *_ = await asyncio.gather(engine.generate(p, params), *others)
    assert crowded.token_ids == alone.token_ids
    unseeded = await asyncio.gather(*(engine.generate(p, SamplingParams(
        max_new_tokens=12, temperature=1.0, ignore_eos=True)) for _ in range(4)))
    assert len({g.token_ids for g in unseeded}) > 1  # sampling does sample


async def test_top_k_and_top_p_restrict_the_support(engine: LocalEngine, hf_model) -> None:
    p = prompts(1, lo=12, hi=13, seed=6)[0]
    gens = await asyncio.gather(*(engine.generate(p, SamplingParams(
        max_new_tokens=1, temperature=1.0, top_k=3, seed=s)) for s in range(40)))
    with torch.inference_mode():
        top3 = set(hf_model(torch.tensor([p])).logits[0, -1].topk(3).indices.tolist())
    firsts = {g.token_ids[0] for g in gens}
    assert firsts <= top3 and len(firsts) > 1
    greedy_first = (await engine.generate(p, GREEDY)).token_ids[0]
    gens = await asyncio.gather(*(engine.generate(p, SamplingParams(
        max_new_tokens=1, temperature=1.0, top_p=1e-6, seed=s)) for s in range(5)))
    assert {g.token_ids[0] for g in gens} == {greedy_first}


async def test_prefix_reuse_computes_fewer_tokens_on_turn_two(engine: LocalEngine) -> None:
    turn1 = prompts(1, lo=60, hi=61, seed=7)[0]
    first = await engine.generate(turn1, SamplingParams(max_new_tokens=8, temperature=0,
                                                        ignore_eos=True), session_id="ep-1")
    assert first.cached_tokens == 0
    before = engine.stats
    turn2 = turn1 + list(first.token_ids) + [11, 12, 13, 14, 15]  # tool response appended
    second = await engine.generate(turn2, GREEDY, session_id="ep-1")
    after = engine.stats
    computed = after["prefill_tokens"] - before["prefill_tokens"]
    reused = after["cached_tokens"] - before["cached_tokens"]
    assert reused == second.cached_tokens == len(turn1) + len(first.token_ids) - 1
    assert computed == len(turn2) - reused == 6
    # and reuse changes nothing in the result
    fresh = LocalEngine(engine.model_path, prefix_cache_tokens=0)
    try:
        again = await fresh.generate(turn2, GREEDY)
        assert again.token_ids == second.token_ids and again.cached_tokens == 0
        assert torch.allclose(torch.tensor(again.logprobs), torch.tensor(second.logprobs),
                              atol=1e-4)
    finally:
        await fresh.close()


async def test_weight_update_changes_outputs_and_bumps_the_version(
        engine: LocalEngine, other_weights_dir: str) -> None:
    from safetensors.torch import load_file

    p = prompts(1, lo=30, hi=31, seed=8)[0]
    before = await engine.generate(p, GREEDY)
    assert before.weight_version == engine.weight_version == 0
    await engine.update_weights(load_file(f"{other_weights_dir}/model.safetensors"))
    assert engine.weight_version == 1 and engine.stats["prefix_cache_entries"] == 0
    after = await engine.generate(p, GREEDY)
    assert after.weight_version == 1 and after.token_ids != before.token_ids
    assert after.cached_tokens == 0  # the old KV was flushed
    reference = LocalEngine(other_weights_dir)
    try:
        assert (await reference.generate(p, GREEDY)).token_ids == after.token_ids
    finally:
        await reference.close()
    await engine.update_weights(path=engine.model_path, version=7)  # back, from disk
    again = await engine.generate(p, GREEDY)
    assert again.token_ids == before.token_ids and again.weight_version == 7


async def test_weight_update_mid_generation_records_both_versions(
        engine: LocalEngine, other_weights_dir: str) -> None:
    from safetensors.torch import load_file

    new = load_file(f"{other_weights_dir}/model.safetensors")
    task = asyncio.create_task(engine.generate(prompts(1, seed=9)[0], SamplingParams(
        max_new_tokens=60, temperature=0, ignore_eos=True)))
    while engine.stats["generated_tokens"] < 3:
        await asyncio.sleep(0.001)
    await engine.update_weights(new, version=5)
    gen = await task
    spans = gen.meta["weight_version_spans"]
    assert spans[0] == (0, 0) and spans[-1][1] == 5 and gen.weight_version == 5
    assert 0 < spans[-1][0] < len(gen.token_ids)


async def test_bad_weights_are_rejected_with_every_problem(engine: LocalEngine) -> None:
    with pytest.raises(EngineError, match="2 weight"):
        await engine.update_weights({"model.nope.weight": torch.zeros(2),
                                     "model.norm.weight": torch.zeros(3)})
    assert engine.weight_version == 0


async def test_abort_returns_the_tokens_so_far(engine: LocalEngine) -> None:
    task = asyncio.create_task(engine.generate(prompts(1, seed=10)[0], SamplingParams(
        max_new_tokens=1000, temperature=0, ignore_eos=True), request_id="long"))
    while engine.stats["generated_tokens"] < 5:
        await asyncio.sleep(0.001)
    waiting = asyncio.create_task(engine.generate([5, 6, 7], GREEDY, request_id="other"))
    await asyncio.sleep(0)
    await engine.abort(["long"])
    gen = await task
    assert gen.finish_reason == "abort" and 5 <= len(gen.token_ids) < 1000
    assert len(gen.logprobs) == len(gen.token_ids)
    assert (await waiting).finish_reason in ("stop", "length")  # others are untouched
    assert engine.stats["running"] == 0


async def test_pause_holds_requests_and_resume_continues(engine: LocalEngine) -> None:
    task = asyncio.create_task(engine.generate([5, 6, 7, 8], SamplingParams(
        max_new_tokens=30, temperature=0, ignore_eos=True)))
    while engine.stats["generated_tokens"] < 2:
        await asyncio.sleep(0.001)
    await engine.pause()
    held = engine.stats["generated_tokens"]
    await asyncio.sleep(0.05)
    assert engine.stats["generated_tokens"] == held and not task.done()
    await engine.resume()
    gen = await task
    assert gen.finish_reason == "length" and len(gen.token_ids) == 30
    await engine.pause(mode="abort")  # abort mode: nothing running, then accepts work again
    await engine.resume()
    assert (await engine.generate([5, 6], GREEDY)).finish_reason in ("stop", "length")


async def test_cancelled_caller_frees_its_slot(engine: LocalEngine) -> None:
    task = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(
        max_new_tokens=1000, temperature=0, ignore_eos=True)))
    while engine.stats["generated_tokens"] < 2:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if engine.stats["running"] == 0:
            break
        await asyncio.sleep(0.005)
    assert engine.stats["running"] == 0 and engine.stats["aborted"] == 1


async def test_stop_tokens_strings_and_limits(engine: LocalEngine, tokenizer) -> None:
    script = tokenizer.encode("the answer is 42 then more words")
    engine.logits_processors.append(ForcedTokens(script))
    p = [5, 6, 7]
    gen = await engine.generate(p, SamplingParams(max_new_tokens=50, stop_token_ids=(script[3],)))
    assert list(gen.token_ids) == script[:4] and gen.finish_reason == "stop"
    assert gen.meta["finish_reason"] == {"type": "stop", "matched": script[3]}
    gen = await engine.generate(p, SamplingParams(max_new_tokens=50, stop=("42",)))
    assert "42" in tokenizer.decode(list(gen.token_ids)) and gen.finish_reason == "stop"
    assert gen.meta["finish_reason"] == {"type": "stop", "matched": "42"}
    gen = await engine.generate(p, SamplingParams(max_new_tokens=3))
    assert gen.token_ids == tuple(script[:3]) and gen.finish_reason == "length"
    gen = await engine.generate(p, SamplingParams(max_new_tokens=0))
    assert gen.token_ids == () and gen.finish_reason == "length"
    engine.logits_processors.clear()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine.logits_processors.append(ForcedTokens([9, 10, eos, 11]))
    gen = await engine.generate(p, SamplingParams(max_new_tokens=50))
    assert gen.token_ids == (9, 10, eos) and gen.finish_reason == "stop"
    gen = await engine.generate(p, SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert gen.token_ids[:4] == (9, 10, eos, 11)


async def test_logit_bias(engine: LocalEngine) -> None:
    gen = await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0,
                                                          logit_bias={123: 1e4}, ignore_eos=True))
    assert gen.token_ids == (123,) * 4


async def test_context_limit_and_bad_input(model_dir: str) -> None:
    eng = LocalEngine(model_dir, max_model_len=40)
    try:
        gen = await eng.generate(list(range(5, 35)), SamplingParams(max_new_tokens=100,
                                                                    ignore_eos=True))
        assert gen.finish_reason == "length" and len(gen.token_ids) == 10
        with pytest.raises(EngineError, match="context"):
            await eng.generate(list(range(5, 45)), GREEDY)
        with pytest.raises(EngineError, match="vocabulary"):
            await eng.generate([5, 10**6], GREEDY)
        with pytest.raises(EngineError, match="empty"):
            await eng.generate([], GREEDY)
    finally:
        await eng.close()
    with pytest.raises(EngineError, match="config.json"):
        LocalEngine("/nonexistent/model")


async def test_stream_yields_every_token(engine: LocalEngine) -> None:
    chunks = [c async for c in engine.stream([5, 6, 7], SamplingParams(
        max_new_tokens=6, temperature=0, ignore_eos=True))]
    final = chunks[-1].generation
    assert final is not None
    assert tuple(t for c in chunks for t in c.token_ids) == final.token_ids
    assert len(final.token_ids) == 6


async def test_many_requests_with_small_batches(model_dir: str) -> None:
    """More requests than slots and a small prefill budget: everything still completes."""
    eng = LocalEngine(model_dir, max_running=3, max_prefill_tokens=16)
    try:
        gens = await asyncio.gather(*(eng.generate(p, SamplingParams(
            max_new_tokens=5, temperature=0, ignore_eos=True)) for p in prompts(12, seed=12)))
        assert all(len(g.token_ids) == 5 for g in gens)
        assert eng.stats["prefill_steps"] >= 4
    finally:
        await eng.close()


def test_usable_from_sync_code_twice(model_dir: str) -> None:
    """Each asyncio.run is a new event loop; the engine follows."""
    from palaestra.asyncio_utils import run_sync

    eng = LocalEngine(model_dir)
    a = run_sync(eng.generate([5, 6, 7], GREEDY))
    b = run_sync(eng.generate([5, 6, 7], GREEDY))
    assert a.token_ids == b.token_ids
    run_sync(eng.close())


async def test_multi_step_decode_equals_single_step(model_dir: str) -> None:
    """Several decode steps per host sync (the CUDA default) change nothing in the results."""
    batch = prompts(10, seed=13)
    single, multi = LocalEngine(model_dir, decode_steps=1), LocalEngine(model_dir, decode_steps=4)
    try:
        first = await single.generate(batch[0], GREEDY)
        stop = first.token_ids[2]  # a stop token that the first request meets mid-call
        params = [SamplingParams(max_new_tokens=5 + i, temperature=0.9 if i % 2 else 0,
                                 seed=i, stop_token_ids=(stop,)) for i in range(10)]
        a = await asyncio.gather(*(single.generate(p, s) for p, s in zip(batch, params)))
        b = await asyncio.gather(*(multi.generate(p, s) for p, s in zip(batch, params)))
        assert [g.token_ids for g in a] == [g.token_ids for g in b]
        assert [g.finish_reason for g in a] == [g.finish_reason for g in b]
        assert a[0].finish_reason == "stop" and a[0].token_ids[-1] == stop
        for x, y in zip(a, b):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)
        assert multi.stats["decode_calls"] < multi.stats["decode_steps"]  # 4 steps per sync
        assert single.stats["decode_calls"] == single.stats["decode_steps"]
    finally:
        await single.close()
        await multi.close()


async def test_a_multi_step_call_ends_early_once_every_row_has_stopped(model_dir: str) -> None:
    """A call of 32 decode steps whose rows all meet their stop token in the first few ends at
    the next check (8 steps), not after 32, with the tokens single steps give; a call where a
    row goes on runs on."""
    single, multi = LocalEngine(model_dir, decode_steps=1), LocalEngine(model_dir, decode_steps=32)
    try:
        # a prompt whose greedy reply first samples some token in its first decode steps (not
        # at the prefill): that token is the stop token
        for prompt in prompts(16, seed=21):
            free = await single.generate(prompt, SamplingParams(max_new_tokens=40, temperature=0))
            first = next((i for i in range(1, 6) if free.token_ids[i] not in free.token_ids[:i]),
                         None)
            if first is not None:
                break
        assert first is not None, "no prompt of the fixture meets a new token early"
        stop = free.token_ids[first]
        params = SamplingParams(max_new_tokens=40, temperature=0, stop_token_ids=(stop,))
        before = multi.stats["decode_steps"]
        a = await asyncio.gather(*(single.generate(prompt, params) for _ in range(3)))
        b = await asyncio.gather(*(multi.generate(prompt, params) for _ in range(3)))
        assert [g.token_ids for g in a] == [g.token_ids for g in b]
        assert all(g.finish_reason == "stop" and g.token_ids[-1] == stop for g in b)
        # the prefill samples the first token; one call of 32 would have run 32 steps
        assert multi.stats["decode_steps"] - before == 8
        assert multi.stats["decode_early_ends"] == 1
        # a row that never stops keeps the call going to its length budget
        before = multi.stats["decode_steps"]
        rest = await asyncio.gather(
            multi.generate(prompt, params),
            multi.generate(prompt, SamplingParams(max_new_tokens=33, temperature=0)))
        assert rest[0].token_ids == a[0].token_ids and len(rest[1].token_ids) == 33
        assert rest[1].token_ids == free.token_ids[:33]
        assert multi.stats["decode_steps"] - before == 32
        # ... unless a request waits for a slot (two slots here): the call ends at the check
        # after the first row stopped, and the waiting request finishes before the long one
        two_slots = LocalEngine(model_dir, decode_steps=32, max_running=2)
        finished: list[str] = []

        async def tracked(name: str, sampling: SamplingParams) -> list[int]:
            tokens = (await two_slots.generate(prompt, sampling)).token_ids
            finished.append(name)
            return tokens

        try:
            short, long, late = await asyncio.gather(
                tracked("short", params),
                tracked("long", SamplingParams(max_new_tokens=33, temperature=0)),
                tracked("late", SamplingParams(max_new_tokens=5, temperature=0)))
        finally:
            await two_slots.close()
        assert short == a[0].token_ids and long == free.token_ids[:33]
        assert late == free.token_ids[:5]
        assert finished == ["short", "late", "long"]  # one call of 32 steps: short, long, late
    finally:
        await single.close()
        await multi.close()


async def test_samples_of_one_prompt_share_its_prefill(engine: LocalEngine) -> None:
    """n samples of one prompt arriving together: one prefill, the others reuse its KV."""
    prompt = prompts(1, lo=50, hi=51, seed=14)[0]
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
    gens = await asyncio.gather(*(engine.generate(prompt, params) for _ in range(8)))
    stats = engine.stats
    assert stats["prefill_tokens"] == len(prompt) + 7  # the others compute one token each
    assert [g.cached_tokens for g in gens].count(len(prompt) - 1) == 7
    assert len({g.token_ids for g in gens}) == 1  # same seed, same tokens, reuse or not
    fresh = LocalEngine(engine.model_path, prefix_cache_tokens=0)
    try:
        assert (await fresh.generate(prompt, params)).token_ids == gens[0].token_ids
    finally:
        await fresh.close()


async def test_a_failed_decode_fails_its_requests_and_the_engine_serves_on(model_dir: str) -> None:
    """A decode step that raises (out of memory, a bad logits processor) fails the requests of
    that step, frees their slots, and the next requests run as on a fresh engine."""
    eng = LocalEngine(model_dir)
    calls = []

    def explode(logits, reqs) -> None:
        calls.append(len(reqs))
        if len(calls) == 2:  # the first decode step after the prefill
            raise RuntimeError("simulated out of memory")

    try:
        batch = prompts(3, seed=21)
        reference = await eng.generate(batch[0], GREEDY)
        eng.logits_processors.append(explode)
        failed = await asyncio.gather(*(eng.generate(p, GREEDY) for p in batch),
                                      return_exceptions=True)
        assert all(isinstance(f, EngineError) and "simulated out of memory" in str(f)
                   for f in failed), failed
        assert eng._running == [] and eng.stats["finished"] == 1
        eng.logits_processors.remove(explode)
        again = await eng.generate(batch[0], GREEDY)
        assert again.token_ids == reference.token_ids
    finally:
        await eng.close()


async def test_stats_split_the_schedulers_time(engine: LocalEngine) -> None:
    """Prefill and decode calls are timed, and the rest of the busy time is host_s."""
    before = engine.stats
    await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=6, temperature=0.0))
                           for p in prompts(3)))
    after = engine.stats
    spent = {k: after[k] - before[k] for k in ("prefill_s", "decode_s", "active_s")}
    assert spent["prefill_s"] > 0 and spent["decode_s"] > 0
    assert spent["active_s"] >= spent["prefill_s"] + spent["decode_s"]
    assert after["host_s"] >= 0
    assert after["decode_calls"] > before["decode_calls"]


def test_row_sampler_reused_across_steps_equals_fresh_sampling() -> None:
    """One RowSampler for many steps draws what a fresh sample_rows call per step draws."""
    from palaestra.engines.local.sampling import RowSampler, sample_rows

    gen = torch.Generator().manual_seed(3)
    temps, top_ps, top_ks = [0.0, 0.7, 1.0, 1.3], [1.0, 0.9, 1.0, 0.5], [-1, -1, 5, -1]
    sampler = RowSampler(temps, top_ps, top_ks, 50, "cpu")
    for _ in range(5):
        logits = torch.randn(4, 50, generator=gen)
        u = torch.rand(4, generator=gen)
        tokens, logprobs = sampler.sample(logits.clone(), u)
        ref_tokens, ref_logprobs = sample_rows(logits, temps, top_ps, top_ks, u)
        assert torch.equal(tokens, ref_tokens)
        assert torch.allclose(logprobs, ref_logprobs)
