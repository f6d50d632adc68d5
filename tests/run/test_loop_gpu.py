"""The training loop on GPUs: the Megatron backend colocated with the embedded
engine, and a disaggregated run (PyTorch trainer on GPU 0, an SGLang-API server on GPU 1, weights
over an NCCL weight-update group). Skipped without CUDA."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from palaestra.config import load_config
from palaestra.run.config import TrainConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--warmup.steps", "0", "--trainer.steps", "3", "--rollout.batch_size", "8",
         "--rollout.group_size", "4", "--eval.num_tasks", "16", "--checkpoint.interval", "3",
         "--logging.tensorboard", "false", "--logging.progress", "false",
         "--engine.device", "cuda", "--trainer.torch.device", "cuda"]


def _rl_records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r["phase"] == "rl"]


def _report(name: str, data: dict) -> None:
    out = os.environ.get("PALAESTRA_GPU_REPORT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(data, indent=1))


def test_megatron_backend_in_the_loop(tmp_path):
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    from palaestra.run.train import train

    run = tmp_path / "run"
    cfg = load_config(TrainConfig, ROOT / "configs" / "quickstart.toml", [
        "--out", str(run), *SHORT, "--trainer.backend", "megatron",
        "--trainer.megatron.lr", "1e-4", "--trainer.megatron.dtype", "bfloat16",
        # without a warm start the tiny policy earns no reward, so every advantage is 0: the
        # entropy bonus keeps the update (and so the sync of changed weights) non-trivial
        "--trainer.loss.entropy_coef", "0.01"])
    train(cfg)
    rl = _rl_records(run)
    summary = [{k: r.get(k) for k in ("version", "sync/seconds", "train/num_loss_tokens",
                                      "train/loss", "train/grad_norm")} for r in rl]
    assert [r["version"] for r in rl] == [0, 1, 2], summary
    assert all(r.get("sync/seconds", 0) > 0 and r.get("train/num_loss_tokens", 0) > 0
               for r in rl), summary
    before = load_file(str(run / "model" / "model.safetensors"))
    after: dict[str, torch.Tensor] = {}
    for shard in sorted((run / "final-model").glob("*.safetensors")):
        after.update(load_file(str(shard)))
    changed = [k for k in before  # the export is bf16: compare at that precision
               if k in after and not torch.equal(before[k].to(after[k].dtype), after[k])]
    assert changed, "Megatron training did not change any exported weight"
    _report("loop_megatron", {"steps": [{k: r[k] for k in ("time/step_s", "time/rollout_s",
                                                           "time/train_s", "time/weight_sync_s",
                                                           "sync/seconds", "reward_mean")}
                                        for r in rl]})


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_disaggregated_trainer_and_server_over_nccl(tmp_path):
    from safetensors.torch import load_file

    from palaestra.engines.serve.serve import serve_process
    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.tiny_model import build_model
    from palaestra.run.train import train

    run = tmp_path / "run"
    model = build_model(run / "model", "tiny")
    server = serve_process(model, device="cuda", env=dict(os.environ, CUDA_VISIBLE_DEVICES="1"),
                           log_path=tmp_path / "serve.log")
    try:
        asyncio.run(server.wait_ready(300))
        cfg = load_config(TrainConfig, ROOT / "configs" / "quickstart.toml", [
            "--out", str(run), *SHORT, "--engine.kind", "sglang", "--engine.urls",
            f'["{server.url}"]', "--engine.weight_sync.kind", "distributed",
            "--engine.weight_sync.backend", "nccl", "--engine.weight_sync.timeout_s", "120"])
        train(cfg)
        rl = _rl_records(run)
        assert [r["version"] for r in rl] == [0, 1, 2]
        final: dict[str, torch.Tensor] = {}
        for shard in sorted((run / "final-model").glob("*.safetensors")):
            final.update(load_file(str(shard)))

        async def served(name: str) -> tuple[str, torch.Tensor]:
            client = SGLangClient(server.url, retries=0)
            try:
                values = torch.tensor(await client.get_weights_by_name(name, 4))
                return (await client.get_model_info())["weight_version"], values
            finally:
                await client.close()

        name = "model.layers.1.self_attn.o_proj.weight"
        version, values = asyncio.run(served(name))
        assert version == "3"
        engine_dtype = torch.bfloat16  # the server's LocalEngine runs bf16 on CUDA
        torch.testing.assert_close(values, final[name][:4].to(engine_dtype).float(), rtol=0,
                                   atol=0)
        _report("loop_disaggregated_nccl", {"steps": [
            {k: r[k] for k in ("time/step_s", "time/rollout_s", "time/train_s",
                               "time/weight_sync_s", "sync/seconds", "sync/gbytes")} for r in rl]})
    finally:
        server.stop()


def test_megatron_dpo_run(tmp_path):
    """``algorithm = "dpo"`` with ``trainer.backend = "megatron"``: the reference policy is the
    backend's pinned-host copy of the initial weights."""
    pytest.importorskip("megatron.core")
    from palaestra.tiny_model import build_model
    from palaestra.run.train import train
    from tests.run.test_loop import _dpo_rows, dpo_config

    model = build_model(tmp_path / "model", "micro")
    path = tmp_path / "dpo.toml"
    path.write_text(dpo_config(tmp_path, model, _dpo_rows(tmp_path / "pairs.jsonl")))
    cfg = load_config(TrainConfig, path, ["--trainer.backend", "megatron",
                                          "--trainer.megatron.lr", "2e-3",
                                          "--trainer.megatron.dtype", "float32"])
    train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    dpo = [r for r in records if r["phase"] == "dpo"]
    summary = [(r["loss"], r.get("train/dpo/reward_margin")) for r in dpo]
    _report("loop_megatron_dpo", {"loss_and_margin": summary})
    assert len(dpo) == 6 and dpo[-1]["loss"] < dpo[0]["loss"], summary
    assert (tmp_path / "run" / "final-model" / "model.safetensors.index.json").exists()
