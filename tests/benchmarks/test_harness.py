"""`evaluate` end to end with a deterministic gold-answer engine: exact accuracies, files, resume."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from palaestra.benchmarks.metrics import maj_at_k, pass_at_k
from palaestra.benchmarks.runner import EvalSettings, evaluate
from palaestra.benchmarks.store import read_records
from palaestra.errors import ConfigError, EngineError


async def test_known_fraction_gives_exactly_that_accuracy(gold_engine, token_policy, gsm8k_rows):
    questions = sorted(row["question"].strip() for row in gsm8k_rows)
    right = set(questions[::3])  # 7 of the 20 tasks
    engine = gold_engine(lambda q, seed, count: q in right)
    summary = await evaluate(
        ["gsm8k"], token_policy(engine), EvalSettings(n=1, limit=20), progress=False
    )
    s = summary["gsm8k"]
    assert s["pass@1"] == len(right) / 20 == 0.35
    assert s["accuracy"] == 0.35 and s["mean"] == 0.35
    assert s["tasks"] == 20 and s["samples"] == 20 and s["n"] == 1
    assert s["stop_reasons"] == {"terminated": 20}
    assert engine.requests == 20


async def test_pass_and_maj_at_k_for_known_per_task_counts(gold_engine, token_policy, gsm8k_rows):
    n = 4
    questions = sorted(row["question"].strip() for row in gsm8k_rows)
    correct_count = {q: i % (n + 1) for i, q in enumerate(questions)}  # c = 0..4 per task
    engine = gold_engine(lambda q, seed, count: count < correct_count[q])
    summary = await evaluate(
        ["gsm8k"], token_policy(engine), EvalSettings(n=n, limit=20, concurrency=7), progress=False
    )
    s = summary["gsm8k"]
    for k in range(1, n + 1):
        expected = sum(pass_at_k(n, c, k) for c in correct_count.values()) / 20
        assert s[f"pass@{k}"] == pytest.approx(expected, abs=1e-12)
        # every wrong sample answers gold + 1, so the votes are c right vs n - c wrong
        maj = [
            maj_at_k(["right"] * c + ["wrong"] * (n - c), [True] * c + [False] * (n - c), k)
            for c in correct_count.values()
        ]
        assert s[f"maj@{k}"] == pytest.approx(sum(maj) / 20, abs=1e-12)
    assert s["pass@k"] == s[f"pass@{n}"]
    assert s[f"mean@{n}"] == pytest.approx(sum(correct_count.values()) / (n * 20))


async def test_output_files_exist_and_parse(tmp_path, gold_engine, token_policy):
    engine = gold_engine(lambda q, seed, count: count % 2 == 0)
    out = tmp_path / "run"
    await evaluate(["gsm8k"], token_policy(engine), EvalSettings(n=2, limit=6), out_dir=out, progress=False)
    lines = (out / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 12
    records = [json.loads(line) for line in lines]
    keys = {(r["benchmark"], r["task_id"], r["sample"], r["model"]) for r in records}
    assert len(keys) == 12
    first = records[0]
    for field in ("correct", "reward", "answer", "gold", "stop_reason", "completion_tokens",
                  "prompt_tokens", "time_s", "turns", "tool_calls", "seed"):
        assert field in first, field
    traj = first["trajectory"]
    assert [m["role"] for m in traj["messages"]] == ["system", "user", "assistant"]
    assert "\\boxed{" in traj["messages"][-1]["content"]
    assert traj["turn_rewards"] == [first["reward"]]
    sample = traj["samples"][0]
    assert len(sample["token_ids"]) == len(sample["loss_mask"]) == first["total_tokens"]
    assert sum(sample["loss_mask"]) == first["completion_tokens"]
    assert first["answer"] in (first["gold"], str(int(first["gold"]) + 1))

    summary = json.loads((out / "summary.json").read_text())  # strict JSON: no NaN
    assert set(summary) == {"gsm8k"}
    for key in ("pass@1", "pass@k", "mean", "n", "tasks"):
        assert key in summary["gsm8k"]
    assert summary["gsm8k"]["pass@1"] == 0.5 and summary["gsm8k"]["pass@2"] == 1.0

    report = (out / "report.md").read_text()
    assert "| gsm8k | 6 | 2 |" in report and "## gsm8k" in report
    assert "**A correct sample**" in report and "**An incorrect sample**" in report
    assert "So the answer is \\boxed{" in report  # the example's final message, read back
    pngs = [line.split("(")[1].rstrip(")") for line in report.splitlines() if line.startswith("![")]
    assert len(pngs) == 4
    import matplotlib.image

    for rel in pngs:
        path = out / rel
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width = matplotlib.image.imread(str(path)).shape[:2]
        assert height > 100 and width > 100


async def test_resume_after_interrupt_matches_an_uninterrupted_run(
    tmp_path, gold_engine, token_policy
):
    def decide(question, seed, count):
        return seed % 3 != 0  # per-sample, stable across runs

    settings = EvalSettings(n=2, limit=20, concurrency=16)
    full = tmp_path / "full"
    expected = await evaluate(["gsm8k"], token_policy(gold_engine(decide)), settings, out_dir=full, progress=False, report=False)

    part = tmp_path / "part"
    gate = asyncio.Event()  # never set: requests after the 9th hang, as on a crashed server
    stuck = gold_engine(decide, gate=gate, block_after=9)
    task = asyncio.create_task(
        evaluate(["gsm8k"], token_policy(stuck), settings, out_dir=part, progress=False, report=False)
    )
    for _ in range(2000):
        await asyncio.sleep(0.01)
        if (part / "samples.jsonl").exists() and len(list(read_records(part / "samples.jsonl"))) >= 9:
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with open(part / "samples.jsonl", "a") as f:  # a crash in the middle of a write
        f.write('{"benchmark": "gsm8k", "task_id": "torn", "sa')
    saved = len(list(read_records(part / "samples.jsonl")))
    assert saved == 9

    fresh = gold_engine(decide)
    resumed = await evaluate(["gsm8k"], token_policy(fresh), settings, out_dir=part, progress=False, report=False)
    assert fresh.requests == 40 - saved  # finished samples were skipped
    drop = ("mean_time_s",)
    assert {k: v for k, v in resumed["gsm8k"].items() if k not in drop} == {
        k: v for k, v in expected["gsm8k"].items() if k not in drop
    }
    records = list(read_records(part / "samples.jsonl"))
    assert len(records) == 40
    assert len({(r["task_id"], r["sample"]) for r in records}) == 40

    again = gold_engine(decide)  # a third run has nothing left to do
    await evaluate(["gsm8k"], token_policy(again), settings, out_dir=part, progress=False, report=False)
    assert again.requests == 0

    more = gold_engine(decide)  # a larger n only draws the new sample indices
    await evaluate(["gsm8k"], token_policy(more), EvalSettings(n=3, limit=20, concurrency=16),
                   out_dir=part, progress=False, report=False)
    assert more.requests == 20


async def test_resume_with_other_settings_is_refused(tmp_path, gold_engine, token_policy):
    out = tmp_path / "run"
    policy = token_policy(gold_engine(lambda q, s, c: True))
    await evaluate(["gsm8k"], policy, EvalSettings(limit=2), out_dir=out, progress=False, report=False)
    with pytest.raises(ConfigError, match="temperature"):
        await evaluate(["gsm8k"], policy, EvalSettings(limit=2, temperature=1.0), out_dir=out,
                       progress=False, report=False)


async def test_another_benchmark_with_its_own_env_kwargs_can_join_the_folder(
    tmp_path, gold_engine, token_policy, gsm8k_rows
):
    from palaestra.benchmarks import Benchmark

    out = tmp_path / "run"
    policy = token_policy(gold_engine(lambda q, s, c: True))
    await evaluate(["gsm8k"], policy, EvalSettings(limit=2), out_dir=out, progress=False,
                   report=False)
    other = Benchmark(name="gsm8k-short", env_id="palaestra/GSM8K-v0",
                      dataset=lambda: gsm8k_rows[:2])
    summary = await evaluate([other], policy, EvalSettings(limit=2), out_dir=out,
                             env_kwargs={"gsm8k-short": {"max_turns": 1}}, progress=False,
                             report=False)
    assert summary["gsm8k-short"]["pass@1"] == 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"gsm8k", "gsm8k-short"}  # the first benchmark's entry is kept
    with pytest.raises(ConfigError, match="gsm8k-short.*env_kwargs"):
        await evaluate([other], policy, EvalSettings(limit=2), out_dir=out, progress=False,
                       report=False)


async def test_samples_of_another_model_are_kept_apart(tmp_path, gold_engine, token_policy):
    out = tmp_path / "run"
    await evaluate(["gsm8k"], token_policy(gold_engine(lambda q, s, c: True), "a"),
                   EvalSettings(limit=3), out_dir=out, progress=False, report=False)
    engine_b = gold_engine(lambda q, s, c: False)
    summary = await evaluate(["gsm8k"], token_policy(engine_b, "b"), EvalSettings(limit=3),
                             out_dir=out, progress=False, report=False)
    assert engine_b.requests == 3 and summary["gsm8k"]["pass@1"] == 0.0


class _FailingEngine:
    """An engine whose server answers every request with HTTP 503."""

    weight_version = 0

    def __init__(self):
        self.requests = 0

    async def generate(self, input_ids, sampling, *, request_id=None, session_id=None):
        from palaestra.engine import EngineUnavailableError

        self.requests += 1
        raise EngineUnavailableError("HTTP 503 from http://127.0.0.1:1/generate")

    async def health(self):
        return True

    async def close(self):
        pass


async def test_engine_failures_stop_the_run_and_store_nothing(tmp_path, token_policy):
    engine = _FailingEngine()
    out = tmp_path / "run"
    with pytest.raises(EngineError, match="rerun the same command"):
        await evaluate(["gsm8k"], token_policy(engine),
                       EvalSettings(limit=20, concurrency=2, max_engine_failures=3),
                       out_dir=out, progress=False, report=False)
    assert list(read_records(out / "samples.jsonl")) == []
    assert engine.requests < 20  # it stopped early


async def test_an_unhealthy_engine_fails_before_any_work(tmp_path, gold_engine, token_policy):
    engine = gold_engine(lambda q, s, c: True)
    engine.healthy = False
    with pytest.raises(EngineError, match="not healthy"):
        await evaluate(["gsm8k"], token_policy(engine), EvalSettings(limit=2),
                       out_dir=tmp_path / "run", progress=False, report=False)
    assert engine.requests == 0
    assert not (Path(tmp_path / "run") / "samples.jsonl").exists()


async def test_unavailable_benchmarks_fail_before_any_work(gold_engine, token_policy):
    engine = gold_engine(lambda q, s, c: True)
    with pytest.raises(ConfigError, match="nq_open.*retriever"):
        await evaluate(["gsm8k", "nq_open"], token_policy(engine), EvalSettings(limit=2),
                       progress=False, report=False)
    assert engine.requests == 0
