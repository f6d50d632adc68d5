"""Per-step rollout metrics: rewards, lengths, tools, stop reasons, accounting, throughput, time.

Reward, pass-rate, length and tool metrics describe the *kept* trajectories (what the trainer
sees); stop reasons, failures and throughput describe *every* episode that finished in the step;
``groups/*`` is the ledger of every task drawn (see `RolloutManager`). Time is split into engine,
env (and sandbox, when envs report ``sandbox_s`` in their step info), agent (rendering, parsing)
and the rest (framework and event-loop queueing), as fractions of the episodes' wall time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from palaestra.types import Trajectory


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _sum(trajectories: Iterable[Trajectory], key: str) -> float:
    return float(sum(t.metrics.get(key, 0.0) for t in trajectories))


_GATEWAY_COUNTERS = frozenset({
    "calls", "samples", "prefix_breaks", "external",
})


def summarize(
    finished: Sequence[Trajectory],
    kept: Sequence[Trajectory],
    counters: Mapping[str, float],
    elapsed_s: float,
    *,
    pass_threshold: float = 1.0,
) -> dict[str, float]:
    """The metrics of one rollout step (flat ``name -> float``)."""
    out: dict[str, float] = {}
    rewards = [t.reward for t in kept]
    out["reward/mean"], out["reward/std"] = _mean_std(rewards)
    out["pass_rate"] = (sum(r >= pass_threshold for r in rewards) / len(rewards)) if rewards else 0.0
    by_env: dict[str, list[float]] = {}
    for t in kept:
        by_env.setdefault(t.env_id, []).append(t.reward)
    for env_id, values in sorted(by_env.items()):
        out[f"reward/{env_id}/mean"], out[f"reward/{env_id}/std"] = _mean_std(values)
        out[f"pass_rate/{env_id}"] = sum(v >= pass_threshold for v in values) / len(values)
    lengths = [t.metrics.get("response_tokens", 0.0) for t in kept]
    out["response_len/mean"] = _mean_std(lengths)[0]
    out["response_len/max"] = max(lengths, default=0.0)
    out["turns/mean"] = _mean_std([t.metrics.get("turns", 0.0) for t in kept])[0]
    n_kept = max(len(kept), 1)
    out["tool_calls/mean"] = _sum(kept, "tool_calls") / n_kept
    out["tool_errors/mean"] = _sum(kept, "tool_errors") / n_kept
    out["tool_calls/total"] = _sum(finished, "tool_calls")
    out["tool_errors/total"] = _sum(finished, "tool_errors")
    drift = [t.metrics["drift_mismatches"] for t in finished if "drift_mismatches" in t.metrics]
    if drift:
        out["drift/checked"] = float(len(drift))
        out["drift/mismatches"] = float(sum(1 for d in drift if d))

    # agents behind the gateway (ExternalAgentEnv) and posted trajectories report how their model calls
    # became samples: sum those counters over the step
    gateway = [t.metrics for t in finished if "prefix_breaks" in t.metrics or "external" in t.metrics]
    if gateway:
        out["gateway/episodes"] = float(len(gateway))
        keys = {k for m in gateway for k in m if k in _GATEWAY_COUNTERS
                or k.endswith("_continuations")}
        for key in sorted(keys):
            out[f"gateway/{key}"] = float(sum(m.get(key, 0.0) for m in gateway))

    failed = sum(1 for t in finished if t.failed)
    out["episodes/finished"] = float(len(finished))
    out["episodes/failed"] = float(failed)
    out["episodes/failure_rate"] = failed / len(finished) if finished else 0.0
    for reason, count in Counter(t.stop_reason.value for t in finished).items():
        out[f"stop_reason/{reason}"] = float(count)
    for name, value in counters.items():
        out[name] = float(value)

    steps = _sum(finished, "turns")
    tokens = _sum(finished, "response_tokens")
    elapsed = max(elapsed_s, 1e-9)
    out["episodes/env_steps"] = steps
    out["time/step_s"] = elapsed_s
    out["perf/episodes_per_s"] = len(finished) / elapsed
    out["perf/env_steps_per_s"] = steps / elapsed
    out["perf/tokens_per_s"] = tokens / elapsed
    wall = _sum(finished, "wall_s")
    engine, env, sandbox, agent = (
        _sum(finished, k) for k in ("engine_s", "env_s", "sandbox_s", "agent_s")
    )
    if wall > 0:
        out["time/engine_frac"] = engine / wall
        out["time/env_frac"] = (env - sandbox) / wall
        out["time/sandbox_frac"] = sandbox / wall
        out["time/agent_frac"] = agent / wall
        out["time/other_frac"] = max(0.0, 1.0 - (engine + env + agent) / wall)
    if steps:
        out["time/agent_ms_per_step"] = 1e3 * agent / steps
        out["time/env_ms_per_step"] = 1e3 * env / steps
    return out


__all__ = ["summarize"]
