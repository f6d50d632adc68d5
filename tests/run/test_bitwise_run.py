"""``trainer.on_policy = "bitwise"`` end to end on CPU, and its load-time refusals.

A short GRPO run of the micro model with the embedded engine (reward: reply length): every RL
step's logged ``rollout/logprob_max_abs_diff`` (max |trainer - engine| logprob over the trained
tokens, from the first update's forward, before any weight changes) is exactly 0.0, and so is
``rollout/ratio_max_abs_dev`` (the first update's importance ratios against the rollout are
exactly 1); so are the full-vocabulary parity numbers (``rollout/full_vocab_*``: the engine's
and the trainer's whole next-token distributions at 8 trained positions per step); the weights
still change and are pushed to the engine between steps, so each step checks a new model. The
same with a LoRA adapter (pushed to the engine, merged the same way on both sides).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from palaestra.config import load_config
from palaestra.errors import ConfigError
from palaestra.run.config import TrainConfig
from tests.run.test_loop import _read, micro_model, yes_env

__all__ = ["micro_model", "yes_env"]  # the fixtures, imported for pytest


def _config(tmp_path: Path, model: Path, env_id: str) -> Path:
    config = tmp_path / "run.toml"
    config.write_text(f'''
out = "{tmp_path / "run"}"
[model]
path = "{model}"
[env]
id = "{env_id}"
[data]
num_tasks = 256
[agent]
max_context = 256
tools_in_prompt = false
[rollout]
cluster = "local"
num_workers = 1
max_new_tokens = 8
batch_size = 4
group_size = 4
temperature = 0.9
[engine]
device = "cpu"
[trainer]
steps = 4
on_policy = "bitwise"
[trainer.torch]
device = "cpu"
lr = 0.05
[eval]
num_tasks = 0
''')
    return config


def test_bitwise_run_has_zero_logprob_gap_every_step(tmp_path, micro_model, yes_env):
    from safetensors.torch import load_file

    from palaestra.run.train import train

    long_env = yes_env.replace("Yes-v0", "Long-v0")  # reward grows with length: advantages != 0
    train(load_config(TrainConfig, _config(tmp_path, micro_model, long_env), []))
    run = tmp_path / "run"
    rl = [r for r in _read(run / "metrics.jsonl") if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2, 3]
    assert all(r["train/num_loss_tokens"] > 0 for r in rl)
    gaps = [r["rollout/logprob_max_abs_diff"] for r in rl]
    print(f"rollout/logprob_max_abs_diff per step: {gaps}")
    assert gaps == [0.0] * 4
    assert all(r["rollout/logprob_mean_abs_diff"] == 0.0 for r in rl)
    # the first update's importance ratios against the rollout: every one exactly 1
    assert all(r["rollout/ratio_max_abs_dev"] == 0.0 for r in rl)
    # the full next-token distributions at 8 trained positions per step: equal bit for bit
    for key in ("rollout/full_vocab_logprob_max_abs_diff", "rollout/full_vocab_tv",
                "rollout/full_vocab_replay_max_abs_diff"):
        print(f"{key} per step: {[r[key] for r in rl]}")
        assert [r[key] for r in rl] == [0.0] * 4, key
    assert all(r["rollout/full_vocab_positions"] == 8.0 for r in rl)
    before = load_file(str(micro_model / "model.safetensors"))
    after = load_file(str(run / "checkpoints" / "rl-000004" / "model.safetensors"))
    assert any(not (before[k] == after[k]).all() for k in before if k in after)


def test_bitwise_lora_run_has_zero_gaps_every_step(tmp_path, micro_model, yes_env):
    pytest.importorskip("peft")
    from palaestra.run.train import train

    long_env = yes_env.replace("Yes-v0", "Long-v0")
    config = _config(tmp_path, micro_model, long_env)
    train(load_config(TrainConfig, config, ["--trainer.steps", "5", "--trainer.torch.lora",
                                            "{rank = 4, alpha = 8.0}"]))
    rl = [r for r in _read(tmp_path / "run" / "metrics.jsonl") if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2, 3, 4]
    for key in ("rollout/logprob_max_abs_diff", "rollout/ratio_max_abs_dev",
                "rollout/full_vocab_logprob_max_abs_diff", "rollout/full_vocab_tv"):
        assert [r[key] for r in rl] == [0.0] * 5, (key, [r[key] for r in rl])
    # peft starts B at 0 (a no-op adapter): an update before the last step made it non-zero,
    # so later steps compared a merged adapter that changes the model
    grads = [r["train/grad_norm"] for r in rl]
    print(f"train/grad_norm per step: {grads}")
    assert any(g > 0 for g in grads[:-1]), grads


def _refusal(tmp_path: Path, model: Path, env_id: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, _config(tmp_path, model, env_id), list(overrides))
    return str(info.value)


@pytest.mark.parametrize(("overrides", "words"), [
    (("--engine.kind", "sglang", "--engine.urls", '["http://127.0.0.1:1"]'), "engine.kind"),
    (("--trainer.backend", "megatron"), "torch backend"),
    (("--trainer.torch.dtype", "bfloat16"), "trainer.torch.dtype"),
    (("--rollout.top_p", "0.9"), "top_p"),
    (("--trainer.torch.lora", "{rank = 4, dropout = 0.1}"), "lora.dropout"),
    (("--engine.device", "cuda"), "one kind of device"),
    (("--engine.weight_sync.dtype", "bfloat16"), "engine.weight_sync.dtype"),
    (("--trainer.on_policy", "default", "--trainer.torch.on_policy", "bitwise"),
     "not trainer.torch.on_policy alone"),
])
def test_settings_bitwise_cannot_serve_are_refused(tmp_path, micro_model, yes_env, overrides,
                                                   words):
    text = _refusal(tmp_path, micro_model, yes_env, *overrides)
    assert "trainer.on_policy = 'bitwise'" in text and words in text, text


def test_a_moe_model_is_refused(tmp_path, yes_env):
    from palaestra.tiny_model import build_model

    moe = build_model(tmp_path / "moe", "moe-tiny")
    text = _refusal(tmp_path, moe, yes_env)
    assert "qwen3_moe" in text and "bitwise" in text, text


def test_parity_check_runs_where_both_sides_answer(tmp_path, micro_model, yes_env):
    """`ParityCheck.build`: on with an engine and a trainer that give full distributions (the
    embedded engine, the unsharded torch backend), off with ``parity_positions = 0`` or a side
    without them (servers, Megatron) or a sharded trainer."""
    from palaestra.run.parity import ParityCheck

    class Engine:
        async def full_logprobs(self, request):
            raise AssertionError("not called")

    class Trainer:
        fsdp = False

        def full_logprobs(self, token_ids, positions):
            raise AssertionError("not called")

    class ShardedTrainer(Trainer):
        fsdp = True

    config = _config(tmp_path, micro_model, yes_env)
    cfg = load_config(TrainConfig, config, [])
    check = ParityCheck.build(cfg, Engine(), Trainer())
    assert check is not None and check.count == 8 and check.replay
    assert ParityCheck.build(cfg, object(), Trainer()) is None
    assert ParityCheck.build(cfg, Engine(), object()) is None
    assert ParityCheck.build(cfg, Engine(), ShardedTrainer()) is None
    off = load_config(TrainConfig, config, ["--trainer.parity_positions", "0"])
    assert ParityCheck.build(off, Engine(), Trainer()) is None
