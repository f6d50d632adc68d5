"""In-flight episodes in a checkpoint: save a live episode at its last completed turn, resume it.

`save_episode(env, agent, state)` -> `SavedEpisode` (picklable, plain data): the agent's exact
tokens, loss mask, logprobs and versions so far, its conversation and turn marks, the
`EpisodeState` (turns with their rewards, request count, timings) and the env's `snapshot`.
A turn that was cut by the pause (partial rollout: tokens of an aborted generation) is rolled
back: the saved episode stands at the end of its last completed turn, with the request count of
that point, so the resumed turn samples with the seed an uninterrupted run used for it (seeded
sampling: the same tokens). `restore_episode(saved, env, agent)` puts it into a fresh env (same
env id and kwargs) and agent (same spec) and returns the `EpisodeState` to play on with.

Live resources: an env that holds one which a snapshot cannot carry (a persistent sandbox
session) records what re-creates it in its snapshot (the cells it ran) and implements
``async areplay()``, which `arestore_episode` awaits after the restore (e.g. open a session and
run the recorded cells again).

The rollout worker saves its parked episodes with these (`RolloutWorker.inflight_state` after a
pause) and re-creates them in a new process (`RolloutWorker.restore_inflight`, then `resume`).
The manager's checkpoint (`RolloutManager.checkpoint_state`) carries them as `encode_inflight`
makes them: one compressed pickle in base64 (JSON-safe, for ``backend_state.json``; a checkpoint
is trusted input, as its weights are), about 1 KB per episode of a few short turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from palaestra.errors import CheckpointError
from palaestra.rollout.episode import EpisodeState
from palaestra.types import Message, Trajectory

if TYPE_CHECKING:
    from palaestra.agents.agent import Agent


class SnapshotEnv(Protocol):
    """What saving and restoring an episode calls on its env (`palaestra.envs.Env` has both;
    ``areplay``, when the env has one, is looked up by name)."""

    def snapshot(self) -> bytes: ...

    def restore(self, state: bytes, /) -> None: ...

#: agent attributes that, with the transcript and conversation, make its episode state
_AGENT_FLAGS = ("truncated", "last_finish_reason", "checks_drift", "_turn_start",
                "_awaiting_observation", "_resumable", "_delta_fallbacks")


@dataclass(frozen=True)
class SavedEpisode:
    """One live episode at the end of its last completed turn (see the module docstring)."""

    state: EpisodeState
    env_snapshot: bytes
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...]
    ids: tuple[int, ...]
    mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    prompt_len: int
    turn_ends: tuple[int, ...]
    flags: dict[str, Any] = field(default_factory=dict)
    rolled_back_tokens: int = 0  # tokens of a cut turn that the resume samples again


@dataclass(frozen=True)
class SavedGroup:
    """A group of a worker: its task, and per episode a finished trajectory or a saved one."""

    task: Any  # a `palaestra.rollout.groups.GroupTask`
    finished: tuple[Trajectory | None, ...]
    live: tuple[SavedEpisode | None, ...]


def save_episode(env: SnapshotEnv, agent: Agent, state: EpisodeState) -> SavedEpisode:
    """The episode at its last completed turn (a cut turn rolled back)."""
    if not state.started:
        raise CheckpointError("save_episode: the episode has not started (nothing to save; "
                              "restart it from its task instead)")
    t = agent.transcript
    ids, mask, logprobs, versions = list(t.ids), list(t.mask), list(t.logprobs), list(t.versions)
    turn_ends, messages = list(t.turn_ends), list(agent.messages)
    flags = {name: getattr(agent, name) for name in _AGENT_FLAGS}
    st = replace(state, turns=list(state.turns), partial_tokens=0)
    rolled_back = 0
    if agent._resumable or (agent._awaiting_observation and len(turn_ends) > len(state.turns)):
        # the last sampled turn never reached the env: drop it, as if its request never ran
        start = agent._turn_start if agent._turn_start is not None else len(ids)
        rolled_back = len(ids) - start
        del ids[start:], mask[start:], logprobs[start:], versions[start:]
        turn_ends.pop()
        messages.pop()
        flags.update(_resumable=False, _awaiting_observation=False, last_finish_reason=None,
                     _turn_start=None,
                     truncated=len(ids) >= agent.max_context)
        st.requests = state.turn_requests
    return SavedEpisode(st, env.snapshot(), tuple(messages), tuple(dict(x) for x in agent.tools),
                        tuple(ids), tuple(mask), tuple(logprobs), tuple(versions), t.prompt_len,
                        tuple(turn_ends), flags, rolled_back)


def restore_episode(saved: SavedEpisode, env: SnapshotEnv, agent: Agent) -> EpisodeState:
    """Put ``saved`` into ``env`` (a fresh env of the same id and kwargs) and ``agent``; returns
    the state to play on with (``run_episode(..., state=...)``). Live resources: await
    `arestore_episode` instead."""
    from palaestra.agents.transcript import TokenTranscript

    env.restore(saved.env_snapshot)
    agent.messages = list(saved.messages)
    agent.tools = [dict(x) for x in saved.tools]
    agent.transcript = TokenTranscript(list(saved.ids), list(saved.mask), list(saved.logprobs),
                                       list(saved.versions), saved.prompt_len,
                                       list(saved.turn_ends))
    for name, value in saved.flags.items():
        setattr(agent, name, value)
    return replace(saved.state, turns=list(saved.state.turns))


async def arestore_episode(saved: SavedEpisode, env: SnapshotEnv, agent: Agent) -> EpisodeState:
    """`restore_episode`, then the env's ``areplay()`` (re-create live resources) if it has one."""
    state = restore_episode(saved, env, agent)
    replay = getattr(env, "areplay", None)
    if callable(replay):
        await replay()
    return state


