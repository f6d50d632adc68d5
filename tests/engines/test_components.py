"""Unit tests of the engine's parts: sampling, the prefix cache, the SGLang schema checks, the
tensor payloads, SamplingParams <-> SGLang, and the light import of the package."""

from __future__ import annotations

import base64
import pickle
import subprocess
import sys

import pytest
import torch

from palaestra.errors import ConfigError
from palaestra.engines.serve import sglang_protocol as sp
from palaestra.engine import SamplingParams
from palaestra.engines.local.prefix_cache import PrefixCache, common_prefix_len
from palaestra.engines.local.sampling import sample_rows, token_logprobs
from palaestra.engines.weights.tensor_payload import decode_named_tensors, encode_named_tensors


def test_sample_rows_greedy_and_logprobs() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    tokens, lps = sample_rows(logits, [0.0, 0.0], [1.0, 1.0], [-1, -1], None)
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(lps, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_sample_rows_follows_the_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7]])).repeat(4000, 1)
    u = torch.rand(4000)
    tokens, lps = sample_rows(logits, [1.0] * 4000, [1.0] * 4000, [-1] * 4000, u)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.7]), atol=0.03)
    # temperature: the logprob is that of softmax(logits / T), unfiltered
    tokens, lps = sample_rows(logits[:5], [0.5] * 5, [0.5] * 5, [-1] * 5, u[:5])
    assert tokens.tolist() == [2] * 5  # at T=0.5 the top token has 0.91 > top_p: only it stays
    assert torch.allclose(lps, token_logprobs(logits[:5], tokens, 0.5))


def test_top_k_top_p_support() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).repeat(500, 1)
    u = torch.rand(500, generator=torch.Generator().manual_seed(1))
    tk, _ = sample_rows(logits, [1.0] * 500, [1.0] * 500, [2] * 500, u)
    assert set(tk.tolist()) == {0, 1}
    tp, _ = sample_rows(logits, [1.0] * 500, [0.65] * 500, [-1] * 500, u)
    assert set(tp.tolist()) == {0, 1}  # 0.4 + 0.3 reaches 0.65
    mixed, _ = sample_rows(logits[:2], [0.0, 1.0], [1.0, 1.0], [-1, 1], u[:2])
    assert mixed.tolist() == [0, 0]  # greedy rows inside a sampling batch


def test_prefix_cache_lookup_and_eviction() -> None:
    cache = PrefixCache(capacity_tokens=100, min_tokens=16)
    a = tuple(range(40))
    cache.insert(a, ("k", "v"), "s1")
    entry, n = cache.match(list(range(40)) + [99, 98])
    assert entry is not None and n == 40
    entry, n = cache.match(list(range(30)) + [7] * 20)  # diverges after 30 tokens
    assert n == 30
    assert cache.match(list(range(10)))[1] == 0  # too short to bother
    cache.insert(a + (1, 2, 3), ("k2", "v2"))  # supersedes its prefix
    assert len(cache) == 1 and cache.num_tokens == 43
    cache.insert(tuple(range(100, 160)), ("k3", "v3"))  # 43 + 60 > 100: the LRU goes
    assert len(cache) == 1 and cache.match(list(a))[1] == 0
    assert common_prefix_len([1, 2, 3, 4], (1, 2, 9)) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2


def test_check_body_reports_every_problem() -> None:
    with pytest.raises(ConfigError) as exc:
        sp.check_body({"master_address": 5, "world_size": "2"},
                      sp.INIT_WEIGHTS_UPDATE_GROUP_REQ_INPUT, "InitWeightsUpdateGroupReqInput")
    msg = str(exc.value)
    for part in ("master_port", "rank_offset", "'master_address' must be str", "'world_size'"):
        assert part in msg
    assert sp.check_body({"unknown_field": 1}, sp.ABORT_REQ, "AbortReq") == {"unknown_field": 1}
    with pytest.raises(ConfigError, match="JSON object"):
        sp.check_body([1], sp.ABORT_REQ, "AbortReq")


def test_sampling_params_round_trip() -> None:
    params = SamplingParams(max_new_tokens=9, temperature=0.5, top_p=0.8, top_k=20,
                            stop_token_ids=[3, 4], stop="</answer>", seed=5, ignore_eos=True,
                            logit_bias={7: -1.5})
    wire = params.to_sglang()
    assert wire == {"max_new_tokens": 9, "temperature": 0.5, "top_p": 0.8, "top_k": 20,
                    "stop_token_ids": [3, 4], "stop": ["</answer>"], "sampling_seed": 5,
                    "ignore_eos": True, "logit_bias": {"7": -1.5}}
    assert SamplingParams.from_sglang(wire) == params
    assert SamplingParams.from_sglang({"top_k": 1 << 30, "temperature": None}).top_k == -1
    with pytest.raises(ConfigError, match="not implemented"):
        SamplingParams.from_sglang({"repetition_penalty": 1.2})
    with pytest.raises(ConfigError, match="unsupported"):
        SamplingParams.from_sglang({"beam": 2})
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=0)


def test_tensor_payload_round_trip_and_refusal() -> None:
    tensors = {"a.weight": torch.randn(3, 4), "b": torch.arange(5)}
    back = decode_named_tensors(encode_named_tensors(tensors))
    assert set(back) == set(tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    with pytest.raises(ConfigError, match="safetensors"):
        decode_named_tensors(base64.b64encode(pickle.dumps({"a": 1})).decode())
    with pytest.raises(ConfigError, match="base64"):
        decode_named_tensors("not base64!")


def test_import_is_light() -> None:
    code = ("import sys, palaestra.engines as e; e.SamplingParams; "
            "import palaestra.engines.serve.serve, palaestra.engines.serve.sglang_protocol; "
            "heavy = [m for m in ('torch', 'transformers', 'aiohttp', 'openai') "
            "if m in sys.modules]; print(heavy); assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)
