"""Branching and resume with a live sandbox session: a tree over an env that keeps a persistent
python interpreter forks the interpreter at each branch point (each leaf's variables follow its
own path only), and an in-flight episode whose interpreter holds state resumes in a fresh env by
replaying its recorded cells, with the uninterrupted run's samples."""

from __future__ import annotations

import asyncio
import pickle
import re
from typing import Any

import pytest

from palaestra.rollout.branching import TreeHooks, TreeRequest, play_branching_group
from palaestra.rollout.groups import Branching
from palaestra.engine import SamplingParams
from palaestra.rollout.episode import EpisodeState
from palaestra.rollout.play import run_episode


@pytest.fixture()
async def box():
    from palaestra.sandbox import LocalSandbox

    async with LocalSandbox() as sandbox:
        async with sandbox.session(persistent_python=True) as probe:
            await probe.run("x = 1")
            try:
                child = await probe.fork()
            except Exception as exc:  # noqa: BLE001 -- the machine cannot fork sessions
                pytest.skip(f"sandbox session fork unavailable here: {exc}")
            await child.close()
        yield sandbox


def _parts(model_dir: str, box: Any) -> tuple[Any, Any, Any]:
    from palaestra.agents import AgentSpec
    from palaestra.benchmarks.perf.branching import CodePolicy, SessionPythonEnv
    from palaestra.engines.clients.scripted import ScriptedEngine

    counts = {"runs": 0}
    return (ScriptedEngine(CodePolicy(model_dir)), AgentSpec(model_dir),
            lambda: SessionPythonEnv(box, counts, max_turns=4))


def _replay_locally(cells: list[str]) -> int:
    scope: dict[str, Any] = {}
    for cell in cells:
        exec(cell.replace("print(x)", ""), scope)  # noqa: S102 -- our own scripted cells
    return int(scope["x"])


async def test_tree_forks_the_interpreter_with_the_episode(model_dir, box) -> None:
    engine, spec, make_env = _parts(model_dir, box)
    envs: list[Any] = []

    def acquire() -> Any:
        env = make_env()
        envs.append(env)
        return env

    hooks = TreeHooks(acquire_env=acquire, release_env=envs.append, acquire_agent=spec.build,
                      release_agent=lambda a: None, wait_gate=lambda: asyncio.sleep(0))
    request = TreeRequest("g", "python-session", {"x": 5}, tuple(range(8)), Branching((1, 2), 2),
                          SamplingParams(max_new_tokens=64))
    try:
        leaves = await play_branching_group(request, engine, hooks)
        assert len(hooks.forks) == 6 and all(not t.failed for t in leaves)
        assert envs[0].counts["runs"] == 2 * (1 + 2 + 4 + 4)  # shared cells ran once
        finals = []
        for leaf in leaves:
            cells = [t.action.content for t in leaf.turns]
            printed = int(re.findall(r"-?\d+", leaf.turns[-1].observation[-1].content)[-1])
            # the interpreter saw exactly this leaf's path: its own cells, no sibling's
            assert printed == _replay_locally(cells)
            finals.append(printed)
        assert len(set(finals)) > 2
    finally:
        for env in {id(e): e for e in envs}.values():
            await env.aclose_session()


async def test_in_flight_session_episode_resumes_by_replaying_its_cells(model_dir, box) -> None:
    from palaestra.rollout.inflight import arestore_episode, save_episode

    engine, spec, make_env = _parts(model_dir, box)
    sampling = SamplingParams(max_new_tokens=64, seed=77)
    env_a, env_b, env_c = make_env(), make_env(), make_env()
    try:
        whole = await run_episode(env_a, spec.build(), engine, sampling, seed=1, task={"x": 4})
        agent = spec.build()
        st = EpisodeState()
        first = await run_episode(env_b, agent, engine, sampling, seed=1, task={"x": 4},
                                  state=st, halt_at_turn=2)
        assert first.samples == () and st.halted_at == 2
        blob = pickle.dumps(save_episode(env_b, agent, st))
        await env_b.aclose_session()  # the old process and its interpreter are gone
        fresh_agent = spec.build()
        state = await arestore_episode(pickle.loads(blob), env_c, fresh_agent)
        state.halted_at = None
        out = await run_episode(env_c, fresh_agent, engine, sampling, seed=1, task={"x": 4},
                                state=state)
    finally:
        for env in (env_a, env_b, env_c):
            await env.aclose_session()
    assert not whole.failed and not out.failed
    assert out.samples[0].token_ids_T == whole.samples[0].token_ids_T
    assert out.samples[0].logprobs_T == whole.samples[0].logprobs_T
    # turn 3's cell used the x that the replayed cells rebuilt in the new interpreter
    assert [t.observation for t in out.turns] == [t.observation for t in whole.turns]
    assert out.reward == whole.reward
