"""Eval records: the gold answer is in every record, also when the env never scored the episode."""

from __future__ import annotations

from palaestra.benchmarks.records import make_record, row_gold
from palaestra.benchmarks.registry import get_benchmark
from palaestra.benchmarks.summary import summarize
from palaestra.types import Message, StopReason, Trajectory, Turn


def _cut_off(task_id: str) -> Trajectory:
    """An episode whose only turn hit the token budget mid-search: no env info at all."""
    return Trajectory(env_id="palaestra/SearchR1-v0", task_id=task_id,
                      messages=(Message("assistant", "<search> a very long que"),),
                      turns=(), samples=(), reward=0.0, stop_reason=StopReason.MAX_TOKENS)


def test_a_cut_off_episode_still_shows_its_gold_answer() -> None:
    row = {"question": "Who?", "golden_answers": ["Badly Drawn Boy", "Damon Gough"]}
    record = make_record(get_benchmark("multihop_heldout"), "t0", 0, "m", 0, _cut_off("t0"), 0.1,
                         row=row)
    assert record["gold"] == ["Badly Drawn Boy", "Damon Gough"]
    assert record["correct"] is False and record["env_metrics"] == {}
    assert row_gold({"answer": "72"}) == "72" and row_gold(None) is None and row_gold({}) is None


def test_the_env_gold_and_numbers_win_and_are_summarised() -> None:
    info = {"gold": ["British"], "em": 1.0, "f1": 1.0, "searches": 2, "answer_in_retrieved": 1.0,
            "answer": "British", "invalid_action": False}
    traj = Trajectory(env_id="palaestra/SearchR1-v0", task_id="t1",
                      messages=(Message("assistant", "<answer> British </answer>"),),
                      turns=(Turn(Message("assistant", "<answer> British </answer>"), (), 1.0,
                                  info),),
                      samples=(), reward=1.0,
                      stop_reason=StopReason.TERMINATED)
    bench = get_benchmark("multihop_heldout")
    good = make_record(bench, "t1", 0, "m", 0, traj, 0.1, row={"golden_answers": ["other"]})
    assert good["gold"] == ["British"]
    assert good["env_metrics"] == {"em": 1.0, "f1": 1.0, "searches": 2, "answer_in_retrieved": 1.0}
    cut = make_record(bench, "t0", 0, "m", 0, _cut_off("t0"), 0.1, row={"golden_answers": ["x"]})
    summary = summarize([good, cut], with_maj=False)
    assert summary["env_metrics"] == {"answer_in_retrieved": 1.0, "em": 1.0, "f1": 1.0,
                                      "searches": 2.0}
    assert summary["tool_call_rate"] == 0.0  # tool calls come from the trajectory's metrics