def encode_inflight(groups: list[SavedGroup], ready: list[tuple[Any, tuple[Trajectory, ...]]],
                    ordinals: dict[str, int]) -> dict[str, Any]:
    """The manager's in-flight groups (and finished, not yet trained-on ones) as a JSON-safe
    entry of its checkpoint state: one pickle (protocol 5, zlib), base64, with its counts."""
    import base64
    import pickle
    import zlib

    blob = zlib.compress(pickle.dumps({"groups": groups, "ready": ready, "ordinals": ordinals},
                                      protocol=5), 6)
    episodes = sum(e is not None for g in groups for e in g.live)
    return {"format": FORMAT, "groups": len(groups), "episodes": episodes,
            "ready_groups": len(ready), "bytes": len(blob),
            "data": base64.b64encode(blob).decode("ascii")}


def decode_inflight(entry: dict[str, Any]) -> tuple[list[SavedGroup],
                                                    list[tuple[Any, tuple[Trajectory, ...]]],
                                                    dict[str, int]]:
    """`encode_inflight` undone: (saved groups, ready groups, ordinals)."""
    import base64
    import pickle
    import zlib

    if entry.get("format") != FORMAT:
        raise CheckpointError(f"the checkpoint's in-flight episodes are in format "
                              f"{entry.get('format')!r}, this version reads {FORMAT!r}; resume "
                              "with the version that wrote it, or drop the 'inflight' entry of "
                              "its rollout state to restart those episodes from their tasks")
    try:
        state = pickle.loads(zlib.decompress(base64.b64decode(entry["data"])))
    except Exception as exc:  # a damaged or foreign checkpoint
        raise CheckpointError(f"cannot read the checkpoint's in-flight episodes ({exc!r}); drop "
                              "the 'inflight' entry of its rollout state to restart them from "
                              "their tasks") from exc
    return list(state["groups"]), list(state["ready"]), dict(state["ordinals"])


FORMAT = "palaestra-inflight-1"

__all__ = ["FORMAT", "SavedEpisode", "SavedGroup", "arestore_episode", "decode_inflight",
           "encode_inflight", "restore_episode", "save_episode"]
