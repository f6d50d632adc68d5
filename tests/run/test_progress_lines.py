"""Logs a person can read: progress bars in a log file print a line every tenth of the work
or every 30 s, not every redraw; the curves name their panels in the env's words."""

from __future__ import annotations

import io

from palaestra.progress import LineProgress, progress_bar


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_line_per_tenth_of_the_work_not_per_step() -> None:
    out, clock = io.StringIO(), _Clock()
    bar = LineProgress(800, desc="sft", unit="step", stream=out, clock=clock)
    for _ in range(800):
        clock.now += 0.1
        bar.set_postfix(loss="0.500")
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10, lines
    assert lines[0] == "sft: 80/800 steps (10%), 8.0 s, loss=0.500"
    assert lines[-1].startswith("sft: 800/800 steps (100%)")


def test_slow_steps_print_every_interval_and_close_prints_the_last_count() -> None:
    out, clock = io.StringIO(), _Clock()
    bar = LineProgress(1000, desc="rl", unit="step", stream=out, clock=clock, interval_s=30)
    for _ in range(7):  # 7 steps of 20 s: under a tenth, so lines only on the 30 s clock
        clock.now += 20
        bar.update(1)
    assert [line.split(",")[0] for line in out.getvalue().splitlines()] == [
        "rl: 2/1000 steps (0%)", "rl: 4/1000 steps (0%)", "rl: 6/1000 steps (0%)"]
    bar.close()
    assert out.getvalue().splitlines()[-1].startswith("rl: 7/1000 steps (0%), 140.0 s")
    bar.close()  # nothing new to say
    assert len(out.getvalue().splitlines()) == 4


def test_a_resumed_bar_counts_from_where_it_was() -> None:
    out, clock = io.StringIO(), _Clock()
    bar = LineProgress(10, initial=8, desc="rl", unit="step", stream=out, clock=clock)
    bar.update(1)
    bar.write("[rl step 9] 1 of 8 episodes failed")
    bar.update(1)
    assert out.getvalue().splitlines() == [
        "rl: 9/10 steps (90%), 0.0 s", "[rl step 9] 1 of 8 episodes failed",
        "rl: 10/10 steps (100%), 0.0 s"]


def test_a_file_gets_lines_and_a_terminal_gets_tqdm() -> None:
    assert isinstance(progress_bar(5, stream=io.StringIO()), LineProgress)

    class _Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    bar = progress_bar(5, desc="sft", stream=_Terminal())
    assert type(bar).__module__.startswith("tqdm")
    bar.close()


def test_the_tool_call_panel_is_named_for_the_env() -> None:
    from palaestra.run.run_dir import tool_calls_title

    assert tool_calls_title("palaestra/SearchR1-v0") == "searches per episode"
    assert tool_calls_title("palaestra/Calculator-v0") == "tool calls per episode (Calculator-v0)"
    assert "searches" not in tool_calls_title("palaestra/Calculator-v0")
