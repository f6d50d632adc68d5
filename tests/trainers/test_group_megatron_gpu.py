"""GPU (one CUDA device, megatron-core, no Ray): a Megatron trainer rank runs in process.

`TrainerRank` is the plain class a trainer group runs as a Ray actor. Here one rank of world size
one joins its process group from the environment (as an actor does), builds `MegatronBackend`
from a `MegatronBackendConfig` (megatron's parallel state from tp/pp/ep and the world size), and
trains three steps on the shard-and-loss-weights form the group sends. It must match an
in-process `MegatronBackend` built from the same checkpoint: losses, grad norms, logprobs and the
engine weights (HF names, Megatron's conversion), and the HF export loads with those weights.

    python -m pytest tests/trainers/test_group_megatron_gpu.py -q -s
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _batch(seed: int, vocab: int, n: int = 8):
    from palaestra.trainers.batching import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (16 + 5 * i,), generator=g) for i in range(n)]
    masks = [torch.tensor([0.0] * 4 + [1.0] * (len(t) - 4)) for t in ids]
    adv = [m * float(torch.randn(1, generator=g)) for m in masks]
    return TrainBatch(token_ids=ids, loss_mask=masks, advantages=adv,
                      group_ids=[f"g{i // 4}" for i in range(n)])


def test_megatron_rank_in_process_matches_the_backend(tmp_path):
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from palaestra.tiny_model import build_model
    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.algorithms.objective import batch_loss_weights
    from palaestra.trainers.group.actor import TrainerRank, free_port
    from palaestra.trainers.megatron.backend import MegatronBackend
    from palaestra.trainers.megatron.config import MegatronBackendConfig

    model = build_model(tmp_path / "m", "tiny", seed=1)
    cfg = MegatronBackendConfig(dtype="float32", lr=1e-3, seed=0,
                                use_transformer_engine="off")
    rank = TrainerRank(0, 1)
    info = rank.init(str(model), cfg, "127.0.0.1", free_port())
    assert info["backend"] == "megatron" and info["device"].startswith("cuda")
    assert (info["dp_rank"], info["dp_size"], info["dp_leader"]) == (0, 1, 1)
    reference = MegatronBackend(AutoConfig.from_pretrained(model), cfg, model_path=model)
    loss = LossConfig.from_preset("grpo", entropy_coef=0.01)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    try:
        for step in range(3):
            b = _batch(step, vocab)
            got = rank.train_step((b, list(batch_loss_weights(b, loss))), loss)
            want = reference.train_step(b, loss)
            print(f"step {step}: loss {got['loss']:.6f} vs {want['loss']:.6f}, grad norm "
                  f"{got['grad_norm']:.6f} vs {want['grad_norm']:.6f}")
            assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
            assert got["num_tokens"] == want["num_tokens"]
        b = _batch(9, vocab)
        for lp, ref_lp in zip(rank.forward_logprobs((b, None)), reference.forward_logprobs(b)):
            torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
        mine = rank.state_dict_for_engines()
        theirs = reference.state_dict_for_engines()
        assert sorted(mine) == sorted(theirs) and "model.embed_tokens.weight" in mine
        for name in theirs:
            torch.testing.assert_close(mine[name], theirs[name], atol=1e-6, rtol=0)
        initial = load_file(str(next(model.glob("*.safetensors"))))
        assert any(not torch.allclose(mine[k], initial[k].float(), atol=1e-7)
                   for k in initial if k in mine)  # the steps changed the weights
        out = tmp_path / "export"
        rank.export_hf(str(out))
        exported = {}
        for f in out.glob("*.safetensors"):
            exported.update(load_file(str(f)))
        for name, tensor in exported.items():
            torch.testing.assert_close(tensor.float(), theirs[name].cpu().float(), atol=1e-6,
                                       rtol=0)
        _push_to_a_server(rank, model, theirs)
        # no offload in the Megatron backend yet: the state stays on the GPU, 0 bytes moved
        assert rank.offload()["offloaded_gib"] == 0.0
        assert rank.memory()["allocated_gib"] > 0.0
    finally:
        rank.shutdown()


def _push_to_a_server(rank, model, want) -> None:
    """The rank pushes (as a group's rank 0 does) to a CPU ``palaestra serve`` process over a
    gloo weight-update group; the server then holds the backend's engine weights."""
    import asyncio

    from palaestra.engines.serve.serve import serve_process
    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.trainers.group.push import EnginePushSpec

    server = serve_process(model, device="cpu", extra=("--threads", "2", "--max-running", "4"))
    try:
        asyncio.run(server.wait_ready(180))
        spec = EnginePushSpec(method="distributed", urls=(server.url,), bucket_bytes=1 << 20,
                              backend="gloo", timeout_s=120.0)
        answer = rank.push_weights(spec, 5)
        assert answer["stats"].num_bytes > 0 and answer["rank"] == 0
        print(f"megatron rank -> server: {answer['stats']}")

        async def read() -> None:
            client = SGLangClient(server.url, retries=0)
            try:
                assert (await client.get_model_info())["weight_version"] == "5"
                for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                             "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
                    got = torch.tensor(await client.get_weights_by_name(name, 1 << 20))
                    torch.testing.assert_close(got, want[name].cpu().float().reshape(got.shape),
                                               atol=1e-6, rtol=0)
            finally:
                await client.close()

        asyncio.run(read())
    finally:
        rank.shutdown_pusher()
        server.stop()
