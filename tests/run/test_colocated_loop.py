"""``[placement] colocate = true``: the RL loop switches phases every step (sync mode).

The quickstart, shortened (micro model, no warm start, three RL steps), with the trainer in the
driver and the embedded engine beside it, once colocated and once not. Colocated, every step
frees the engine's memory for training and offloads the trainer for the rollout (on CPU the
engine's KV cache is what is freed; the trainer's offload moves nothing), memory per phase is in
the metrics, and the run trains on the same samples to the same losses and final weights.
Async mode with colocation is refused when the config loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from palaestra.config import load_config
from palaestra.errors import ConfigError
from palaestra.run.config import TrainConfig

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
SHORT = ["--model.init_size", "micro", "--warmup.steps", "0", "--trainer.steps", "3",
         "--rollout.batch_size", "4", "--rollout.group_size", "2",
         "--rollout.max_new_tokens", "16", "--eval.num_tasks", "4", "--data.num_tasks", "64",
         "--logging.progress", "false", "--logging.tensorboard", "false",
         "--checkpoint.interval", "2", "--trainer.torch.dtype", "float32",
         "--placement.gpus_per_node", "0"]


def _run(out: Path, *extra: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    from palaestra.run.train import train

    cfg = load_config(TrainConfig, REPO / "configs/quickstart.toml",
                      ["--out", str(out), *SHORT, *extra])
    train(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    weights: dict[str, torch.Tensor] = {}
    for f in sorted((out / "final-model").glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return [r for r in rows if r.get("phase") == "rl"], weights


def test_colocated_phases_switch_and_train_like_the_plain_run(tmp_path):
    colo, wc = _run(tmp_path / "colocated", "--placement.colocate", "true")
    plain, wp = _run(tmp_path / "plain")
    assert [r["step"] for r in colo] == [r["step"] for r in plain] == [0, 1, 2]
    for k, (a, b) in enumerate(zip(colo, plain)):
        assert a["memory/phase_switches"] == 2 * (k + 1)  # to train and back, every step
        for key in ("memory/rollout_gib", "memory/train_gib", "memory/rollout_peak_gib",
                    "memory/train_peak_gib", "memory/offloaded_gib", "time/to_train_s",
                    "time/to_rollout_s"):
            assert key in a, key
        # the engine's KV cache is held while it serves, freed while the step trains
        assert a["memory/engine_rollout_gib"] > 0.0 and a["memory/engine_train_gib"] == 0.0
        assert a["memory/offloaded_gib"] == 0.0  # CPU: the trainer's state stays where it is
        assert not any(key.startswith("memory/") for key in b)
        assert a["train/num_tokens"] == b["train/num_tokens"]  # the same samples
        assert a["reward_mean"] == b["reward_mean"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
    assert sorted(wc) == sorted(wp)
    for name in wp:
        torch.testing.assert_close(wc[name], wp[name], atol=1e-6, rtol=0)
    # checkpoints are taken with the trainer resident (between phases), as in the plain run
    from palaestra.run.run_dir import RunDir

    latest = RunDir(str(tmp_path / "colocated"), tensorboard=False).latest_checkpoint("rl")
    assert latest is not None and latest.name.endswith("3")


def test_async_mode_with_colocation_is_refused_at_load_time():
    with pytest.raises(ConfigError, match="rollout.mode = 'async'") as info:
        load_config(TrainConfig, REPO / "configs/quickstart.toml",
                    ["--placement.gpus_per_node", "0", "--placement.colocate", "true",
                     "--rollout.mode", "async"])
    assert "set rollout.mode = 'sync' or placement.colocate = false" in str(info.value)


@pytest.mark.slow
def test_colocated_trainer_group_logs_memory_per_rank(tmp_path):
    pytest.importorskip("ray")
    import ray

    if ray.is_initialized():  # the group sizes its own local cluster
        ray.shutdown()
    group, _ = _run(tmp_path / "dp2", "--placement.colocate", "true",
                    "--placement.trainer_ranks", "2", "--trainer.steps", "2")
    one, _ = _run(tmp_path / "one", "--trainer.steps", "2")
    assert [r["step"] for r in group] == [0, 1]
    for a, b in zip(group, one):
        for rank in (0, 1):  # the ranks are other processes: their memory per phase
            assert f"memory/rank{rank}/train_gib" in a and f"memory/rank{rank}/rollout_gib" in a
        assert a["memory/engine_train_gib"] == 0.0 and a["memory/engine_rollout_gib"] > 0.0
        assert a["train/num_tokens"] == b["train/num_tokens"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
