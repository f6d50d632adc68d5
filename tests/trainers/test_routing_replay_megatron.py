"""Routing replay with the Megatron backend on a GPU (megatron-core's RouterReplay).

The Megatron model, fed routes, must compute what the HF model computes under the torch
backend's replay of the same routes: both with the routes of an fp32 forward (then both equal the
free-routing logprobs) and with deliberately shifted routes (then both move, identically).
Needs CUDA and megatron-core >= 0.15 (its ``RouterReplay``; the hook in `MegatronBackend`, see
`palaestra.trainers.routing_replay_megatron`); skipped elsewhere.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CFG = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
       "moe_intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
       "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1],
       "max_position_embeddings": 1024, "initializer_range": 0.05, "router_aux_loss_coef": 0.0}


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> Any:
    pytest.importorskip("megatron.core")
    pytest.importorskip("megatron.core.transformer.moe.router_replay")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from palaestra.trainers.megatron.config import MegatronBackendConfig
    from palaestra.trainers.megatron.parallel import ParallelConfig, init_parallel

    init_parallel(ParallelConfig())
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CFG))
    path = tmp_path_factory.mktemp("moe-megatron")
    model.save_pretrained(path)
    return model, path


def _routes(model: Any, batch: Any, shift: int) -> tuple[torch.Tensor, ...]:
    """The HF fp32 model's own top-k per token and layer (+ ``shift`` mod experts), -1 dense."""
    out = []
    k, e = CFG["num_experts_per_tok"], CFG["num_experts"]
    for ids in batch.token_ids:
        with torch.no_grad():
            logits = model(ids[None], output_router_logits=True).router_logits
        routes = torch.full((ids.shape[0], CFG["num_hidden_layers"], k), -1, dtype=torch.int16)
        sparse = [i for i in range(CFG["num_hidden_layers"]) if i not in CFG["mlp_only_layers"]]
        for layer, lg in zip(sparse, logits):
            routes[:, layer] = ((lg.topk(k, -1).indices + shift) % e).to(torch.int16)
        out.append(routes)
    return tuple(out)


def test_megatron_replay_equals_torch_replay(parts) -> None:
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.megatron.backend import MegatronBackend
    from palaestra.trainers.megatron.config import MegatronBackendConfig
    from palaestra.trainers.torch_backend.backend import TorchBackend
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    model, path = parts
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, CFG["vocab_size"], (n,), generator=g) for n in (70, 200, 33)]
    masks = [torch.cat([torch.zeros(1), torch.ones(len(s) - 1)]) for s in seqs]
    batch = TrainBatch(token_ids=seqs, loss_mask=masks, advantages=masks)
    mega = MegatronBackend(model.config, MegatronBackendConfig(dtype="float32",
                                                               routing_replay="rollout"),
                           hf_state_dict=model.state_dict())
    torch_be = TorchBackend(path, TorchBackendConfig(device="cuda", dtype="float32",
                                                     routing_replay="rollout"))
    own = batch.replace(routed_experts=_routes(model, batch, 0))
    shifted = batch.replace(routed_experts=_routes(model, batch, 3))

    def diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return float(max((x[1:] - y[1:]).abs().max() for x, y in zip(a, b)))

    free = mega.forward_logprobs(batch)
    assert diff(mega.forward_logprobs(own), free) < 1e-4  # its own routes change nothing
    moved_mega, moved_torch = mega.forward_logprobs(shifted), torch_be.forward_logprobs(shifted)
    assert diff(moved_mega, free) > 1e-2  # the shifted experts are really used
    assert diff(moved_mega, moved_torch) < 2e-3  # and used as the torch backend uses them
    # a train step under replay runs forward and backward (the recompute pops the same ids)
    from palaestra.trainers.algorithms.config import LossConfig

    metrics = mega.train_step(shifted, LossConfig(preset="grpo"))
    assert metrics["grad_norm"] > 0
