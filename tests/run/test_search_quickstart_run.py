"""The search quickstart's run: its retrieval server, a shortened training run, eval equality.

``[services] retriever = "serve"`` starts ``palaestra serve-retriever`` for the run and stops it
at the end, and also when the run is SIGKILLed (the server's watchdog sees its parent go). A
shortened configs/search_r1_quickstart.toml (fewer SFT steps, a few GRPO steps) must raise the
reward, its held-out evaluation must equal ``palaestra eval --benchmark search_r1_quickstart``
of the exported model, and that model must score (almost) nothing against a retriever that
returns no documents.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "search_r1_quickstart.toml"


def _gone(pid: int) -> bool:
    """True when ``pid`` has exited (a zombie no one reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return False


def _write_config(tmp: Path, **overrides: str) -> Path:
    """The quickstart config with absolute data paths and the ``overrides`` (TOML lines)."""
    text = CONFIG.read_text().replace('"data/search_quickstart/', f'"{REPO}/data/search_quickstart/')
    text = text.replace('out = "runs/search_quickstart"', f'out = "{tmp / "run"}"')
    extra = "\n".join(f"{k} = {v}" for k, v in overrides.items())
    path = tmp / "quickstart.toml"
    path.write_text(text + "\n" + "[logging]\nprogress = false\ntensorboard = false\n" + extra)
    return path


def _cli(config: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "palaestra", "train", str(config), *args]


async def test_run_services_serves_the_envs_corpus_and_stops(tmp_path):
    from palaestra.config import load_config
    from palaestra.envs.search.http import HTTPRetriever
    from palaestra.run.config import TrainConfig
    from palaestra.run.services import run_env_kwargs, run_services

    cfg = load_config(TrainConfig, _write_config(tmp_path))
    assert run_env_kwargs(cfg)["retriever"] == "bm25"
    async with run_services(cfg, tmp_path):
        url = run_env_kwargs(cfg)["retriever"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/retrieve")
        hits, empty = await HTTPRetriever(url).asearch(["7311", ""], 3)
        assert [h.document.contents for h in hits] == [
            "person 7311\nperson 7311 lives in town 961."]
        assert empty == []  # an empty query finds nothing
        log = (tmp_path / "services" / "retriever.log").read_text()
        assert "serving 600 documents" in log
    assert run_env_kwargs(cfg)["retriever"] == "bm25"  # recorded settings never see the URL
    with pytest.raises(Exception):
        await HTTPRetriever(url, retries=0, timeout_s=2).asearch(["7311"], 1)


def test_a_served_retriever_needs_the_bm25_retriever(tmp_path):
    from palaestra.config import load_config
    from palaestra.run.config import TrainConfig

    path = _write_config(tmp_path)
    path.write_text(path.read_text().replace('retriever = "bm25"',
                                             'retriever = "http://127.0.0.1:9/retrieve"'))
    with pytest.raises(Exception, match="services.retriever"):
        load_config(TrainConfig, path)


def test_a_killed_run_leaves_no_retriever_behind(tmp_path):
    config = _write_config(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(_cli(config), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=tmp_path)
    server_pid = None
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("[services]"):
                server_pid = int(line.split("(pid ", 1)[1].split(")", 1)[0])
                break
            assert time.monotonic() < deadline, "the run did not start its retriever"
        assert server_pid is not None and not _gone(server_pid)
        proc.send_signal(signal.SIGKILL)  # no cleanup runs in the trainer
        proc.wait(30)
        assert _wait_gone(server_pid), "the retriever outlived its killed run"
    finally:
        if proc.poll() is None:
            proc.kill()
        if server_pid is not None and not _gone(server_pid):
            os.kill(server_pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """A shortened quickstart run in a subprocess (the README's command, fewer steps)."""
    tmp = tmp_path_factory.mktemp("search-quickstart")
    config = _write_config(tmp)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the quickstart's own warm start (shorter ones do not learn to copy yet), 4 GRPO steps
    args = ["--trainer.steps", "4", "--checkpoint.interval", "4"]
    done = subprocess.run(_cli(config, *args), capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp / "run", done.stdout


@pytest.mark.slow
def test_the_short_run_learns_to_search(short_run):
    run, console = short_run
    assert "[services] palaestra serve-retriever" in console
    rl = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r["phase"] == "rl"]
    rewards = [r["reward_mean"] for r in rl]
    assert rewards[-1] > rewards[0], rewards
    assert all("tool_calls/mean" in r for r in rl)
    evals = {e["stage"]: e for e in map(json.loads, (run / "eval.jsonl").read_text().splitlines())}
    assert set(evals) == {"init", "sft", "rl"}
    assert all("tool_calls_mean" in e for e in evals.values())
    assert (run / "curves.png").is_file()
    settings = json.loads((run / "final-model" / "trained_with.json").read_text())
    assert settings["env_kwargs"]["retriever"] == "bm25"  # not the dead server's URL


def _eval(model: Path, out: Path, *extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "palaestra", "eval", "--benchmark", "search_r1_quickstart",
         "--model", str(model), "--out", str(out), "--no-progress", "--no-report", *extra],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())["search_r1_quickstart"]


@pytest.mark.slow
def test_eval_of_the_final_model_equals_training_and_needs_the_documents(short_run, tmp_path):
    run, _ = short_run
    evals = {e["stage"]: e for e in map(json.loads, (run / "eval.jsonl").read_text().splitlines())}
    summary = _eval(run / "final-model", tmp_path / "eval")
    assert summary["tasks"] == 100
    assert summary["pass@1"] == pytest.approx(evals["rl"]["success_rate"])

    # the same model against a retriever over a corpus that holds none of the people
    import asyncio

    from palaestra.run.retriever import RetrieverServer

    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "0", "contents": "nobody\nnobody lives here."}) + "\n")
    server = RetrieverServer(corpus=other, log_path=tmp_path / "other.log")
    try:
        asyncio.run(server.wait_ready(60))
        blind = _eval(run / "final-model", tmp_path / "eval-blind", "--env-kwargs",
                      json.dumps({"retriever": server.url}))
    finally:
        server.stop()
    assert blind["pass@1"] <= 0.1
    assert _gone(server.pid)
