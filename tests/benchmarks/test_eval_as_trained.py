"""`palaestra eval --model RUN/final-model` reproduces the run's held-out evaluation.

A tiny calculator run (SFT warm start on tool-using demonstrations, one GRPO step) trains with
``tools_in_prompt = false``, its own system prompt and greedy evaluation; the export records those
settings beside the weights. Eval of the final model on the run's held-out tasks must then give
the success rate training logged for them, and forcing ``--tools-in-prompt`` must change the
prompts (the setting reaches the agents).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from palaestra.trained_settings import (
    FILENAME,
    TrainedSettings,
    read_trained_settings,
)
from palaestra.errors import ConfigError

ENV_KWARGS = {
    "min_value": 1,
    "max_value": 9,
    "num_operations": 1,
    "operators": ["+"],
    "max_turns": 3,
    "system_prompt": 'Call <tool_call>{"name": "calculator", "arguments": {"expression": "..."}}'
                     "</tool_call>, then answer <answer>N</answer>.",
}


def _config(tmp_path: Path, model: str) -> Path:
    kwargs = "\n".join(f"{k} = {json.dumps(v)}" for k, v in ENV_KWARGS.items())
    text = f'''
out = "{tmp_path / "run"}"
seed = 0
[model]
path = "{model}"
[env]
id = "palaestra/Calculator-v0"
[env.kwargs]
{kwargs}
[data]
num_tasks = 256
[agent]
max_context = 256
tools_in_prompt = false
drift_rate = 0.0
[warmup]
steps = 200
batch_size = 16
lr = 0.01
demonstrations = "palaestra.envs.calculator:demonstrations"
num_demonstrations = 512
kwargs = {{ tool_fraction = 1.0 }}
[rollout]
cluster = "local"
num_workers = 1
batch_size = 2
group_size = 2
max_new_tokens = 40
temperature = 1.0
[engine]
device = "cpu"
[trainer]
steps = 1
[trainer.torch]
device = "cpu"
lr = 1e-5
pack_sequences = false
[trainer.loss]
preset = "grpo"
[eval]
num_tasks = 12
temperature = 0.0
[checkpoint]
interval = 1
keep_last = 1
[logging]
progress = false
tensorboard = false
'''
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, model_dir):
    import torch

    from palaestra.config import load_config
    from palaestra.run.config import TrainConfig
    from palaestra.run.train import train

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("as-trained")
    cfg = load_config(TrainConfig, _config(tmp, model_dir))
    train(cfg)
    return cfg, tmp / "run"


def _eval(argv: list[str]) -> int:
    from palaestra.cli import main

    return main(["eval", *argv])


def test_the_export_records_the_training_settings(trained_run):
    _, run = trained_run
    settings = read_trained_settings(run / "final-model")
    assert settings == TrainedSettings(
        family="qwen", tools_in_prompt=False, max_context=256, temperature=0.0, top_p=1.0,
        top_k=-1, max_new_tokens=40, env_id="palaestra/Calculator-v0", env_kwargs=ENV_KWARGS,
    )


def test_eval_of_the_final_model_equals_the_held_out_success(trained_run, tmp_path, capsys):
    from palaestra.run.tasks import tasks_from_env

    cfg, run = trained_run
    logged = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    final = next(r for r in logged if r["stage"] == "rl")
    assert final["success_rate"] > 0, f"the warm start should reach some success: {logged}"
    # the run's held-out tasks, drawn as the run drew them
    rows = tasks_from_env(cfg.env.id, cfg.eval.num_tasks, seed=cfg.eval.seed,
                          env_kwargs=cfg.env.kwargs)
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval"
    model = str(run / "final-model")
    assert _eval(["--benchmark", "calculator", "--model", model, "--dataset", str(data),
                  "--out", str(out), "--no-progress", "--no-report"]) == 0
    printed = capsys.readouterr().out
    assert "settings as trained" in printed and "tools_in_prompt=False" in printed
    summary = json.loads((out / "summary.json").read_text())["calculator"]
    assert summary["tasks"] == cfg.eval.num_tasks
    assert summary["pass@1"] == pytest.approx(final["success_rate"])
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]

    # forcing the tool schemas into the prompt reaches the agents: longer prompts
    forced = tmp_path / "eval-forced"
    assert _eval(["--benchmark", "calculator", "--model", model, "--dataset", str(data),
                  "--limit", "2", "--tools-in-prompt", "--out", str(forced), "--no-progress",
                  "--no-report"]) == 0
    with_tools = [json.loads(line) for line in (forced / "samples.jsonl").read_text().splitlines()]
    by_task = {s["task_id"]: s["prompt_tokens"] for s in samples}
    assert len(with_tools) == 2
    assert all(s["prompt_tokens"] > by_task[s["task_id"]] + 50 for s in with_tools)

    # without the record: the old defaults (sampled at 0.6, the benchmark's own env kwargs)
    capsys.readouterr()
    plain = tmp_path / "eval-plain"
    assert _eval(["--benchmark", "calculator", "--model", model, "--dataset", str(data),
                  "--limit", "1", "--no-trained-settings", "--out", str(plain), "--no-progress",
                  "--no-report"]) == 0
    assert "settings as trained" not in capsys.readouterr().out
    meta = json.loads((plain / "run.json").read_text())["models"]
    (settings,) = [per_benchmark["calculator"] for per_benchmark in meta.values()]
    assert settings["temperature"] == 0.6 and settings["env_kwargs"] == {}


def test_a_broken_record_is_a_clear_error(tmp_path):
    (tmp_path / FILENAME).write_text('{"format": 1, "family": "qwen", "colour": "red"}')
    with pytest.raises(ConfigError, match="not a valid record of training settings"):
        read_trained_settings(tmp_path)
    assert read_trained_settings(tmp_path / "elsewhere") is None
