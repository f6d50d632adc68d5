"""User errors in a training config are refused at load time: through the real CLI (exit 2, one
message naming each field and its fix, no traceback, no run directory), in `--dry-run` too."""

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

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.toml"
PALAESTRA = Path(sys.executable).with_name("palaestra")


def _train(tmp_path: Path, *args: str, dry_run: bool = True) -> subprocess.CompletedProcess:
    out = tmp_path / "run"
    cmd = [str(PALAESTRA), "train", str(QUICKSTART), "--out", str(out), *args]
    if dry_run:
        cmd.append("--dry-run")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def _refused(tmp_path: Path, *args: str, dry_run: bool = True) -> str:
    """Run the CLI, assert it refused the config cleanly, return the message."""
    proc = _train(tmp_path, *args, dry_run=dry_run)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("palaestra train: ") and "problem(s) in" in proc.stderr
    assert not (tmp_path / "run").exists(), "a refused config must not create the run directory"
    return proc.stderr


def _rows(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {"question": "What is 2+3?", "answer": "5"}


@pytest.mark.parametrize(("args", "expected"), [
    (["--rollout.batch_size", "0"], "rollout.batch_size = 0: must be >= 1"),
    (["--rollout.batch_size", "-1"], "rollout.batch_size = -1: must be >= 1"),
    (["--rollout.group_size", "0"], "rollout.group_size = 0: must be >= 1"),
    (["--rollout.max_new_tokens", "0"], "rollout.max_new_tokens = 0: must be >= 1"),
    (["--trainer.steps", "-3"], "trainer.steps = -3: must be >= 0"),
    (["--trainer.torch.lr", "0"], "trainer.torch.lr = 0: must be > 0.0"),
    (["--checkpoint.interval", "0"], "checkpoint.interval = 0: must be >= 1"),
    (["--checkpoint.keep_last", "0"], "checkpoint.keep_last = 0: must be >= 1"),
    (["--eval.num_tasks", "-1"], "eval.num_tasks = -1: must be >= 0"),
    (["--rollout.temperature", "0"], "rollout.temperature = 0: must be > 0.0"),
    (["--rollout.batchsize", "4"], "unknown field; did you mean rollout.batch_size?"),
])
def test_out_of_range_values_are_refused(tmp_path, args, expected):
    assert expected in _refused(tmp_path, *args)


def test_every_problem_in_one_message(tmp_path):
    text = _refused(tmp_path, "--rollout.batch_size", "0", "--checkpoint.interval", "0",
                    "--env.id", "palaestra/Calculater-v0", "--trainer.torch.critic", "true")
    assert "4 problem(s)" in text
    for field in ("rollout.batch_size", "checkpoint.interval", "env.id", "trainer.torch.critic"):
        assert field in text


def test_a_real_run_is_refused_before_the_run_directory(tmp_path):
    text = _refused(tmp_path, "--rollout.batch_size", "0", dry_run=False)
    assert "rollout.batch_size = 0" in text


def test_a_missing_model_is_refused_by_a_real_run_and_flagged_by_the_dry_run(tmp_path):
    cfg = tmp_path / "no_init.toml"
    cfg.write_text(QUICKSTART.read_text().replace('init_size = "tiny"\n', ""))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [str(PALAESTRA), "train", str(cfg), "--out", str(tmp_path / "run"),
           "--model.path", str(tmp_path / "no-model")]
    real = subprocess.run([*run, "--rollout.batch_size", "0"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert real.returncode == 2 and "2 problem(s)" in real.stderr  # with the others, at once
    assert "no Hugging Face checkpoint there" in real.stderr
    assert "--model.init_size tiny" in real.stderr
    assert "Traceback" not in real.stderr and not (tmp_path / "run").exists()
    # a dry run plans for another machine (a GPU host that has the model): it warns
    dry = subprocess.run([*run, "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert dry.returncode == 0 and "warning: model.path" in dry.stdout


def test_unknown_env_id_names_the_close_match(tmp_path):
    text = _refused(tmp_path, "--env.id", "palaestra/Calculater-v0")
    assert "env.id = 'palaestra/Calculater-v0'" in text
    assert "Did you mean palaestra/Calculator-v0?" in text


def test_resolving_an_env_id_imports_no_torch():
    code = ("import sys\nfrom palaestra.rollout.task_checks import env_class\n"
            "assert env_class('palaestra/Calculator-v0').__name__ == 'CalculatorEnv'\n"
            "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_env_kwargs_the_constructor_does_not_take(tmp_path):
    text = _refused(tmp_path, "--env.kwargs.min_vlaue", "3")
    assert "env.kwargs: CalculatorEnv" in text and "'min_vlaue' (did you mean 'min_value'?)" in text


def test_missing_and_empty_data_paths(tmp_path):
    assert "data.path is empty" in _refused(tmp_path, "--data.path", '""')
    text = _refused(tmp_path, "--data.path", str(tmp_path / "nope.jsonl"))
    assert "nope.jsonl' does not exist" in text
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "empty.jsonl' is empty" in _refused(tmp_path, "--data.path", str(empty))
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    assert "has no rows" in _refused(tmp_path, "--data.path", str(blank))


def test_every_bad_row_is_named(tmp_path):
    rows: list[object] = [GOOD] * 40
    rows[2] = "{not json"
    rows[6] = [1, 2]
    rows[10] = {"question": "no answer here"}
    rows[11] = {"env_id": "palaestra/Calculater-v0", **GOOD}
    for i in range(20, 30):
        rows[i] = {"answer": "7"}
    text = _refused(tmp_path, "--data.path", str(_rows(tmp_path / "bad.jsonl", rows)),
                    "--eval.num_tasks", "5")
    assert "14 of 40 rows are unusable" in text
    assert "line 3: not valid JSON" in text
    assert "line 7: is an array, not a JSON object" in text
    assert "line 11: missing 'answer' (palaestra/Calculator-v0 needs 'question', 'answer')" in text
    assert "line 12: names env 'palaestra/Calculater-v0'" in text
    assert "line 21: missing 'question'" in text
    assert "... and 9 more" in text  # the first five are named, with a count of the rest


def test_large_files_are_checked_by_their_first_rows(tmp_path):
    from palaestra.rollout.task_checks import SCAN_ALL_ROWS, scan_rows, task_row_check

    rows = [GOOD] * (SCAN_ALL_ROWS + 50) + [{"question": "late"}]
    scan = scan_rows(_rows(tmp_path / "big.jsonl", rows), task_row_check("palaestra/Calculator-v0"))
    assert scan.num_rows == SCAN_ALL_ROWS + 51 and scan.checked == SCAN_ALL_ROWS
    assert scan.problems == ()
    early = [{"question": "early"}] + rows
    scan = scan_rows(_rows(tmp_path / "big2.jsonl", early), task_row_check("palaestra/Calculator-v0"))
    assert scan.problems and scan.problems[0].startswith("line 1: missing 'answer'")
    assert f"the first {SCAN_ALL_ROWS} of {SCAN_ALL_ROWS + 52} rows were checked" in scan.describe()


def test_held_out_rows_need_room_to_train(tmp_path):
    data = _rows(tmp_path / "few.jsonl", [GOOD] * 30)
    text = _refused(tmp_path, "--data.path", str(data))  # quickstart holds out 100
    assert "has 30 rows, too few to hold out eval.num_tasks = 100" in text
    assert "lower --eval.num_tasks" in text


def test_dry_run_says_where_held_out_rows_come_from(tmp_path):
    data = _rows(tmp_path / "rows.jsonl", [GOOD] * 30)
    proc = _train(tmp_path, "--data.path", str(data), "--eval.num_tasks", "10")
    assert proc.returncode == 0, proc.stderr
    assert (f"tasks: {data} has 30 rows: the first 20 train, the last 10 are held out "
            "(eval.num_tasks) and never trained on") in proc.stdout
    proc = _train(tmp_path)
    assert "held out: 100 drawn from the env with eval.seed 10000" in proc.stdout
    assert not (tmp_path / "run").exists()


def test_help_config_says_where_held_out_rows_come_from():
    out = subprocess.run([str(PALAESTRA), "train", "--help-config"], capture_output=True,
                         text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("--eval.num_tasks"))
    assert "last ``num_tasks`` rows, split off (never trained on" in line


def test_held_out_rows_are_never_trained_on(tmp_path):
    from palaestra.run.held_out import eval_rows_from_file as _eval_rows_from_file, train_rows as _train_rows

    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(12)]
    data = _rows(tmp_path / "rows.jsonl", rows)
    cfg = load_config(TrainConfig, QUICKSTART, ["--data.path", str(data), "--eval.num_tasks", "5"])
    train, held_out = _train_rows(cfg), _eval_rows_from_file(cfg)
    assert held_out == rows[7:] and train == rows[:7]  # before: all 12 trained when <= 2 x 5


def test_group_size_one_with_a_group_baseline(tmp_path):
    text = _refused(tmp_path, "--rollout.group_size", "1")
    assert "rollout.group_size = 1 with 'grpo' advantages" in text
    assert "advantage 0" in text and "--rollout.group_size 2 or more" in text
    proc = _train(tmp_path, "--rollout.group_size", "1", "--trainer.loss.preset", "reinforce_pp")
    assert proc.returncode == 0, proc.stderr  # a batch baseline works with groups of one


def test_ppo_trains_a_critic_and_its_settings_are_checked(tmp_path):
    proc = _train(tmp_path, "--trainer.loss.preset", "ppo")
    assert proc.returncode == 0, proc.stderr
    assert "critic: value model from the RL phase's initial policy" in proc.stdout
    text = _refused(tmp_path, "--trainer.loss.preset", "ppo", "--critic.torch",
                    '{"lr_schedule": "sideways"}')
    assert "critic.torch" in text and "lr_schedule" in text
    text = _refused(tmp_path, "--trainer.mini_batch_size", "16")
    assert "trainer.mini_batch_size splits PPO's epochs" in text
    text = _refused(tmp_path, "--trainer.loss.preset", "ppo", "--trainer.loss.value_clip", "0.1")
    assert "critic.value_clip" in text


def test_kl_needs_a_reference_model(tmp_path):
    text = _refused(tmp_path, "--trainer.loss.kl_coef", "0.01")
    assert "trainer.loss.kl_coef = 0.01 needs a reference model" in text
    assert "--trainer.torch.ref_model true" in text
    proc = _train(tmp_path, "--trainer.loss.kl_coef", "0.01", "--trainer.torch.ref_model", "true")
    assert proc.returncode == 0, proc.stderr
    text = _refused(tmp_path, "--trainer.loss.kl_coef", "0.01", "--trainer.loss.kl_mode",
                    "reward")
    assert "kl_coef = 0.01 (in the reward) needs a reference model" in text
    proc = _train(tmp_path, "--trainer.loss.kl_coef", "0.01", "--trainer.loss.kl_mode",
                  "reward", "--trainer.torch.ref_model", "true")
    assert proc.returncode == 0, proc.stderr  # reference logprobs come before the advantages


def test_offline_objectives_and_critics_in_an_rl_run(tmp_path):
    assert "trains offline" in _refused(tmp_path, "--trainer.loss.preset", "sft")
    for preset in ("grpo", "ppo"):  # PPO's critic is [critic], never the policy backend
        text = _refused(tmp_path, "--trainer.torch.critic", "true", "--trainer.loss.preset",
                        preset)
        assert "would turn the policy into a value model" in text


def test_data_that_runs_out_before_the_last_step(tmp_path):
    text = _refused(tmp_path, "--data.num_tasks", "64", "--data.epochs", "1")
    assert "gives 64 prompts, but trainer.steps x rollout.batch_size = 480" in text


def test_warmup_demonstrations_are_checked(tmp_path):
    text = _refused(tmp_path, "--warmup.demonstrations", "palaestra.envs.calculator:nope")
    assert "has no function 'nope'" in text
    demos = _rows(tmp_path / "demos.jsonl", [{"messages": []}, {"text": "x"}])
    text = _refused(tmp_path, "--warmup.demonstrations", str(demos))
    assert "line 2: missing 'messages'" in text


SHIPPED_TASKS = {
    "palaestra/GSM8K-v0": ["math/gsm8k_test.jsonl.gz", "math/gsm8k_train.jsonl.gz"],
    "palaestra/MATH-v0": ["math/math500_test.jsonl.gz"],
    "palaestra/SearchR1-v0": ["search/multihop.jsonl.gz", "search/nq_open_dev.jsonl.gz"],
    "palaestra/SearchR1Tools-v0": ["search/multihop.jsonl.gz"],
    "palaestra/Code-v0": ["code/humaneval.jsonl.gz", "code/mbpp.jsonl.gz"],
}


@pytest.mark.parametrize("env_id", sorted(SHIPPED_TASKS) + ["palaestra/Calculator-v0"])
def test_shipped_rows_satisfy_their_envs_task_fields(env_id):
    """Each env's declared task fields match the rows it ships (the declaration is honest),
    and a row without them is refused."""
    import numpy as np

    from palaestra.envs.calculator import make_task
    from palaestra.envs.shipped import iter_jsonl, shipped_path
    from palaestra.rollout.task_checks import env_class

    cls = env_class(env_id)
    if env_id in SHIPPED_TASKS:
        rows = [r for f in SHIPPED_TASKS[env_id] for _, r in zip(range(50), iter_jsonl(shipped_path(f)))]
    else:
        rng = np.random.default_rng(0)
        rows = [make_task(rng, 10, 99, 1, ("+", "-", "*")) for _ in range(20)]
    assert rows and [cls.task_problems(r) for r in rows] == [[]] * len(rows)
    assert cls.task_problems({"unrelated": 1}) != []


def test_in_process_loading_raises_one_config_error():
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, QUICKSTART, ["--rollout.batch_size", "0", "--rollout.group_size",
                                              "1"])
    text = str(info.value)
    # group_size = 1 is reported beside batch_size, though pydantic rejected batch_size first
    assert "2 problem(s)" in text and "rollout.group_size = 1 with 'grpo'" in text


def test_parquet_and_json_rows_are_checked(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from palaestra.rollout.task_checks import scan_rows, task_row_check

    check = task_row_check("palaestra/Calculator-v0")
    table = pa.Table.from_pylist([GOOD, {"question": "q", "answer": None}, GOOD])
    pq.write_table(table, tmp_path / "rows.parquet")
    scan = scan_rows(tmp_path / "rows.parquet", check, limit=2)
    assert (scan.num_rows, scan.checked) == (3, 2)
    needs = "(palaestra/Calculator-v0 needs 'question', 'answer')"
    assert scan.problems == (f"row 2: missing 'answer' {needs}",)
    (tmp_path / "rows.json").write_text(json.dumps([GOOD, 3]))
    assert scan_rows(tmp_path / "rows.json", check).problems == (
        "row 2: is a number, not a JSON object",)


def test_load_rows_names_every_line_that_does_not_parse(tmp_path):
    from palaestra.rollout.data import load_rows

    path = _rows(tmp_path / "rows.jsonl", [GOOD, "{", GOOD, "nope", GOOD])
    with pytest.raises(ConfigError) as info:
        load_rows(path)
    text = str(info.value)
    assert "2 of 5 rows are unusable" in text and f"{path}:2: not valid JSON" in text
    assert f"{path}:4: not valid JSON" in text


def test_env_drawn_training_tasks_never_repeat_a_held_out_one(tmp_path):
    """An env with a finite dataset repeats tasks: held-out draws are dropped from training."""
    from palaestra.run.tasks import tasks_from_env
    from palaestra.run.held_out import train_rows as _train_rows

    path = tmp_path / "gsm8k.toml"
    path.write_text('[env]\nid = "palaestra/GSM8K-v0"\n[data]\nnum_tasks = 300\n'
                    '[eval]\nnum_tasks = 100\n')
    cfg = load_config(TrainConfig, path)
    held_out = tasks_from_env(cfg.env.id, 100, seed=cfg.eval.seed)
    drawn = tasks_from_env(cfg.env.id, 300, seed=cfg.data.seed)
    questions = {r["question"] for r in held_out}
    repeats = [r for r in drawn if r["question"] in questions]
    assert repeats, "the check needs draws that repeat a held-out task"
    train = _train_rows(cfg)
    assert len(train) == len(drawn) - len(repeats)
    assert not questions & {r["question"] for r in train}


def test_help_config_and_dry_run_import_nothing_heavy(tmp_path):
    data = _rows(tmp_path / "rows.jsonl", [GOOD] * 30)
    code = ("import contextlib, io, sys\nfrom palaestra.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['train', '--help-config'])\n"
            "    assert 'gymnasium' not in sys.modules\n"
            f"    main(['train', {str(QUICKSTART)!r}, '--dry-run', '--data.path', {str(data)!r},\n"
            "          '--eval.num_tasks', '5'])\n"
            "print(sorted(m for m in ('torch', 'ray', 'transformers', 'sglang') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def keep_even_answers(rows, *, env_kwargs):
    """A ``data.train_filter`` for the test below."""
    assert isinstance(env_kwargs, dict)
    return [r for r in rows if int(r["answer"]) % 2 == 0]


def keep_nothing(rows, *, env_kwargs):
    return []


def test_a_train_filter_is_checked_and_sees_only_training_rows(tmp_path):
    from palaestra.run.held_out import train_rows

    text = _refused(tmp_path, "--data.train_filter", "palaestra.envs.calculator:nope")
    assert "data.train_filter = 'palaestra.envs.calculator:nope'" in text
    assert "has no function 'nope'" in text
    assert "write it as module:function" in _refused(tmp_path, "--data.train_filter", "nocolon")
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(12)]
    data = _rows(tmp_path / "rows.jsonl", rows)
    cfg = load_config(TrainConfig, QUICKSTART, [
        "--data.path", str(data), "--eval.num_tasks", "5",
        "--data.train_filter", f"{__name__}:keep_even_answers"])
    assert train_rows(cfg) == [rows[i] for i in (0, 2, 4, 6)]  # rows 7-11 are held out
    cfg = load_config(TrainConfig, QUICKSTART, [
        "--data.path", str(data), "--eval.num_tasks", "5",
        "--data.train_filter", f"{__name__}:keep_nothing"])
    with pytest.raises(ConfigError, match="kept none of the 7 training rows"):
        train_rows(cfg)


def test_a_decaying_rl_learning_rate_needs_no_total_steps():
    """``trainer.torch.lr_schedule = "cosine"`` alone is a valid config: the RL phase decays
    over ``trainer.steps`` (an override of it included), not over a number written twice."""
    from palaestra.run.builders import backend_config

    cfg = load_config(TrainConfig, QUICKSTART, [
        "--trainer.torch.lr_schedule", "cosine", "--trainer.megatron.lr_schedule", "linear",
        "--trainer.steps", "7"])
    built = backend_config(cfg.trainer.torch, temperature=1.0, seed=0, steps=cfg.trainer.steps)
    assert (cfg.trainer.torch.total_steps, built.total_steps) == (7, 7)
    assert cfg.trainer.megatron.total_steps == 7
    constant = load_config(TrainConfig, QUICKSTART, ["--trainer.steps", "7"])
    assert constant.trainer.torch.total_steps is None


def test_a_bad_step_count_beside_a_decaying_rate_names_the_step_count(tmp_path):
    """The schedule's placeholder never hides the field's own message behind a parse error."""
    message = _refused(tmp_path, "--trainer.steps", "abc", "--trainer.torch.lr_schedule", "cosine")
    assert 'trainer.steps = "abc"' in message and "int()" not in message
