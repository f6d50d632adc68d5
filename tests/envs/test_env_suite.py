"""Every env of issue 7: gymnasium's check_env, snapshot/fork, and a gold player scoring 1."""

import json
import pickle
from collections import deque

import pytest
from gymnasium.utils.env_checker import check_env

from palaestra.envs import BUILTIN_ENVS, make
from palaestra.envs.toy_text import BLACKJACK_MOVES, CLIFF_MOVES, FROZEN_LAKE_MOVES, TAXI_MOVES
from palaestra.envs.math import gsm8k_gold
from palaestra.envs.search import shared_bm25
from palaestra.types import Message, ToolCall

# the MCP envs start a tool-server process per episode: tests/envs/test_mcp_env.py plays them
ENV_IDS = sorted(i for i in BUILTIN_ENVS
                 if i != "palaestra/Calculator-v0" and not i.startswith("palaestra/MCP"))


@pytest.fixture(scope="module")
def bm25():
    retriever = shared_bm25()
    retriever.search(["warm up"], 1)
    return retriever


def _make(env_id, bm25):
    return make(env_id, retriever=bm25) if "SearchR1" in env_id else make(env_id)


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_check_env_snapshot_and_fork(env_id, bm25):
    env = _make(env_id, bm25)
    check_env(env, skip_render_check=True)
    first, _ = env.reset(seed=11)
    state = env.snapshot()
    pickle.loads(state)  # plain bytes, restorable in another process
    obs_a, *_ = env.step("<answer>0</answer> <action>0</action>")
    branch = env.fork()
    env.restore(state)
    assert env.turn == 0 and env.history == list(first)
    assert branch.turn == 1 and branch.history[-len(obs_a) - 1 :][1:] == list(obs_a)
    env.close()
    env.close()  # twice is fine


def _play_search(env):
    task = env.task
    env.step(f"<think>Let me look it up.</think>\n<search>{task['question']}</search>")
    return env.step(f"<answer>{task['golden_answers'][0]}</answer>")


def _play_search_tools(env):
    call = ToolCall("search", json.dumps({"query": env.task["question"]}), id="s1")
    env.step(Message("assistant", "", tool_calls=(call,)))
    return env.step(f"<answer>{env.task['golden_answers'][0]}</answer>")


def _plan(game):
    table, start = game.unwrapped.P, int(game.unwrapped.s)
    best = max(r for moves in table.values() for outs in moves.values() for _, _, r, d in outs if d)
    queue, seen = deque([(start, [])]), {start}
    while queue:
        state, path = queue.popleft()
        for move, ((_, nxt, reward, done),) in table[state].items():
            if done and reward == best:
                return path + [move]
            if not done and int(nxt) not in seen:
                seen.add(int(nxt))
                queue.append((int(nxt), path + [move]))
    raise AssertionError("unsolvable board")


def _play_grid(names):
    def play(env):
        for move in _plan(env.game):
            result = env.step(f"<action>{names[move]}</action>")
        return result

    return play


def _play_blackjack(env):
    def search(state, depth):
        for move in BLACKJACK_MOVES:
            branch = state.fork()
            *_, terminated, _, info = branch.step(f"<action>{move}</action>")
            if terminated and info["success"]:
                return [move]
            if not terminated and depth < 4:
                rest = search(branch, depth + 1)
                if rest:
                    return [move] + rest
        return None

    for seed in range(30):
        env.reset(seed=seed)
        line = search(env, 0)
        if line:
            for move in line:
                result = env.step(f"<action>{move}</action>")
            return result
    raise AssertionError("no winnable hand")


GOLD_PLAYERS = {
    "palaestra/SearchR1-v0": _play_search,
    "palaestra/SearchR1Tools-v0": _play_search_tools,
    "palaestra/GSM8K-v0": lambda env: env.step(f"So \\boxed{{{gsm8k_gold(env.task)}}}."),
    "palaestra/MATH-v0": lambda env: env.step(f"Hence $\\boxed{{{env.task['answer']}}}$."),
    "palaestra/Code-v0": lambda env: env.step(
        f"```python\n{env.task['prompt']}{env.task['canonical_solution']}```"
    ),
    "palaestra/FrozenLake-v0": _play_grid(FROZEN_LAKE_MOVES),
    "palaestra/Taxi-v0": _play_grid(TAXI_MOVES),
    "palaestra/CliffWalking-v0": _play_grid(CLIFF_MOVES),
    "palaestra/Blackjack-v0": _play_blackjack,
    "palaestra/HiddenRule-v0": lambda env: env.step(f"<answer>{env.task['low'] + 2}</answer>"),
}


def test_every_env_has_a_gold_player():
    assert sorted(GOLD_PLAYERS) == ENV_IDS


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_gold_player_scores_one(env_id, bm25):
    env = _make(env_id, bm25)
    env.reset(seed=3)
    _, reward, terminated, truncated, info = GOLD_PLAYERS[env_id](env)
    assert terminated and not truncated
    # games pay their own rewards (Taxi +20, CliffWalking -1 a step); winning is success == 1
    assert info.get("success", reward) == 1.0, info
    if env_id in ("palaestra/FrozenLake-v0", "palaestra/Blackjack-v0") or "success" not in info:
        assert reward == 1.0
