"""``palaestra train --dry-run`` and the GPU recipes: configs validate, scripts plan without GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from palaestra.config import load_config
from palaestra.errors import ConfigError
from palaestra.run.config import TrainConfig
from palaestra.model_shapes import NAMED_SHAPES
from palaestra.run.dry_run import describe_placement, describe_plan
from palaestra.run.fleet.memory_plan import GIB, engine_memory, resolve_shape

REPO = Path(__file__).resolve().parents[2]
RECIPE_CONFIGS = ["search_r1_grpo", "search_r1_ppo", "gsm8k_grpo", "code_grpo"]
# script -> (env, the plan's head line, GPUs, engine actors)
_HEAD = "{mode}, 4 trainer rank(s) (fsdp 4) on GPU bundles, {engines} engine(s) in the plan, {gpus} GPUs"
SCRIPTS = {
    "run_search_r1.sh": ("palaestra/SearchR1-v0",
                         _HEAD.format(mode="disaggregated", engines=4, gpus=8), 8, 4),
    "run_gsm8k_grpo.sh": ("palaestra/GSM8K-v0",
                          _HEAD.format(mode="colocated", engines=4, gpus=4), 4, 4),
    "run_code_grpo.sh": ("palaestra/Code-v0",
                         _HEAD.format(mode="disaggregated", engines=2, gpus=8), 8, 2),
}


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PALAESTRA_", "RAY_ADDRESS", "SGLANG_", "MODEL", "CONFIG", "OUT"))}
    env.update(OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}")
    env.update(extra)
    return env


def _script(script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(REPO / "scripts" / script), "--dry-run", *args], cwd=REPO,
                          env=_clean_env(**env), capture_output=True, text=True, timeout=60,
                          check=False)


@pytest.mark.parametrize("name", RECIPE_CONFIGS)
def test_recipe_config_loads(name: str) -> None:
    from palaestra.run.fleet.start import engine_actor_count

    cfg = load_config(TrainConfig, REPO / "configs" / f"{name}.toml")
    # [placement] starts the engines as Ray actors: no engine.urls of servers started by hand
    assert cfg.engine.kind == "sglang" and not cfg.engine.urls and cfg.placement is not None
    assert engine_actor_count(cfg) == cfg.placement.engine_gpus // cfg.placement.engine_tp > 0
    assert cfg.trainer.backend == "torch"  # megatron through --trainer.backend
    assert cfg.env.id in {v[0] for v in SCRIPTS.values()}


@pytest.mark.parametrize("name", RECIPE_CONFIGS)
def test_palaestra_train_dry_run_of_a_recipe(name: str) -> None:
    """`palaestra train configs/X.toml --dry-run` alone plans the recipe's trainer ranks and
    engine actors (GPU bundles, planned on this CPU machine) and exits 0."""
    proc = subprocess.run([sys.executable, "-m", "palaestra", "train",
                           str(REPO / "configs" / f"{name}.toml"), "--dry-run"], cwd=REPO,
                          env=_clean_env(), capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    cfg = load_config(TrainConfig, REPO / "configs" / f"{name}.toml")
    p = cfg.placement
    assert p is not None
    assert f"placement: {'colocated' if p.colocate else 'disaggregated'}, {p.trainer_ranks} " \
        "trainer rank(s)" in proc.stdout
    assert proc.stdout.count("  engine actor ") == p.engine_gpus // p.engine_tp
    assert ("trainer group:" in proc.stdout) == (p.trainer_ranks > 1)


def test_ppo_recipe_plans_its_critic() -> None:
    cfg = load_config(TrainConfig, REPO / "configs" / "search_r1_ppo.toml")
    assert cfg.trainer.loss.needs_values and not cfg.trainer.torch.critic
    plan = describe_plan(cfg, {})
    assert "critic: value model from the RL phase's initial policy with a fresh value head, " \
        "backend torch" in plan
    assert "1 epoch(s) over mini-batches of 64 samples" in plan


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_dry_run_prints_plan(script: str) -> None:
    env_id, placement, gpus, engines = SCRIPTS[script]
    proc = _script(script)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"placement: {placement}" in out
    assert env_id in out
    table = [line for line in out.splitlines() if line[:3].strip().isdigit()]
    assert [int(line.split()[0]) for line in table] == list(range(gpus))
    in_table = {line.split("engine ")[1].split()[0] for line in table if "engine " in line}
    assert out.count("  engine actor ") == len(in_table) == engines  # one actor per engine
    resolved = json.loads(out.split("resolved config:\n", 1)[1])
    assert resolved["engine"]["urls"] == [] and resolved["placement"]["engine_gpus"] >= engines
    assert "OVER" not in out and "deprecated" not in proc.stderr


def test_script_overrides_reach_the_config() -> None:
    proc = _script("run_search_r1.sh", "--trainer.steps", "3", "--placement.engine_gpus", "2",
                   RETRIEVER_URL="http://10.0.0.5:8000/retrieve")
    assert proc.returncode == 0, proc.stderr
    resolved = json.loads(proc.stdout.split("resolved config:\n", 1)[1])
    assert resolved["trainer"]["steps"] == 3 and resolved["placement"]["engine_gpus"] == 2
    assert resolved["env"]["kwargs"]["retriever"] == "http://10.0.0.5:8000/retrieve"
    assert "2 engine(s) in the plan, 6 GPUs" in proc.stdout


def test_old_layout_variables_are_deprecated_overrides() -> None:
    proc = _script("run_gsm8k_grpo.sh", PALAESTRA_COLOCATE="0", PALAESTRA_GPUS="8")
    assert proc.returncode == 0, proc.stderr
    assert "PALAESTRA_COLOCATE is deprecated" in proc.stderr
    assert "passing --placement.colocate false (use that flag instead)" in proc.stderr
    assert "passing --placement.gpus_per_node 8" in proc.stderr
    assert "placement: disaggregated, 4 trainer rank(s) (fsdp 4) on GPU bundles, 4 engine(s) " \
        "in the plan, 8 GPUs" in proc.stdout
    gone = _script("run_code_grpo.sh", SGLANG_PORT="31000")  # engines pick their own ports
    assert gone.returncode == 2 and "SGLANG_PORT is no longer read" in gone.stderr


def test_script_ppo_variant_plans_the_critic() -> None:
    proc = _script("run_search_r1.sh", PALAESTRA_ALGO="ppo")
    assert proc.returncode == 0, proc.stderr
    assert "critic: value model from" in proc.stdout and "Traceback" not in proc.stderr
    assert "1 trainer rank(s) (fsdp 1) on GPU bundles, 4 engine(s) in the plan, 5 GPUs" \
        in proc.stdout


def test_script_megatron_backend_is_passed_through() -> None:
    proc = _script("run_gsm8k_grpo.sh", PALAESTRA_BACKEND="megatron")
    # ask a clean interpreter (under pytest tests/trainers/megatron shadows the package name)
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('megatron') is None)"
    probe = subprocess.run([sys.executable, "-c", code],
                           cwd="/", env=_clean_env(), timeout=60, check=False)
    if probe.returncode:
        assert proc.returncode == 2 and "megatron" in proc.stderr
    else:
        assert proc.returncode == 0 and "backend megatron" in proc.stdout


def test_script_rejects_bad_tp() -> None:
    proc = _script("run_code_grpo.sh", "--placement.engine_gpus", "3")
    assert proc.returncode == 2 and "multiple of" in proc.stderr


def test_single_process_without_placement() -> None:
    cfg = load_config(TrainConfig, REPO / "configs" / "quickstart.toml")
    text = describe_plan(cfg, environ={})
    assert "placement: single process on cpu" in text


def test_shape_from_checkpoint_config(tmp_path: Path) -> None:
    hf = dict(NAMED_SHAPES["qwen3-0.6b"], _name_or_path="mine")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = TrainConfig(model={"path": str(tmp_path)})
    shape = resolve_shape(cfg, {})
    assert shape is not None and shape.source.endswith("config.json")
    # Qwen3-0.6B: 0.596B stored parameters (tied embeddings), as its model card says (0.6B)
    assert 0.59e9 < shape.params < 0.61e9
    # KV cache: 2 (K, V) x 28 layers x 8 kv heads x 128 x 2 bytes per token, all episodes of a step
    cfg = TrainConfig(model={"path": str(tmp_path)}, agent={"max_context": 1000},
                      rollout={"batch_size": 4, "group_size": 2})
    kv = engine_memory(shape, cfg, engines=2, tp=1)["kv_cache"]
    assert kv == 8 * 1000 * (2 * 28 * 8 * 128 * 2) / 2


def test_unknown_shape_and_bad_placement() -> None:
    cfg = TrainConfig(model={"path": "/nowhere/my-model"}, engine={"kind": "sglang",
                                                                   "urls": ["http://h:1"]})
    text = describe_placement(cfg, {"PALAESTRA_GPUS": "2", "PALAESTRA_TRAINER_GPUS": "1"})
    assert "model shape: unknown" in text and "disaggregated, 2 GPUs" in text
    with pytest.raises(ConfigError, match="PALAESTRA_MODEL_SHAPE"):
        describe_placement(cfg, {"PALAESTRA_MODEL_SHAPE": "gpt-5"})
    with pytest.raises(ConfigError, match="only 2 are available"):
        describe_placement(cfg, {"PALAESTRA_GPUS": "2", "PALAESTRA_TRAINER_GPUS": "2",
                                 "PALAESTRA_ENGINE_GPUS": "2"})


def test_over_budget_is_flagged() -> None:
    cfg = TrainConfig(model={"path": "/models/Qwen2.5-7B"}, engine={"kind": "sglang",
                                                                  "urls": ["http://h:1"]})
    text = describe_placement(cfg, {"PALAESTRA_TRAINER_GPUS": "1", "PALAESTRA_ENGINE_GPUS": "1",
                                    "PALAESTRA_GPU_MEMORY_GIB": "80"})
    trainer_row = next(line for line in text.splitlines() if "trainer rank 0" in line)
    # 7.6B params: 2 + 4 + 12 bytes each on one GPU = 128 GiB before activations
    assert float(trainer_row.split()[-2]) > 18 * 7.6e9 / GIB
    assert "OVER" in trainer_row and "warning" in text
