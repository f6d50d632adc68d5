"""Two Ray nodes on this machine: a head (``ray start --head``) and a second node with its own
raylet (``ray start --address ... --resources '{"node_b": 4}'``). Rollout workers and trainer
ranks are placed on both; killing the second node's raylet mid-batch re-runs its in-flight
episodes on the head (nothing lost), and losing a trainer rank fails with a clear
`TrainerRankLost`, after which a new group resumes from the last checkpoint.

Each scenario runs in its own driver process (``ray.init(address=...)``), as ``palaestra train``
would against a cluster; the nodes are real ``ray start`` processes, stopped by their pids."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
HERE = Path(__file__).parent
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TwoNodes:
    """A head with ``head_cpus`` CPUs and a second node (resource ``node_b``) on this machine."""

    def __init__(self, root: Path, head_cpus: int = 1, b_cpus: int = 1,
                 dashboard: bool = False) -> None:
        self.root = root
        self.port = _free_port()
        self.dashboard_port = _free_port()
        token = root / "token"
        token.write_text(secrets.token_hex(32))
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
                    "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                    "RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4",
                    "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
        self.env.pop("RAY_ADDRESS", None)
        self._ray("start", "--head", "--port", str(self.port), "--num-cpus", str(head_cpus),
                  "--temp-dir", str(root / "ray"), "--include-dashboard", str(dashboard).lower(),
                  "--dashboard-port", str(self.dashboard_port),
                  # two nodes on one machine: each dashboard agent needs its own port
                  "--dashboard-agent-listen-port", str(_free_port()),
                  "--object-store-memory", str(80 << 20))
        self.b_cpus = b_cpus
        self.start_b()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _ray(self, *args: str) -> None:
        proc = subprocess.run([RAY, *args, "--disable-usage-stats"], env=self.env,
                              capture_output=True, text=True, timeout=180, check=False)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    def start_b(self) -> None:
        self._ray("start", "--address", self.address, "--num-cpus", str(self.b_cpus),
                  "--resources", json.dumps({"node_b": 4}), "--object-store-memory",
                  str(80 << 20), "--dashboard-agent-listen-port", str(_free_port()))

    def _pids(self, *needles: str) -> list[int]:
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if all(n in cmd for n in needles):
                out.append(int(entry.name))
        return out

    def b_raylet(self) -> int:
        pids = [p for p in self._pids("raylet", "node_b", str(self.root)) if p != os.getpid()]
        assert len(pids) == 1, pids
        return pids[0]

    def kill_b(self) -> None:
        os.kill(self.b_raylet(), 9)

    def driver(self, script: str, *args: str, timeout: float = 300) -> dict:
        proc = subprocess.run([sys.executable, "-c", script, self.address, *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return _result(proc.stdout)

    def stop(self) -> None:
        for pid in self._pids(str(self.root)):  # every process of these two nodes, by pid
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture
def nodes():
    # a short root: Ray's socket paths under it must stay within AF_UNIX's 107 bytes
    root = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))
    cluster = TwoNodes(root)
    yield cluster
    cluster.stop()
    shutil.rmtree(root, ignore_errors=True)


ROLLOUT = r'''
import asyncio, json, sys, threading, time, ray
from rollout_helpers import calc_rows, worker_config
from palaestra.rollout import DataSource, RolloutConfig, RolloutManager, WorkerPool

address, tok, kill_file = sys.argv[1], sys.argv[2], sys.argv[3]
ray.init(address=address)
b = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("node_b")][0]

async def main():
    # 1 s per generation: the second batch outlasts the kill by seconds, so node b holds
    # groups in flight when its raylet dies however loaded the machine is
    pool = WorkerPool(worker_config(tok, latency_s=1.0), 2, cluster="ray", address=address,
                      num_cpus=1)
    await pool.start()
    table = ray._private.state.actors()
    nodes = [table[h.actor._actor_id.hex()]["Address"]["NodeID"] for h in pool.handles]
    mgr = RolloutManager(DataSource(calc_rows(64), seed=0, epochs=None), pool.worker_config,
                         RolloutConfig(batch_size=16, group_size=2, num_workers=2,
                                       max_concurrency=8), pool=pool)
    async with mgr:
        first = await mgr.generate_batch(0)
        async def kill_soon():
            await asyncio.sleep(0.3)
            open(kill_file, "w").write("kill")  # the test kills node b's raylet now
        killer = asyncio.ensure_future(kill_soon())
        t0 = time.perf_counter()
        second = await mgr.generate_batch(1)
        await killer
    print("RESULT " + json.dumps({"nodes": [n == b for n in nodes], "first": len(first.samples),
                      "second": len(second.samples),
                      "metrics": {k: v for k, v in second.metrics.items() if isinstance(v, (int, float))},
                      "seconds": time.perf_counter() - t0, "alive": len(pool.handles)}), flush=True)

asyncio.run(main())
'''


def test_rollout_survives_losing_a_node(nodes, tmp_path):
    from palaestra.tiny_model import build_model

    tok = str(build_model(tmp_path / "m", "micro"))
    kill_file = tmp_path / "kill"
    proc = subprocess.Popen([sys.executable, "-c", ROLLOUT, nodes.address, tok, str(kill_file)],
                            env=nodes.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 300
    while not kill_file.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    if kill_file.exists():
        nodes.kill_b()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    result = _result(out)
    assert sorted(result["nodes"]) == [False, True]  # one worker on the head, one on node b
    assert result["first"] == result["second"] == 32  # 16 groups x 2: nothing lost
    m = result["metrics"]
    assert m["groups/requeued_lost_worker"] >= 1  # node b's in-flight groups ran on the head
    assert result["alive"] == 1


TRAINER = r'''
import json, sys, time, ray, torch
from pathlib import Path
from palaestra.run.fleet.placement import PlacementSection, plan_run
from palaestra.trainers.algorithms.config import LossConfig
from palaestra.trainers.batching import TrainBatch
from palaestra.trainers.group.group import TrainerGroup, TrainerRankLost
from palaestra.trainers.torch_backend import TorchBackendConfig

address, model, work, phase = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
ray.init(address=address)
b = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("node_b")][0]
g = torch.Generator().manual_seed(0)
ids = [torch.randint(0, 200, (12 + 3 * i,), generator=g) for i in range(6)]
masks = [torch.tensor([0.0] * 4 + [1.0] * (len(t) - 4)) for t in ids]
batch = TrainBatch(token_ids=ids, loss_mask=masks, advantages=[m * (i % 3 - 1) for i, m in
                   enumerate(masks)], group_ids=[f"g{i // 3}" for i in range(6)])
loss = LossConfig.from_preset("grpo")
cfg = TorchBackendConfig(device="cpu", dtype="float32", lr=1e-3, pack_sequences=False)
plan = plan_run(PlacementSection(gpus_per_node=0, trainer_ranks=2, strategy="STRICT_SPREAD"),
                on_gpu=False)
group = TrainerGroup(model, cfg, plan, address=address).start()
out = {"on_b": [r["node_id"] == b for r in group.ranks]}
if phase == "train":
    out["grad_norm"] = group.train_step(batch, loss)["grad_norm"]
    group.save(work / "ckpt", extra={"rl_step": 1})
    (work / "ready").write_text("1")
    while not (work / "killed").exists():
        time.sleep(0.1)
    try:
        group.train_step(batch, loss)
        out["lost"] = None
    except TrainerRankLost as exc:
        out["lost"] = str(exc)
else:
    from palaestra.trainers.torch_backend import TorchBackend

    out["resumed_step"] = group.load(work / "ckpt")["rl_step"]
    out["step"] = group.step
    out["grad_norm"] = group.train_step(batch, loss)["grad_norm"]
    one = TorchBackend(model, cfg)  # one process continuing from the same checkpoint
    one.load(work / "ckpt")
    out["one_grad_norm"] = one.train_step(batch, loss)["grad_norm"]
group.close()
print("RESULT " + json.dumps(out), flush=True)
'''


def test_trainer_ranks_on_both_nodes_fail_clearly_and_resume(nodes, tmp_path):
    from palaestra.tiny_model import build_model

    model = str(build_model(tmp_path / "m", "micro"))
    cmd = [sys.executable, "-c", TRAINER, nodes.address, model, str(tmp_path)]
    proc = subprocess.Popen([*cmd, "train"], env=nodes.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (tmp_path / "ready").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    nodes.kill_b()
    (tmp_path / "killed").write_text("1")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    first = _result(out)
    assert sorted(first["on_b"]) == [False, True]  # STRICT_SPREAD: one rank per node
    rank_b = first["on_b"].index(True)
    assert f"trainer rank {rank_b}" in first["lost"] and "resumes from the last checkpoint" \
        in first["lost"]
    nodes.start_b()  # the next start (a node is back) resumes from the checkpoint
    second = nodes.driver(TRAINER, model, str(tmp_path), "resume")
    assert second["resumed_step"] == 1 and second["step"] == 1
    assert second["grad_norm"] == pytest.approx(second["one_grad_norm"], rel=1e-4)
    assert second["grad_norm"] != pytest.approx(first["grad_norm"], rel=1e-3)  # not a fresh model


def test_ray_job_submit_of_the_dp2_quickstart():
    """``ray job submit`` of configs/quickstart_dp2.toml (shortened) to the two-node cluster: the
    entrypoint joins the cluster through the RAY_ADDRESS Ray sets, and STRICT_SPREAD puts one
    trainer rank on each node."""
    root = Path(tempfile.mkdtemp(prefix="rj", dir="/tmp"))
    cluster = TwoNodes(root, head_cpus=2, b_cpus=2, dashboard=True)
    try:
        repo = HERE.parents[1]
        cmd = [RAY, "job", "submit", "--address", f"http://127.0.0.1:{cluster.dashboard_port}",
               "--runtime-env-json", json.dumps({"env_vars": {"OMP_NUM_THREADS": "1"}}), "--",
               sys.executable, "-m", "palaestra.cli", "train",
               str(repo / "configs/quickstart_dp2.toml"), "--out", str(root / "run"),
               "--model.init_size", "micro", "--warmup.steps", "0", "--trainer.steps", "2",
               "--rollout.batch_size", "4", "--rollout.group_size", "2", "--eval.num_tasks", "4",
               "--logging.progress", "false", "--placement.strategy", "STRICT_SPREAD"]
        for _ in range(20):  # the job agent comes up a little after `ray start` returns
            proc = subprocess.run(cmd, env=cluster.env, capture_output=True, text=True,
                                  timeout=400, check=False)
            if "No available agent" not in proc.stdout + proc.stderr:
                break
            time.sleep(3)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        assert "succeeded" in proc.stdout + proc.stderr
        rows = (root / "run" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in rows if json.loads(r).get("phase") == "rl"] == [0, 1]
        assert (root / "run" / "final-model" / "config.json").is_file()
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
