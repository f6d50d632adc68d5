"""Reward sources beside the env's reward: a classifier reward model (scores equal a direct
forward of the checkpoint), an LLM judge over a real loopback HTTP server (prompt, parsing, a
server that dies), weights and per-part metrics, and the reward worker inside real rollouts
(in process and as a Ray actor)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rollout_helpers import calc_rows, worker_config

from palaestra.rollout.config import RolloutConfig
from palaestra.rollout.data import DataSource
from palaestra.rollout.manager import RolloutManager
from palaestra.rollout.rewards import (
    RewardClient,
    RewardError,
    RewardSourceConfig,
    RewardWorker,
    RewardWorkerSection,
    ScoreRequest,
    part_metrics,
)
from palaestra.rollout.rewards.judge import fill_template, parse_score
from palaestra.rollout.rewards.render import render_ids
from palaestra.types import Message, Sample, StopReason, ToolCall, Trajectory, Turn

pytestmark = pytest.mark.timeout(300)
HERE = Path(__file__).parent
RUBRIC = "Is the final answer right?\n{conversation}\nReply 'Score: N' with N from 0 to 10."


# ----------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def rm_dir(model_dir, tmp_path_factory) -> str:
    """The micro model as a one-label sequence classifier (a fresh score head), saved."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model.config.pad_token_id = tok.pad_token_id
    out = tmp_path_factory.mktemp("rm")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def direct_score(rm_dir: str, messages) -> float:
    """One unpadded forward of the checkpoint on the chat-template rendering."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    ids = tok(tok.apply_chat_template([dict(m) for m in messages], tokenize=False),
              add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def trajectory(answer: str, turn_rewards=(0.0, 1.0), question: str = "What is 6 * 7?") -> Trajectory:
    call = ToolCall("calculator", '{"expression": "6 * 7"}', "c1")
    messages = (
        Message("system", "Use the calculator."), Message("user", question),
        Message("assistant", "", tool_calls=(call,)),
        Message("tool", "42", tool_call_id="c1", name="calculator"),
        Message("assistant", f"<answer>{answer}</answer>"),
    )
    turns = tuple(Turn(messages[2 + 2 * k], (), r) for k, r in enumerate(turn_rewards))
    sample = Sample((1, 2, 3, 4), (0, 1, 1, 1), (0.0, -0.1, -0.2, -0.3), (-1, 0, 0, 0), 1,
                    reward=sum(turn_rewards), turn_rewards=tuple(turn_rewards))
    return Trajectory("palaestra/Calculator-v0", "t0", messages, turns, (sample,),
                      float(sum(turn_rewards)), StopReason.TERMINATED, metrics={"turns": 2.0})


def classifier(rm_dir: str, **kw) -> RewardSourceConfig:
    return RewardSourceConfig(kind="classifier", name="rm", path=rm_dir, **kw)


@pytest.fixture()
def judge_server(tmp_path):
    """The stand-in judge in its own process; yields (url, process, prompt log)."""
    log = tmp_path / "prompts.jsonl"
    proc = subprocess.Popen([sys.executable, str(HERE / "reward_judge_server.py"), str(log)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("PORT "), line
    yield f"http://127.0.0.1:{int(line.split()[1])}/v1", proc, log
    proc.kill()
    proc.wait()


def judge(url: str, **kw) -> RewardSourceConfig:
    return RewardSourceConfig(kind="judge", engine="openai", url=url, model="judge",
                              template=RUBRIC, **kw)


FAST = RewardWorkerSection(retries=1, retry_backoff_s=0.05, timeout_s=10.0, linger_s=0.0)


# ----------------------------------------------------------------------------------- classifier
async def test_classifier_scores_equal_a_direct_forward(rm_dir):
    from palaestra.rollout.rewards.sources import ClassifierSource

    source = ClassifierSource(classifier(rm_dir, batch_size=2))  # padded batches of 2
    convs = [[m.to_dict() for m in trajectory(a).messages[: n]]
             for a, n in (("42", 5), ("41", 2), ("1234567", 5))]
    got = await source.score(convs)
    want = [direct_score(rm_dir, c) for c in convs]
    assert got == pytest.approx(want, abs=1e-5)
    assert len({round(g, 6) for g in got}) == 3  # the conversations differ, so do the scores


async def test_classifier_too_long_fails_that_conversation_only(rm_dir):
    from palaestra.agents import load_tokenizer
    from palaestra.rollout.rewards.sources import ClassifierSource

    short = [m.to_dict() for m in trajectory("42").messages[:2]]
    long = [m.to_dict() for m in trajectory("42").messages]
    limit = len(render_ids(load_tokenizer(rm_dir), short))
    got = await ClassifierSource(classifier(rm_dir, max_length=limit)).score([short, long])
    assert got[0] == pytest.approx(direct_score(rm_dir, short), abs=1e-5)
    assert isinstance(got[1], RewardError) and "max_length" in str(got[1])


async def test_weights_per_turn_parts_and_metrics(rm_dir):
    worker = RewardWorker([classifier(rm_dir, per="turn", weight=2.0),
                           RewardSourceConfig(kind="env", weight=0.5)], FAST)
    client = RewardClient(worker.configs, FAST)
    client._local = worker
    trajs = [trajectory("42", (0.0, 1.0)), trajectory("41", (0.0, 0.0))]
    scored = [await client.score_trajectory(t) for t in trajs]
    for t, s in zip(trajs, scored):
        msgs = [m.to_dict() for m in t.messages]
        turn1, turn2 = direct_score(rm_dir, msgs[:3]), direct_score(rm_dir, msgs)
        env = t.reward
        sample = s.samples[0]
        assert sample.turn_rewards == pytest.approx((2 * turn1, 2 * turn2 + 0.5 * env), abs=1e-5)
        assert s.reward == sample.reward == pytest.approx(sum(sample.turn_rewards), abs=1e-6)
        assert sample.metrics["reward/rm"] == pytest.approx(turn1 + turn2, abs=1e-5)
        assert s.metrics["reward/env"] == env and s.metrics["turns"] == 2.0
        assert s.turn_rewards == t.turn_rewards  # the env's own record is kept
    means = part_metrics(scored)
    assert means["reward/env"] == pytest.approx(0.5)
    assert means["reward/rm"] == pytest.approx(
        (scored[0].metrics["reward/rm"] + scored[1].metrics["reward/rm"]) / 2)


# ----------------------------------------------------------------------------------- judge
def test_parse_score_takes_the_last_valid_match():
    pattern = RewardSourceConfig(kind="env").score_pattern
    assert parse_score("Score: 2 ... on reflection, score = 7.5", pattern, 0, 10) == 7.5
    with pytest.raises(RewardError, match="outside"):
        parse_score("Score: 11", pattern, 0, 10)
    with pytest.raises(RewardError, match="no score"):
        parse_score("looks fine to me", pattern, 0, 10)
    with pytest.raises(RewardError, match="not a number"):
        parse_score("Score: x", r"Score: (\S+)", 0, 10)


def test_fill_template_keeps_other_braces():
    msgs = [m.to_dict() for m in trajectory("42").messages]
    text = fill_template('JSON {"a": 1}\n{prompt} | {response}\n{conversation}', msgs)
    assert text.startswith('JSON {"a": 1}\nWhat is 6 * 7? | <answer>42</answer>\n')
    assert 'ASSISTANT: [call calculator {"expression": "6 * 7"}]' in text
    assert "SYSTEM" not in text and "TOOL: 42" in text


def test_judge_config_is_checked_at_load_time():
    with pytest.raises(ValueError, match="needs template"):
        RewardSourceConfig(kind="judge", url="http://x/v1")
    with pytest.raises(ValueError, match="needs url"):
        RewardSourceConfig(kind="judge", template=RUBRIC)
    with pytest.raises(ValueError, match="needs path"):
        RewardSourceConfig(kind="classifier")
    with pytest.raises(ValueError, match="plain word"):
        RewardSourceConfig(kind="env", name="mean")


async def test_judge_over_http_scores_and_refuses_bad_replies(judge_server):
    url, _, log = judge_server
    client = RewardClient([judge(url, weight=0.1)], FAST)
    # one batch: a bad reply fails its own episode, not the other two
    right, wrong_range, unparsable = await asyncio.gather(
        *(client.score_trajectory(trajectory(a)) for a in ("42", "7", "x")))
    assert not right.failed and right.reward == pytest.approx(0.9)
    assert right.samples[0].metrics["reward/judge"] == 9.0
    assert wrong_range.failed and "outside [0.0, 10.0]" in wrong_range.error
    assert "'Score: 42'" in wrong_range.error and wrong_range.error.startswith("reward: judge:")
    assert unparsable.failed and "no score" in unparsable.error and "I cannot say" in unparsable.error
    prompts = log.read_text()
    assert "Is the final answer right?" in prompts and "USER: What is 6 * 7?" in prompts
    assert prompts.count("<answer>x</answer>") == 2  # retried once (FAST.retries = 1)
    await client.close()


async def test_a_judge_engine_that_dies_fails_the_episode_with_the_reason(judge_server):
    url, proc, _ = judge_server
    # a request timeout far above the bound below: the refused connection fails the score at
    # once, and a loaded machine's slowness is not mistaken for a timeout (10 s against 8 s was)
    client = RewardClient([judge(url)], FAST.model_copy(update={"timeout_s": 120.0}))
    assert (await client.score_trajectory(trajectory("1"))).reward == 3.0
    proc.kill()
    proc.wait()
    t = time.perf_counter()
    dead = await client.score_trajectory(trajectory("1"))
    assert time.perf_counter() - t < 60.0  # failed by the refusal, not by the timeout
    assert dead.failed and dead.stop_reason is StopReason.ERROR
    assert dead.error.startswith("reward: judge:") and "(after 2 attempts)" in dead.error
    assert "Connection" in dead.error or "connect" in dead.error.lower()
    await client.close()


# ----------------------------------------------------------------------------------- in rollouts
def _manager(tokenizer_dir, rewards, rows, pool=None, **cfg) -> RolloutManager:
    cfg.setdefault("num_workers", 2)
    kw = {"pool": pool} if pool is not None else {"cluster": "local"}
    return RolloutManager(DataSource(rows, seed=0, epochs=None),
                          worker_config(tokenizer_dir, rewards=rewards),
                          RolloutConfig(**cfg), **kw)


def _check_classifier_batch(batch, rm_dir):
    assert batch.samples and not batch.failed
    for t in batch.trajectories:
        want = direct_score(rm_dir, [m.to_dict() for m in t.messages])
        assert t.reward == pytest.approx(want, abs=1e-5)
        assert t.samples[0].reward == t.reward
        env = t.metrics["reward/env"]
        assert env in (0.0, 1.0)  # the env's own reward, weight 0
    rm = [t.metrics["reward/rm"] for t in batch.trajectories]
    assert batch.metrics["reward/rm"] == pytest.approx(sum(rm) / len(rm))
    assert 0.0 < batch.metrics["reward/env"] < 1.0  # p_correct = 0.5: both outcomes appear


async def test_rollout_scores_episodes_with_the_reward_model(tokenizer_dir, rm_dir):
    rewards = RewardClient([classifier(rm_dir), RewardSourceConfig(kind="env", weight=0.0)],
                           RewardWorkerSection(max_batch=8))
    async with _manager(tokenizer_dir, rewards, calc_rows(20), batch_size=4, group_size=4) as m:
        batch = await m.generate_batch(0)
    _check_classifier_batch(batch, rm_dir)
    stats = await rewards.worker.ping()
    assert stats["episodes"] == 16 and stats["batches"] < 16  # batched across episodes
    await rewards.close()


async def test_a_failed_score_fails_only_that_episode(tokenizer_dir, judge_server):
    url, _, _ = judge_server
    # the stand-in judge answers "Score: 3" except for a reply without a score to "x" answers;
    # make the question of task t0 read as one: its episodes fail, the others are kept
    rewards = RewardClient([judge(url)], FAST)
    rows = calc_rows(6)
    rows[0] = {**rows[0], "question": "What is 0 + 1? <answer>x</answer>"}
    async with _manager(tokenizer_dir, rewards, rows, batch_size=6, group_size=2,
                        max_failure_rate=0.5, max_draw_factor=2.0) as m:
        batch = await m.generate_batch(0)
    assert len(batch.failed) == 2 and {t.task_id for t in batch.failed} == {"t0"}
    assert all(t.error.startswith("reward: judge: judge reply has no score") for t in batch.failed)
    assert all(t.reward == 3.0 for t in batch.trajectories)
    assert batch.metrics["reward/judge"] == 3.0
    await rewards.close()


async def test_reward_actor_serves_ray_workers(ray_pool, tokenizer_dir, rm_dir):
    rewards = RewardClient([classifier(rm_dir), RewardSourceConfig(kind="env", weight=0.0)],
                           RewardWorkerSection(num_cpus=0.5), placement="actor")
    async with _manager(tokenizer_dir, rewards, calc_rows(20), pool=ray_pool, batch_size=4,
                        group_size=4) as m:
        batch = await m.generate_batch(0)
        stats = await rewards.actor().ping.remote()
    _check_classifier_batch(batch, rm_dir)
    assert stats["episodes"] >= 16  # one actor scored the episodes of both Ray workers
    await rewards.close()


def test_score_request_is_light(rm_dir):
    req = ScoreRequest.from_trajectory(trajectory("42"))
    assert req.turns == 2 and req.env_turn_rewards == (0.0, 1.0)
    assert req.messages[2]["tool_calls"][0]["function"]["name"] == "calculator"


async def test_judge_on_the_embedded_engine_quotes_an_unparsable_reply(model_dir):
    """engine = "local": the rubric rendered by the judge's chat template, generated by a real
    LocalEngine (the micro model writes no score, so the episode fails with its reply)."""
    client = RewardClient([RewardSourceConfig(
        kind="judge", engine="local", path=model_dir, template=RUBRIC, max_new_tokens=8)],
        RewardWorkerSection(retries=0, linger_s=0.0))
    failed = await client.score_trajectory(trajectory("42"))
    assert failed.failed and failed.error.startswith("reward: judge: judge reply has no score")
    assert "(after 1 attempt)" in failed.error
    await client.close()


async def test_judge_over_palaestra_serve_native_api(model_dir):
    """engine = "palaestra": the rubric rendered with the judge tokenizer's chat template, sent
    as token ids to `palaestra serve`'s /generate (a real LocalEngine behind the real server),
    the reply decoded and parsed: greedy, so it is exactly what the engine itself generates for
    that prompt (the micro model writes no score, so the failure quotes that reply)."""
    from palaestra.agents import load_tokenizer
    from palaestra.engines.local.local import LocalEngine
    from palaestra.engine import SamplingParams
    from palaestra.engines.serve.serve import start_server

    engine = LocalEngine(model_dir, device="cpu", max_running=4)
    server = await start_server(engine, port=0)
    cfg = RewardSourceConfig(kind="judge", engine="palaestra", url=server.url,
                             tokenizer=model_dir, template=RUBRIC, max_new_tokens=8)
    client = RewardClient([cfg], RewardWorkerSection(retries=0, linger_s=0.0))
    try:
        scored = await client.score_trajectory(trajectory("42"))
        tok = load_tokenizer(model_dir)
        prompt = [{"role": "user", "content": fill_template(RUBRIC, [
            m.to_dict() for m in trajectory("42").messages])}]
        ids = tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        gen = await engine.generate(list(ids), SamplingParams(max_new_tokens=8, temperature=0.0))
        reply = tok.decode(list(gen.token_ids), skip_special_tokens=True)
        if scored.failed:
            assert f"{reply[:300]!r}" in scored.error, (reply, scored.error)
        else:
            assert scored.reward == parse_score(reply, cfg.score_pattern, 0, 10)
    finally:
        await client.close()
        await server.close()
        await engine.close()
