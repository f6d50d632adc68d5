"""``algorithm = "rm"``: a Bradley-Terry reward model trained by ``palaestra train`` on CPU beats
chance on held-out preference pairs, and its export is what the classifier reward source loads
(scores equal a direct forward); ``[[rewards]]`` config errors are refused at load time."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from palaestra.config import validate
from palaestra.errors import ConfigError
from palaestra.run.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("OMP_NUM_THREADS", "1")
pytestmark = pytest.mark.timeout(300)


def _make_pairs():
    spec = importlib.util.spec_from_file_location(
        "make_rm_example_data", REPO / "scripts" / "make_rm_example_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.make_calculator_pairs


def _rm_config(tmp_path: Path, dataset: Path, **changes) -> TrainConfig:
    data = {
        "algorithm": "rm", "out": str(tmp_path / "rm"), "seed": 0,
        "model": {"init_size": "micro"},
        "offline": {"dataset": str(dataset), "batch_size": 16},
        "trainer": {"steps": 60, "torch": {"device": "cpu", "lr": 3e-3}},
        "eval": {"num_tasks": 60, "interval": 30},
        "checkpoint": {"interval": 30},
        "logging": {"progress": False, "tensorboard": False},
    }
    data.update(changes)
    return validate(TrainConfig, data)


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory):
    import torch

    from palaestra.run.train import train

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("rm-run")
    dataset = tmp / "pairs.jsonl"
    # the example's rule: half the rejected answers guess without the calculator, half copy its
    # result wrongly (same layout as the chosen transcript: only the number tells them apart)
    rows = _make_pairs()(300, seed=3, hard_fraction=0.5)
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _rm_config(tmp, dataset)
    train(cfg)
    return Path(cfg.out), rows


def test_rm_trained_on_cpu_beats_chance_on_held_out_pairs(rm_run):
    out, _ = rm_run
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    stages = [e["stage"] for e in evals]
    assert stages == ["init", "step-30", "rm"]
    final = evals[-1]
    assert final["pairs"] == 60 and final["success_rate"] == final["accuracy"]
    # an untrained head ranks by accident with margins near 0 (loss ~ log 2 ~ 0.69)
    assert final["accuracy"] >= 0.75 and final["loss"] < 0.5 < evals[0]["loss"], evals
    assert final["margin_mean"] > evals[0]["margin_mean"] + 1.0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(60))
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    info = json.loads((out / "final-model" / "reward_model.json").read_text())
    assert info["held_out_accuracy"] == final["accuracy"]


async def test_exported_rm_is_what_the_classifier_source_scores(rm_run):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from palaestra.rollout.rewards import RewardSourceConfig
    from palaestra.rollout.rewards.sources import ClassifierSource

    out, rows = rm_run
    path = out / "final-model"
    convs = [r["prompt"] + r[side] for r in rows[-4:] for side in ("chosen", "rejected")]
    source = ClassifierSource(RewardSourceConfig(kind="classifier", path=str(path), batch_size=3))
    got = await source.score(convs)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    want = []
    with torch.inference_mode():
        for conv in convs:
            ids = tok(tok.apply_chat_template(conv, tokenize=False),
                      add_special_tokens=False)["input_ids"]
            want.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    assert got == pytest.approx(want, abs=1e-5)
    assert len({round(g, 5) for g in got}) > 1


def test_rm_resumes_and_extends(rm_run, tmp_path):
    """A finished run given more steps goes on from its last checkpoint (step 60)."""
    import shutil

    from palaestra.run.train import train

    out, _ = rm_run
    copy = tmp_path / "rm"
    shutil.copytree(out, copy)
    dataset = json.loads((out / "config.json").read_text())["offline"]["dataset"]
    cfg = _rm_config(tmp_path, Path(dataset), trainer={"steps": 62, "torch": {"device": "cpu",
                                                                          "lr": 3e-3}})
    train(cfg)
    steps = [json.loads(line)["step"] for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(62))


def test_rewards_config_errors_are_refused_at_load_time(tmp_path):
    def problems(data) -> str:
        with pytest.raises(ConfigError) as exc:
            validate(TrainConfig, {"out": str(tmp_path / "x"), **data})
        return str(exc.value)

    missing = problems({"rewards": [{"kind": "classifier", "path": str(tmp_path / "none")}]})
    assert "no Hugging Face checkpoint" in missing and "algorithm = 'rm'" in missing
    dup = problems({"rewards": [{"kind": "env"}, {"kind": "env", "weight": 0.0}]})
    assert "names must be unique" in dup
    actor = problems({"rewards": [{"kind": "env", "weight": 0.5}], "rollout": {"cluster": "local"},
                      "reward_worker": {"placement": "actor"}})
    assert "rollout.cluster = 'ray'" in actor
    offline = problems({"algorithm": "rm", "offline": {"dataset": str(tmp_path / "p.jsonl")},
                        "rewards": [{"kind": "env"}]})
    assert "[[rewards]] score RL episodes" in offline


def test_shipped_configs_load(tmp_path, rm_run):
    """The example's configs validate (their data paths pointed at this test's files)."""
    from palaestra.config import read_toml

    out, _ = rm_run
    rm = read_toml(REPO / "configs" / "rm_train.toml")
    rm["offline"]["dataset"] = json.loads((out / "config.json").read_text())["offline"]["dataset"]
    rm["eval"]["num_tasks"] = 100
    assert validate(TrainConfig, rm).algorithm == "rm"
    rl = read_toml(REPO / "configs" / "rl_with_rm.toml")
    rl["rewards"][0]["path"] = str(out / "final-model")
    cfg = validate(TrainConfig, rl)
    assert [(r.part_name, r.weight) for r in cfg.rewards] == [("rm", 1.0), ("env", 0.0)]
