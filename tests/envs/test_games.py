"""Text games: rendering, move parsing, per-turn rewards, planners that win, `wrap_gymnasium`."""

from collections import deque

import gymnasium
import numpy as np
import pytest

from palaestra.envs import make, wrap_gymnasium
from palaestra.envs.games import TextGameEnv, action_parser
from palaestra.envs.toy_text import BLACKJACK_MOVES, CLIFF_MOVES, FROZEN_LAKE_MOVES, TAXI_MOVES
from palaestra.errors import ConfigError

MOVES = {
    "palaestra/FrozenLake-v0": FROZEN_LAKE_MOVES,
    "palaestra/Taxi-v0": TAXI_MOVES,
    "palaestra/CliffWalking-v0": CLIFF_MOVES,
}


def plan(game: gymnasium.Env) -> list[int]:
    """Shortest move sequence to the best terminal transition, by BFS over the env's table P."""
    table = game.unwrapped.P
    best = max(r for moves in table.values() for outs in moves.values() for _, _, r, d in outs if d)
    start = int(game.unwrapped.s)
    queue, seen = deque([(start, [])]), {start}
    while queue:
        state, path = queue.popleft()
        for move, outcomes in table[state].items():
            (_, nxt, reward, done), = outcomes  # deterministic: one outcome per move
            if done and reward == best:
                return path + [move]
            if not done and int(nxt) not in seen:
                seen.add(int(nxt))
                queue.append((int(nxt), path + [move]))
    raise AssertionError("no winning path")


