"""Checks every palaestra env must pass: gymnasium's `check_env` plus our own contract checks.

Our checks: same seed -> same first observation; observations, infos and snapshots pickle;
snapshot/restore returns to the same state; a fork continues independently of its parent;
``close()`` twice is safe. `palaestra envs check` and the registry-wide test both call `check_env_id`.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from palaestra.envs.base import Env
from palaestra.envs.registry import make


@dataclass
class CheckReport:
    env_id: str
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed


def _gymnasium_checker(env_id: str) -> None:
    from gymnasium.utils.env_checker import check_env

    env = make(env_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # our spaces are non-standard on purpose
        check_env(env, skip_render_check=True)
    env.close()


def _determinism(env_id: str) -> None:
    a, b = make(env_id), make(env_id)
    obs_a, info_a = a.reset(seed=123)
    obs_b, info_b = b.reset(seed=123)
    assert obs_a == obs_b, "the same seed gave different first observations"
    assert info_a["task_id"] == info_b["task_id"], "the same seed drew different tasks"
    obs_c, _ = b.reset(seed=123, options={"task": a.task})
    assert obs_c == obs_a, "reset with the same explicit task gave a different observation"
    a.close(), b.close()


def _pickling(env_id: str) -> None:
    env = make(env_id)
    obs, info = env.reset(seed=0)
    assert pickle.loads(pickle.dumps(obs)) == obs, "observations do not survive pickling"
    pickle.loads(pickle.dumps(info))
    step = env.step(env.action_space.sample())
    pickle.loads(pickle.dumps(step))
    env.close()


def _snapshot_restore(env_id: str) -> None:
    env: Env = make(env_id)
    env.reset(seed=7)
    state = env.snapshot()
    turn, history = env.turn, list(env.history)
    env.step("a first answer that changes the state")
    env.restore(state)
    assert env.turn == turn and env.history == history, "restore() did not return to the snapshot"
    env.close()


def _fork(env_id: str) -> None:
    env: Env = make(env_id)
    env.reset(seed=11)
    child = env.fork()
    env.step("branch one")
    assert child.turn == 0 and len(child.history) < len(env.history), "the fork shares state"
    child.step("branch two")
    assert env.history[-1] != child.history[-1] or env.history[-2] != child.history[-2]
    env.close()
    child.close()


def _double_close(env_id: str) -> None:
    env = make(env_id)
    env.reset(seed=0)
    env.close()
    env.close()


CHECKS: dict[str, Callable[[str], None]] = {
    "gymnasium check_env": _gymnasium_checker,
    "seed determinism": _determinism,
    "pickling": _pickling,
    "snapshot/restore": _snapshot_restore,
    "fork": _fork,
    "double close": _double_close,
}


def check_env_id(env_id: str) -> CheckReport:
    report = CheckReport(env_id)
    for name, check in CHECKS.items():
        try:
            check(env_id)
        except Exception as exc:  # collect every failure, not just the first
            report.failed[name] = f"{type(exc).__name__}: {exc}"
        else:
            report.passed.append(name)
    return report
