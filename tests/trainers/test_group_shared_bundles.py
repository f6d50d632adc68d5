"""Colocated engine actors beside a trainer group: one placement group of the plan for both.

Engine i sits on trainer rank i's bundle (`RunPlan.shares_bundles`): the engines reserve the
plan's bundles once (`EngineGroup.start(plan, shared=True)`) and the trainer group starts its
ranks in that placement group (`TrainerGroup(placement_group=...)`). On real Ray with CPU bundles
this checks that each bundle holds exactly its rank and its engine (its CPUs all taken, two
actors scheduled on it), that the group trains while the engines serve, that closing the group
leaves the engines' placement group alone, and (slow) that ``palaestra train`` of such a config
trains and finishes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from palaestra.config import load_config
from palaestra.errors import ConfigError
from palaestra.run.fleet.placement import PlacementSection, plan_run
from palaestra.run.config import TrainConfig

torch.set_num_threads(1)
ray = pytest.importorskip("ray")

SHARED = PlacementSection(gpus_per_node=0, trainer_ranks=2, engines=2, colocate=True,
                          cpus_per_rank=0.5, cpus_per_engine=0.25)


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    from palaestra.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("shared-bundles") / "model", "micro")


@pytest.fixture(scope="module")
def ray_local():
    if ray.is_initialized():  # another folder's session cluster: size our own
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


# ----------------------------------------------------------------------------- the plan
def test_colocated_cpu_engines_share_the_trainer_bundles():
    plan = plan_run(SHARED, on_gpu=False)
    assert plan.trainer_bundles == (0, 1) and plan.engine_bundles == ((0,), (1,))
    assert plan.bundles == ({"CPU": 0.75},) * 2 and plan.shares_bundles
    assert (plan.trainer_cpus, plan.engine_cpus) == (0.5, 0.25)
    assert "bundle 1 [CPU 0.75]: trainer rank 1 + engine 1" in "\n".join(plan.describe_lines())
    with pytest.raises(ConfigError, match=r"placement.engines \(3\) must equal trainer_ranks"):
        plan_run(SHARED.model_copy(update={"engines": 3}), on_gpu=False)
    gpu = plan_run(PlacementSection(gpus_per_node=4, trainer_ranks=4, engine_gpus=4,
                                    engine_tp=2, colocate=True), on_gpu=True)
    assert gpu.shares_bundles and gpu.engine_bundles == ((0, 1), (2, 3))
    assert gpu.trainer_gpu_fraction == gpu.engine_gpu_fraction == 0.5
    assert gpu.bundles[0] == {"GPU": 1.0, "CPU": 1.5}  # the rank's CPU and the engine actor's
    apart = plan_run(PlacementSection(gpus_per_node=8, trainer_ranks=4, engine_gpus=4),
                     on_gpu=True)
    assert not apart.shares_bundles


def test_colocated_gpu_engine_actors_beside_a_group_load_and_plan(tmp_path):
    from palaestra.run.dry_run import describe_plan

    config = tmp_path / "c.toml"
    config.write_text('[model]\npath = "/nowhere"\n[env]\nid = "palaestra/GSM8K-v0"\n'
                      '[engine]\nkind = "sglang"\n[rollout]\nmode = "sync"\n'
                      '[placement]\ngpus_per_node = 4\ntrainer_ranks = 4\nengine_gpus = 4\n'
                      'colocate = true\nmodel_shape = "qwen3-1.7b"\n')
    cfg = load_config(TrainConfig, config, [])  # refused before: the group's GPUs twice
    text = describe_plan(cfg, environ={})
    assert "one placement group for the trainer group and the engines" in text
    assert "engine actor 3: bundles [3] --tp-size 1 --enable-memory-saver" in text


# ------------------------------------------------------------------------- real Ray
def _bundle_free(pg_id: str) -> dict[int, tuple[float, float]]:
    """Per bundle of placement group ``pg_id``: (free CPUs, free 'bundle' units)."""
    free = ray.available_resources()
    out = {}
    for i in range(2):
        out[i] = (free.get(f"CPU_group_{i}_{pg_id}", 0.0),
                  free.get(f"bundle_group_{i}_{pg_id}", 0.0))
    return out


async def test_group_ranks_start_on_the_engines_bundles(ray_local, micro_model, tmp_path):
    from palaestra.run.fleet.actors import EngineGroup
    from palaestra.run.fleet.engine_actor import EngineLaunch
    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.group.group import TrainerGroup
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    plan = plan_run(SHARED, on_gpu=False)
    engines = EngineGroup(EngineLaunch(str(micro_model), extra_args=("--threads", "1"),
                                       log_dir=str(tmp_path), colocate=True))
    await engines.start(plan, shared=True)
    try:
        pg = engines.placement_group
        assert pg is not None and all(m.placement_group is None for m in engines.members)
        pg_id = pg.id.hex()
        cfg = TorchBackendConfig(device="cpu", dtype="float32", lr=1e-2, pack_sequences=False)
        group = TrainerGroup(micro_model, cfg, plan, placement_group=pg).start()
        try:
            # each bundle: 0.5 CPU (rank) + 0.25 (engine) = all of it, and two actors on it
            for free_cpu, units in _bundle_free(pg_id).values():
                assert free_cpu == pytest.approx(0.0)
                assert units == pytest.approx(1000.0 - 2 * 0.001)
            g = torch.Generator().manual_seed(0)
            ids = [torch.randint(0, 50, (8 + i,), generator=g) for i in range(4)]
            masks = [torch.tensor([0.0] * 2 + [1.0] * (len(t) - 2)) for t in ids]
            batch = TrainBatch(token_ids=ids, loss_mask=masks,
                               advantages=[m * (1 if i % 2 else -1) for i, m in enumerate(masks)],
                               group_ids=["p0", "p0", "p1", "p1"])
            stats = group.train_step(batch, LossConfig.from_preset("grpo"))
            assert stats["num_tokens"] == sum(len(t) for t in ids)
            for url in engines.urls:  # the engines serve beside the trained ranks
                client = SGLangClient(url)
                try:
                    assert "model_path" in await client.get_server_info()
                finally:
                    await client.close()
            # ipc beside the ranks: each rank hands its gathered weights to its own engine
            from palaestra.run.fleet.engine_sync import _neighbour_urls
            from palaestra.trainers.group.push import EnginePushSpec

            neighbours = _neighbour_urls(engines)
            by_index = sorted(engines.members, key=lambda m: m.index)
            assert neighbours == tuple(m.url for m in by_index)
            spec = EnginePushSpec(method="ipc", urls=tuple(engines.urls), bucket_bytes=1 << 20,
                                  rank_urls=neighbours)
            stats = group.push_weights(spec, version=3)
            assert [(a["rank"], a["urls"]) for a in group.last_senders] == \
                [(0, (neighbours[0],)), (1, (neighbours[1],))]
            each = [a["stats"] for a in group.last_senders]
            assert each[0].num_bytes == each[1].num_bytes > 0  # both ranks sent the whole model
            assert stats.num_bytes == each[0].num_bytes + each[1].num_bytes
            full = group.state_dict_for_engines()  # rank 0's gathered weights, as a check
            for url in neighbours:
                client = SGLangClient(url)
                try:
                    assert (await client.get_model_info())["weight_version"] == "3"
                    for name, tensor in full.items():
                        got = torch.tensor(await client.get_weights_by_name(
                            name, truncate_size=1 << 20))
                        torch.testing.assert_close(got, tensor.float().reshape(got.shape),
                                                   atol=1e-6, rtol=0)
                finally:
                    await client.close()
        finally:
            group.close()
        assert engines.placement_group is pg  # the group left the engines' placement group
        assert ray.util.placement_group_table(pg)["state"] == "CREATED"
        deadline = time.monotonic() + 30  # the ranks' resources come back once Ray reaps them
        while (any(free_cpu != pytest.approx(0.5) for free_cpu, _ in _bundle_free(pg_id).values())
               and time.monotonic() < deadline):
            await asyncio.sleep(0.2)
        assert all(free_cpu == pytest.approx(0.5) for free_cpu, _ in _bundle_free(pg_id).values())
    finally:
        await engines.close()
    assert engines.placement_group is None
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"


# ----------------------------------------------------------------------- a whole run
RUN = '''
out = "{out}"
seed = 0
[model]
path = "{model}"
[agent]
max_context = 256
tools_in_prompt = false
[env]
id = "palaestra/Calculator-v0"
[env.kwargs]
max_turns = 1
[data]
num_tasks = 32
[eval]
num_tasks = 2
[rollout]
num_workers = 1
max_new_tokens = 6
batch_size = 4
group_size = 2
mode = "sync"
[engine]
kind = "local"
launch_args = ["--threads", "1"]
[trainer]
steps = 2
[trainer.loss]
preset = "grpo"
[trainer.torch]
device = "cpu"
dtype = "float32"
pack_sequences = false
[checkpoint]
interval = 2
[logging]
progress = false
tensorboard = false
[placement]
gpus_per_node = 0
trainer_ranks = 2
engines = 2
colocate = true
cpus_per_rank = 0.5
cpus_per_engine = 0.25
'''


@pytest.mark.slow
def test_palaestra_train_with_colocated_engine_actors_and_two_ranks(tmp_path, micro_model):
    config = tmp_path / "run.toml"
    config.write_text(RUN.format(out=tmp_path / "run", model=micro_model))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    dry = subprocess.run([sys.executable, "-m", "palaestra", "train", str(config), "--dry-run"],
                         env=env, capture_output=True, text=True, timeout=120, check=False)
    assert dry.returncode == 0, dry.stderr
    assert "bundle 0 [CPU 0.75]: trainer rank 0 + engine 0" in dry.stdout
    proc = subprocess.run([sys.executable, "-m", "palaestra", "train", str(config)], env=env,
                          capture_output=True, text=True, timeout=500, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("(palaestra, no GPU) serves on http://127.0.0.1:") == 2, out[-4000:]
    assert "[trainer group] 2 ranks on bundles [0, 1] of the engines' placement group" in out
    run = tmp_path / "run"
    rl = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
          if line.strip() and json.loads(line).get("phase") == "rl"]
    assert [r["version"] for r in rl] == [0, 1]
    final = json.loads((run / "engines.json").read_text())
    assert final["served_versions"] == {a["url"]: "2" for a in final["actors"]}


# ---------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_an_engine_and_a_rank_share_one_gpu_bundle_gpu(micro_model, tmp_path):
    """One GPU: engine 0 (``palaestra serve --device cuda``) and trainer rank 0 each ask half of
    the one bundle's GPU in the same placement group; the engine serves on CUDA and the rank
    trains on CUDA beside it."""
    from palaestra.engine import SamplingParams
    from palaestra.run.fleet.actors import ActorEngine, EngineGroup
    from palaestra.run.fleet.engine_actor import EngineLaunch
    from palaestra.engines.clients.sglang_client import SGLangClient
    from palaestra.trainers.group.group import TrainerGroup
    from palaestra.trainers.torch_backend.config import TorchBackendConfig

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_gpus=1, num_cpus=4, include_dashboard=False)
    try:
        plan = plan_run(PlacementSection(gpus_per_node=1, trainer_ranks=1, engine_gpus=1,
                                         colocate=True), on_gpu=True)
        assert plan.shares_bundles and plan.engine_gpu_fraction == 0.5
        engines = EngineGroup(EngineLaunch(str(micro_model), colocate=True, log_dir=str(tmp_path)))
        engine = ActorEngine(engines, health_interval_s=0)
        await engines.start(plan, shared=True)
        await engine.start()
        try:
            pg = engines.placement_group
            group = TrainerGroup(micro_model, TorchBackendConfig(device="cuda"), plan,
                                 placement_group=pg).start()
            try:
                free = ray.available_resources()
                assert free.get(f"GPU_group_0_{pg.id.hex()}", 0.0) == pytest.approx(0.0)
                assert group.ranks[0]["device"].startswith("cuda")
                gen = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
                assert len(gen.token_ids) == 4
                client = SGLangClient(engines.urls[0])
                try:
                    assert (await client.get_server_info())["device"].startswith("cuda")
                finally:
                    await client.close()
                print(f"shared GPU bundle: rank memory {group.memory()[0]}")
            finally:
                group.close()
        finally:
            await engine.close()
    finally:
        ray.shutdown()