@pytest.mark.parametrize("env_id", sorted(MOVES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planner_playing_move_names_wins(env_id, seed):
    env = make(env_id)
    obs, _ = env.reset(seed=seed)
    assert obs[0].role == "system" and "<action>" in obs[0].content and obs[1].role == "user"
    moves = plan(env.game)
    assert len(moves) <= env.max_turns
    rewards = []
    for i, move in enumerate(moves):
        obs, reward, terminated, truncated, info = env.step(
            f"Thinking... <action>{MOVES[env_id][move]}</action>"
        )
        rewards.append(reward)
        assert terminated == (i == len(moves) - 1) and not truncated
    assert info["success"] == 1.0 and info["total_reward"] == sum(rewards)
    assert "The game is over." in obs[0].content
    if env_id == "palaestra/FrozenLake-v0":
        assert rewards[-1] == 1.0 and sum(rewards) == 1.0
    elif env_id == "palaestra/Taxi-v0":
        assert rewards[-1] == 20.0 and all(r == -1.0 for r in rewards[:-1])
    else:
        assert rewards == [-1.0] * 13  # up, 11 x right, down


def test_blackjack_winning_line_found_by_forking():
    """A scripted player searches hit/stick with env.fork() and replays the winning line."""
    env = make("palaestra/Blackjack-v0")

    def winning_line(state_env, depth=0):
        for move in BLACKJACK_MOVES:
            branch = state_env.fork()
            _, _, terminated, _, info = branch.step(f"<action>{move}</action>")
            if terminated:
                if info["success"] == 1.0:
                    return [move]
            elif depth < 4:
                rest = winning_line(branch, depth + 1)
                if rest:
                    return [move] + rest
        return None

    for seed in range(20):
        env.reset(seed=seed)
        line = winning_line(env)
        if line:
            break
    assert line, "no winnable hand in 20 seeds"
    for move in line:
        _, reward, terminated, _, info = env.step(f"<action>{move}</action>")
    assert terminated and reward == 1.0 and info["success"] == 1.0


def test_move_parsing_and_invalid_moves():
    parse = action_parser(["left", "down"])
    assert parse("<action>Down</action>") == 1 and parse("<action>left.</action>") == 0
    assert parse("<action>left</action> no wait <action>down</action>") == 1
    assert parse("down") == 1 and parse("<action>1</action>") == 1 and parse("go down") is None
    env = make("palaestra/FrozenLake-v0", max_turns=10)
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step("I will move down")
    assert "Invalid action" in obs[0].content and not terminated and info["invalid_action"]
    assert reward == 0.0  # invalid_reward defaults to 0
    obs, *_ = env.step("<action>7</action>")
    assert "move 7 does not exist" in obs[0].content
    _, _, terminated, _, info = env.step("<action>jump</action>")
    assert terminated and info["stop_reason"] == "parse_error" and info["success"] == 0.0
    env.reset(seed=0)
    env.step("<action>jump</action>")
    env.step("<action>right</action>")  # a valid move resets the count of invalid ones
    _, _, terminated, *_ = env.step("<action>jump</action>")
    assert not terminated


def test_hole_ends_frozen_lake_with_no_reward():
    env = make("palaestra/FrozenLake-v0")
    for seed in range(50):
        env.reset(seed=seed)
        table = env.game.unwrapped.P[int(env.game.unwrapped.s)]
        into_hole = [m for m, ((_, _, r, d),) in table.items() if d and r == 0]
        if into_hole:
            _, reward, terminated, _, info = env.step(f"<action>{FROZEN_LAKE_MOVES[into_hole[0]]}</action>")
            assert terminated and reward == 0.0 and info["success"] == 0.0
            return
    pytest.fail("no start next to a hole in 50 seeds")


def test_tasks_fix_the_board_and_fork_is_independent():
    env = make("palaestra/Taxi-v0")
    a, _ = env.reset(options={"task": {"seed": 42}})
    b, _ = env.reset(options={"task": {"seed": 42}})
    c, _ = env.reset(options={"task": {"seed": 43}})
    assert a == b and a != c
    env.reset(options={"task": {"seed": 42}})
    env.step("<action>north</action>")
    branch = env.fork()
    state = env.snapshot()
    obs_branch, *_ = branch.step("<action>south</action>")
    obs_main, *_ = env.step("<action>north</action>")
    assert obs_branch != obs_main and branch.turn == env.turn == 2
    env.restore(state)
    assert env.turn == 1 and env.step("<action>south</action>")[0] == obs_branch
    lake = make("palaestra/FrozenLake-v0")
    small, _ = lake.reset(options={"task": {"seed": 3, "size": 5}})
    assert len(small[1].content.split("\nYou are")[0].splitlines()) == 5
    with pytest.raises(ConfigError, match="seed"):
        lake.reset(options={"task": {"seed": "x"}})


class _Counter(gymnasium.Env):
    """A tiny third-party env: count up to 3 with action 1; action 0 does nothing."""

    def __init__(self):
        self.observation_space = gymnasium.spaces.Discrete(4)
        self.action_space = gymnasium.spaces.Discrete(2)
        self.n = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.n = int(self.np_random.integers(0, 2))
        return self.n, {}

    def step(self, action):
        self.n += int(action)
        return self.n, float(action), self.n >= 3, False, {}


gymnasium.register("palaestra_test/Counter-v0", entry_point=_Counter)


def test_wrap_gymnasium_turns_any_discrete_env_into_a_text_env():
    from gymnasium.utils.env_checker import check_env

    env = wrap_gymnasium(
        "palaestra_test/Counter-v0",
        render_fn=lambda game, obs: f"count={obs}",
        parse_fn=lambda text: {"up": 1, "stay": 0}.get(text.strip()),
        instructions="Say up or stay.",
        max_turns=5,
    )
    assert isinstance(env, TextGameEnv)
    check_env(env, skip_render_check=True)
    obs, _ = env.reset(seed=0)
    count = int(obs[-1].content.split("=")[1])
    total, terminated = 0.0, False
    while not terminated:
        obs, reward, terminated, _, info = env.step("up")
        total += reward
    assert total == 3 - count and info["success"] == 1.0
    assert obs[0].content.startswith("count=3")
    env.fork()  # lambdas are configuration, not state: fork still works
    default = wrap_gymnasium("palaestra_test/Counter-v0")
    default.reset(seed=0)
    assert default.step("<action>1</action>")[1] == 1.0  # default parser: the move's number
    with pytest.raises(ConfigError, match="Discrete"):
        wrap_gymnasium("MountainCarContinuous-v0")
    with pytest.raises(ConfigError, match="cannot make"):
        wrap_gymnasium("NoSuchGame-v0")


def test_blackjack_renders_cards_and_dealer():
    env = make("palaestra/Blackjack-v0")
    obs, _ = env.reset(seed=3)
    text = obs[1].content
    assert "Your cards:" in text and "The dealer shows" in text
    cards = [int(c) for c in text.split("Your cards: ")[1].split(" (")[0].split(", ")]
    assert np.sum(cards) <= 21 and len(cards) == 2
