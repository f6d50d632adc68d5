"""``palaestra eval compare``, ``palaestra eval report`` and ``list`` on real evaluation runs."""

from __future__ import annotations

import json

import pytest

from palaestra.benchmarks.compare import compare_runs
from palaestra.benchmarks.runner import EvalSettings, evaluate
from palaestra.errors import ConfigError


@pytest.fixture
async def two_runs(tmp_path, gold_engine, token_policy, gsm8k_rows):
    questions = sorted(row["question"].strip() for row in gsm8k_rows)
    right_a = set(questions[:6])  # A solves tasks 0-5, B solves tasks 3-14
    right_b = set(questions[3:15])
    runs = {}
    for name, right in (("a", right_a), ("b", right_b)):
        engine = gold_engine(lambda q, seed, count, right=right: q in right)
        runs[name] = tmp_path / name
        await evaluate(["gsm8k"], token_policy(engine, f"model-{name}"), EvalSettings(limit=20),
                       out_dir=runs[name], progress=False, report=False)
    return runs, right_a, right_b


def _task_ids_of(run, questions):
    ids = set()
    for line in (run / "samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        user = [m for m in record["trajectory"]["messages"] if m["role"] == "user"][0]["content"]
        if user.strip() in questions:
            ids.add(record["task_id"])
    return ids


async def test_deltas_intervals_and_flipped_tasks(two_runs):
    runs, right_a, right_b = two_runs
    (row,) = compare_runs(runs["a"], runs["b"])
    assert row.benchmark == "gsm8k" and row.tasks == 20
    assert row.a == pytest.approx(6 / 20) and row.b == pytest.approx(12 / 20)
    assert row.delta == pytest.approx(6 / 20)
    assert row.delta_ci[0] <= row.delta <= row.delta_ci[1]
    assert row.a_ci[0] <= row.a <= row.a_ci[1]
    assert set(row.gained) == _task_ids_of(runs["b"], right_b - right_a)
    assert set(row.lost) == _task_ids_of(runs["a"], right_a - right_b)
    assert len(row.gained) == 9 and len(row.lost) == 3
    # per-task deltas: nine +1, three -1, eight 0 -> standard error ~0.16 around +0.3
    assert -0.1 < row.delta_ci[0] < 0.3 < row.delta_ci[1] < 0.7
    assert row.significant == (row.delta_ci[0] > 0)
    (same,) = compare_runs(runs["a"], runs["a"])
    assert same.delta == 0.0 and same.delta_ci == (0.0, 0.0) and not same.gained and not same.lost


def test_cli_compare_prints_the_table_and_writes_json(two_runs, tmp_path, capsys):
    from palaestra.cli import main

    runs, _, _ = two_runs
    out = tmp_path / "cmp.json"
    assert main(["eval", "compare", str(runs["a"]), str(runs["b"]), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| gsm8k | 20 |" in text and "+0.3000" in text
    assert "gained (solved only in B)" in text
    data = json.loads(out.read_text())
    assert data["gsm8k"]["delta"] == pytest.approx(0.3)


def test_compare_needs_a_shared_benchmark(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="samples.jsonl"):
        compare_runs(tmp_path / "empty", tmp_path / "empty")


def test_cli_report_rebuilds_summary_and_report(two_runs, capsys):
    from palaestra.cli import main

    runs, _, _ = two_runs
    assert main(["eval", "report", str(runs["a"])]) == 0
    summary = json.loads((runs["a"] / "summary.json").read_text())
    assert summary["gsm8k"]["pass@1"] == pytest.approx(0.3)
    assert (runs["a"] / "report.md").exists()
    assert (runs["a"] / "plots" / "gsm8k_pass_at_k.png").exists()


def test_cli_list_shows_benchmarks_and_availability(capsys):
    from palaestra.cli import main

    assert main(["eval", "list"]) == 0
    text = capsys.readouterr().out
    for name in ("gsm8k", "math500", "humaneval", "hotpotqa", "calculator", "frozenlake"):
        assert name in text
    assert "gsm8k" in text and "(ok)" in text


def test_cli_unknown_benchmark_is_a_clear_error(capsys):
    from palaestra.cli import main

    assert main(["eval", "--benchmark", "gsm9k", "--model", "x"]) == 2
    assert "Did you mean gsm8k" in capsys.readouterr().err


def test_cli_imports_a_user_module_that_registers_a_benchmark(tmp_path, monkeypatch, capsys):
    from palaestra.benchmarks import unregister_benchmark
    from palaestra.cli import main

    data = tmp_path / "rows.jsonl"
    data.write_text('{"id": "a", "question": "What is 2 + 2?", "answer": "#### 4"}\n')
    (tmp_path / "my_benchmarks.py").write_text(
        '"""A user module."""\n'
        "from palaestra.benchmarks import Benchmark, register_benchmark\n\n"
        f"register_benchmark(Benchmark(name='my-sums', env_id='palaestra/GSM8K-v0', dataset={str(data)!r},\n"
        "                              description='my own sums'))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert main(["eval", "list", "--import", "my_benchmarks"]) == 0
        assert "my-sums" in capsys.readouterr().out
    finally:
        unregister_benchmark("my-sums")


def test_per_benchmark_flags():
    from palaestra.benchmarks.cli import _json_object, _per_benchmark
    from palaestra.errors import ConfigError

    names = ["gsm8k", "nq_open"]
    got = _per_benchmark(['{"python_tool": true}', 'nq_open={"retriever": "http://h:1/r?a=b"}'],
                         names, _json_object, "--env-kwargs")
    assert got == {"gsm8k": {"python_tool": True},
                   "nq_open": {"python_tool": True, "retriever": "http://h:1/r?a=b"}}
    assert _per_benchmark(["gsm8k=/data/x.jsonl"], names, str, "--dataset") == {"gsm8k": "/data/x.jsonl"}
    with pytest.raises(ConfigError, match="--env-kwargs"):
        _per_benchmark(["[1, 2]"], names, _json_object, "--env-kwargs")
