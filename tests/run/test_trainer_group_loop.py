"""``palaestra train`` on a trainer group: configs/quickstart_dp2.toml, shortened (micro model, no
warm start, two RL steps), trains its RL steps on two FSDP2 ranks as Ray actors and gives the
one-rank run's losses and final weights (fp32): the data-parallel split changes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from palaestra.config import load_config
from palaestra.run.config import TrainConfig

pytest.importorskip("ray")
torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
SHORT = ["--model.init_size", "micro", "--warmup.steps", "0", "--trainer.steps", "2",
         "--rollout.batch_size", "4", "--rollout.group_size", "2",
         "--rollout.max_new_tokens", "16", "--eval.num_tasks", "4", "--data.num_tasks", "64",
         "--logging.progress", "false", "--logging.tensorboard", "false",
         "--checkpoint.interval", "1", "--trainer.torch.dtype", "float32"]


def _run(out: Path, *extra: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    from palaestra.run.train import train

    cfg = load_config(TrainConfig, REPO / "configs/quickstart_dp2.toml",
                      ["--out", str(out), *SHORT, *extra])
    train(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl"]
    weights: dict[str, torch.Tensor] = {}
    for f in sorted((out / "final-model").glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return rl, weights


@pytest.fixture(scope="module", autouse=True)
def _own_ray_cluster():
    """The group starts its own local Ray cluster sized for its ranks; a session cluster left
    up by another folder's tests (tests/rollout's, 2 CPUs, its actors alive) cannot hold them."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.mark.slow
def test_quickstart_dp2_matches_one_rank(tmp_path):
    cfg = load_config(TrainConfig, REPO / "configs/quickstart_dp2.toml")
    assert cfg.placement is not None and cfg.placement.trainer_ranks == 2
    two, w2 = _run(tmp_path / "dp2")
    one, w1 = _run(tmp_path / "dp1", "--placement.trainer_ranks", "1")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [0, 1]
    for a, b in zip(two, one):
        assert a["train/num_tokens"] == b["train/num_tokens"]  # the same samples
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
    assert sorted(w2) == sorted(w1)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=0)
