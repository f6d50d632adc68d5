"""On-policy distillation end to end on CPU, and ``[distill]``'s load-time refusals.

The teacher: the micro model after an SFT warm start on demonstrations that always say "yes";
the student: the same micro model warm-started on 30% "yes" ones. Distilling (pure reverse KL,
``reward_coef = 0``: the env reward is only measured) must lower the reverse KL and raise the
held-out success.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from palaestra.config import load_config
from palaestra.errors import ConfigError
from palaestra.run.config import TrainConfig
from tests.run.test_loop import _merge, _read, micro_model, yes_env

__all__ = ["micro_model", "yes_env"]  # the fixtures, imported for pytest


def _demos(path: Path, yes_per_10: int) -> Path:
    with path.open("w") as f:
        for i in range(100):
            reply = "yes" if i % 10 < yes_per_10 else "no"
            f.write(json.dumps({"messages": [{"role": "user", "content": "Say yes or no."},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    return path


def _teacher(tmp_path: Path, model: Path, env_id: str) -> Path:
    """The SFT stage of a run on always-"yes" demonstrations (no RL step)."""
    from palaestra.run.train import train

    root = tmp_path / "teacher"
    root.mkdir()
    config = _merge(root, model, env_id, _demos(root / "demos.jsonl", 10))
    train(load_config(TrainConfig, config, ["--trainer.steps", "0", "--eval.num_tasks", "0"]))
    return root / "run" / "sft-model"


def test_distillation_lowers_reverse_kl_and_raises_success(tmp_path, micro_model, yes_env):
    from palaestra.run.train import train

    teacher = _teacher(tmp_path, micro_model, yes_env)
    config = _merge(tmp_path, micro_model, yes_env, _demos(tmp_path / "demos.jsonl", 3))
    cfg = load_config(TrainConfig, config, [
        "--distill.teacher", str(teacher), "--distill.reward_coef", "0",
        "--trainer.steps", "16"])
    result = train(cfg)
    rl = [r for r in _read(tmp_path / "run" / "metrics.jsonl") if r["phase"] == "rl"]
    kl = [r["distill/reverse_kl"] for r in rl]
    print(f"reverse KL per step {[round(k, 3) for k in kl]}; held-out success sft "
          f"{result['sft']:.3f} -> distilled {result['rl']:.3f}")
    assert kl[0] > 0.2, f"the warm-started student should be far from the teacher ({kl})"
    # measured: 5.5 -> ~0.4 (the micro student first collapses into long replies, which the
    # teacher scores low, then learns "yes<|im_end|>"); held-out success 0.23 -> 0.70
    assert sum(kl[-2:]) / 2 < 0.25 * kl[0], f"the reverse KL did not fall: {kl}"
    assert result["rl"] > result["sft"] + 0.2
    assert all("rollout/logprob_max_abs_diff" in r for r in rl)


def test_pure_distillation_trains_with_groups_of_one(tmp_path, micro_model, yes_env):
    """Without the env reward nothing compares the samples of a group: one sample per prompt
    is accepted and the reverse KL still falls."""
    from palaestra.run.train import train

    teacher = _teacher(tmp_path, micro_model, yes_env)
    config = _merge(tmp_path, micro_model, yes_env, _demos(tmp_path / "demos.jsonl", 3))
    cfg = load_config(TrainConfig, config, [
        "--distill.teacher", str(teacher), "--distill.reward_coef", "0",
        "--rollout.group_size", "1", "--rollout.batch_size", "32", "--trainer.steps", "12",
        "--eval.num_tasks", "0"])
    train(cfg)
    rl = [r for r in _read(tmp_path / "run" / "metrics.jsonl") if r["phase"] == "rl"]
    kl = [r["distill/reverse_kl"] for r in rl]
    print(f"reverse KL per step, groups of one: {[round(k, 3) for k in kl]}")
    assert kl[0] > 0.2 and sum(kl[-2:]) / 2 < 0.25 * kl[0], kl
    with pytest.raises(ConfigError, match="group_size"):  # with the env reward: refused
        load_config(TrainConfig, config, ["--distill.teacher", str(teacher),
                                          "--distill.reward_coef", "0.5",
                                          "--rollout.group_size", "1"])


def _problems(tmp_path: Path, model: Path, *overrides: str) -> str:
    config = tmp_path / "run.toml"
    config.write_text(f'out = "{tmp_path / "run"}"\n[model]\npath = "{model}"\n')
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, config, list(overrides))
    return str(info.value)


def test_missing_teacher_is_refused(tmp_path, micro_model):
    text = _problems(tmp_path, micro_model, "--distill.teacher", str(tmp_path / "nowhere"))
    assert "distill.teacher" in text and "no config.json" in text


def test_backend_without_teacher_is_refused(tmp_path, micro_model):
    text = _problems(tmp_path, micro_model, "--distill.teacher", str(micro_model),
                     "--trainer.backend", "megatron")
    assert "trainer.backend = 'megatron' cannot score with a teacher" in text


def test_teacher_with_another_vocabulary_is_refused(tmp_path, micro_model):
    import shutil

    teacher = tmp_path / "teacher"
    shutil.copytree(micro_model, teacher)
    config = json.loads((teacher / "config.json").read_text())
    config["vocab_size"] += 64
    (teacher / "config.json").write_text(json.dumps(config))
    text = _problems(tmp_path, micro_model, "--distill.teacher", str(teacher))
    assert "vocab_size" in text and "share the student's tokenizer" in text
    config["vocab_size"] -= 64  # the same size, one token renamed
    (teacher / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    token = next(iter(vocab))
    vocab["renamed-token"] = vocab.pop(token)
    (teacher / "tokenizer.json").write_text(json.dumps(tokenizer))
    text = _problems(tmp_path, micro_model, "--distill.teacher", str(teacher))
    assert "different tokenizers" in text
