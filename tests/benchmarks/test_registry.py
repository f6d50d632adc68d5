"""The benchmark registry: built-ins, user benchmarks in a few lines, prompt templates, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from palaestra.benchmarks import (
    Benchmark,
    get_benchmark,
    list_benchmarks,
    load_tasks,
    register_benchmark,
    unregister_benchmark,
)
from palaestra.benchmarks.registry import check_requirements, env_available
from palaestra.errors import ConfigError

BUILTIN = {
    "gsm8k", "math500", "humaneval", "mbpp", "nq_open", "hotpotqa", "musique", "multihop_heldout",
    "multihop_closed_book",
    "calculator", "frozenlake", "taxi", "blackjack", "cliffwalking",
}


def test_builtins_are_registered():
    assert BUILTIN <= {b.name for b in list_benchmarks()}


def test_benchmark_package_is_light():
    code = (
        "import sys, palaestra.benchmarks as b\n"
        "b.list_benchmarks()\n"
        "print(','.join(m for m in ('torch','transformers','matplotlib','ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_eval_help_is_light():
    code = (
        "import sys\nfrom palaestra.cli import main\n"
        "try:\n    main(['eval', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('MODULES', ','.join(m for m in ('torch','transformers','matplotlib','ray','openai') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--benchmark" in out.stdout and "compare" in out.stdout
    assert out.stdout.strip().endswith("MODULES")


def test_shipped_datasets_load_with_the_standard_sizes():
    sizes = {"gsm8k": 1319, "math500": 500, "humaneval": 164, "mbpp": 500, "nq_open": 3610}
    for name, size in sizes.items():
        assert len(load_tasks(get_benchmark(name))) == size, name
    hotpot, musique = load_tasks(get_benchmark("hotpotqa")), load_tasks(get_benchmark("musique"))
    assert len(hotpot) + len(musique) == 300
    assert all(row["data_source"] == "hotpotqa" for _, row, _ in hotpot)


def test_limit_and_generated_tasks():
    tasks = load_tasks(get_benchmark("gsm8k"), limit=5)
    assert len(tasks) == 5 and len({t[0] for t in tasks}) == 5
    assert tasks == load_tasks(get_benchmark("gsm8k"), limit=5)  # stable ids
    calc = load_tasks(get_benchmark("calculator"), limit=3)
    assert calc == [("seed-0", None, 0), ("seed-1", None, 1), ("seed-2", None, 2)]


def test_unknown_benchmark_suggests_close_names():
    with pytest.raises(ConfigError, match="gsm8k"):
        get_benchmark("gsm8")


def test_user_benchmark_in_a_few_lines(tmp_path):
    rows = [{"id": f"q{i}", "question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(4)]
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = register_benchmark(
        Benchmark(
            name="doubles",
            env_id="palaestra/GSM8K-v0",
            dataset=str(data),
            prompt_template="{prompt}\nAnswer with \\boxed{{N}}. (task {id})",
            system_prompt="You add numbers.",
        )
    )
    try:
        assert get_benchmark("doubles") is bench
        tasks = load_tasks(bench)
        assert [t[0] for t in tasks] == ["q0", "q1", "q2", "q3"]
        register_benchmark(bench)  # the same definition again is fine
        with pytest.raises(ConfigError, match="already registered"):
            register_benchmark(Benchmark(name="doubles", env_id="palaestra/MATH-v0"))
        from palaestra.benchmarks.envpool import EnvPool

        env = EnvPool(bench, {}).make()
        obs, _ = env.reset(options={"task": tasks[1][1]})
        assert [m.role for m in obs] == ["system", "user"]
        assert obs[0].content == "You add numbers."
        assert obs[1].content == "What is 1 + 1?\nAnswer with \\boxed{N}. (task q1)"
        _, reward, terminated, _, info = env.step("\\boxed{2}")
        assert reward == 1.0 and terminated and info["correct"]
    finally:
        unregister_benchmark("doubles")


def test_prompt_template_with_a_missing_field_says_which():
    from palaestra.benchmarks.prompts import render_prompt

    with pytest.raises(ConfigError, match="nope"):
        render_prompt("{prompt} {nope}", {"question": "q"}, "q")


def test_bad_definitions_and_missing_requirements():
    with pytest.raises(ConfigError):
        Benchmark(name="has space", env_id="palaestra/GSM8K-v0")
    with pytest.raises(ConfigError):
        Benchmark(name="x", env_id="palaestra/GSM8K-v0", answer="telepathy")
    nq = get_benchmark("nq_open")
    assert "retriever" in (check_requirements(nq, {}) or "")
    assert check_requirements(nq, {"retriever": "http://127.0.0.1:1/retrieve"}) is None
    missing = Benchmark(name="ghost", env_id="palaestra/Ghost-v0")
    assert "no environment registered as 'palaestra/Ghost-v0'" in (env_available(missing) or "")
    # the registry's spellings resolve as in make(): an importable module's id, and its failure
    assert env_available(Benchmark(name="calc", env_id="palaestra/Calculator-v0")) is None
    assert "cannot import" in (env_available(
        Benchmark(name="gone", env_id="no_such_module_xyz:Some-v0")) or "")


def test_duplicate_task_ids_are_refused(tmp_path):
    data = tmp_path / "dup.jsonl"
    data.write_text('{"id": 1, "question": "a", "answer": "1"}\n{"id": 1, "question": "b", "answer": "2"}\n')
    bench = Benchmark(name="dup", env_id="palaestra/GSM8K-v0", dataset=str(data))
    with pytest.raises(ConfigError, match="occurs twice"):
        load_tasks(bench)


def test_missing_dataset_file_is_a_clear_error():
    bench = Benchmark(name="nofile", env_id="palaestra/GSM8K-v0", dataset="/nonexistent/x.jsonl")
    with pytest.raises(ConfigError, match="--dataset"):
        load_tasks(bench)
