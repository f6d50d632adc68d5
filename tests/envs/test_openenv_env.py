"""`OpenEnvEnv` against a real OpenEnv server built from openenv-core's own server API
(`Environment`, `Action`/`Observation`/`State`, `create_fastapi_app`), run with uvicorn on
loopback in a subprocess: a full game, the server's state, bad actions, a server that dies."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("openenv.core.generic_client")

from palaestra.envs import make

OPENENV = "palaestra.envs.ecosystem:ecosystem/OpenEnv-v0"

GUESS_SERVER = '''
import random, sys
import uvicorn
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    feedback: str
    guesses: int = 0


class GuessEnv(Environment):
    """Guess a number from 1 to 100: feedback 'higher'/'lower', reward 1 when found."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.target = 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target = random.Random(seed).randint(1, 100)
        self._state = State(episode_id=episode_id or f"ep-{seed}", step_count=0)
        return GuessObservation(feedback="Guess a number from 1 to 100.")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        try:
            guess = int(action.message.strip())
        except ValueError:
            return GuessObservation(feedback="not a number", guesses=self._state.step_count,
                                    reward=-0.1)
        if guess == self.target:
            return GuessObservation(feedback="correct", guesses=self._state.step_count,
                                    reward=1.0, done=True)
        hint = "higher" if guess < self.target else "lower"
        return GuessObservation(feedback=hint, guesses=self._state.step_count, reward=0.0)

    @property
    def state(self):
        return self._state


app = create_fastapi_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=8)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def guess_server(tmp_path):
    script = tmp_path / "guess_server.py"
    script.write_text(GUESS_SERVER)
    port = _free_port()
    log = (tmp_path / "server.log").open("w")  # a file: a full pipe would block the server
    proc = subprocess.Popen([sys.executable, str(script), str(port)], stderr=log)
    deadline = time.monotonic() + 90
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the OpenEnv server did not start: {(tmp_path / 'server.log').read_text()}")
            time.sleep(0.2)
    yield proc, f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait(timeout=10)
    log.close()


def _binary_search(env) -> tuple[float, bool, dict, int]:
    low, high, total, steps = 1, 100, 0.0, 0
    while True:
        guess = (low + high) // 2
        obs, reward, terminated, truncated, info = env.step(str(guess))
        total, steps = total + reward, steps + 1
        feedback = obs[-1].content
        if terminated or truncated:
            return total, terminated, info, steps
        if feedback == "higher":
            low = guess + 1
        else:
            assert feedback == "lower", feedback
            high = guess - 1


def test_a_full_game_with_rewards_state_and_sessions(guess_server):
    _, url = guess_server
    env = make(OPENENV, url=url, observation_field="feedback", max_turns=10)
    obs, _ = env.reset(seed=5)
    assert obs[0].role == "system" and obs[-1].content == "Guess a number from 1 to 100."
    total, terminated, step_info, steps = _binary_search(env)
    assert terminated and total == 1.0 and step_info["stop_reason"] == "terminated"
    state = asyncio.run(env.server_state())
    assert state["step_count"] == steps and state["episode_id"] == f"ep-{env.task['reset']['seed']}"
    # same seed, same hidden number: the same game again, in a new server session
    env.reset(seed=5)
    assert _binary_search(env)[3] == steps
    assert asyncio.run(env.server_state())["step_count"] == steps
    # the server's reward of a bad action reaches palaestra as the step reward
    env.reset(seed=6)
    _, reward, terminated, _, _ = env.step("not a guess")
    assert reward == pytest.approx(-0.1) and not terminated
    env.close()
    env.close()


def test_json_actions_and_a_dead_server(guess_server):
    proc, url = guess_server
    env = make(OPENENV, url=url, action_field=None, max_consecutive_errors=2)
    env.reset(seed=1)
    obs, _, terminated, _, info = env.step("50")  # JSON, but not an object
    assert not terminated and "must be a JSON object" in obs[0].content and "action_error" in info
    obs, _, terminated, _, _ = env.step('{"message": "50"}')
    assert not terminated and '"feedback"' in obs[0].content and '"guesses": 1' in obs[0].content
    env.step("{nope")
    obs, _, terminated, _, info = env.step("{nope")
    assert terminated and info["stop_reason"] == "parse_error"
    env.reset(seed=2)
    proc.kill()
    proc.wait(timeout=10)
    obs, _, terminated, _, info = env.step('{"message": "50"}')
    assert terminated and info["stop_reason"] == "error" and "failed" in info["error"]
    assert obs[0].content.startswith("Error:")
    env.close()


def test_bad_url_says_how_to_fix():
    from palaestra.errors import ConfigError

    with pytest.raises(ConfigError, match="server's address"):
        make(OPENENV, url="localhost:8000")


def test_fork_shares_the_session_and_leaves_it_open(guess_server):
    _, url = guess_server
    env = make(OPENENV, url=url, observation_field="feedback")
    env.reset(seed=3)
    child = env.fork()
    child.step("50")
    child.close()  # the fork does not own the session
    obs, *_ = env.step("50")
    assert obs[-1].content in ("higher", "lower", "correct")
    assert asyncio.run(env.server_state())["step_count"] == 2  # one server episode for both
    env.close()


def test_envs_check_cli_runs_on_the_adapter(guess_server):
    _, url = guess_server
    out = subprocess.run([sys.executable, "-m", "palaestra", "envs", "check",
                          "ecosystem/OpenEnv-v0", "--kwargs", f'{{"url": "{url}"}}'],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0 and "ecosystem/OpenEnv-v0: ok (6/6)" in out.stdout, out
