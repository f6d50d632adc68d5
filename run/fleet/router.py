"""``engine.router``: which router spreads a run's requests over its servers, and the checks of
that choice.

"palaestra" (the default) is the Python `Router` of `palaestra.engines.clients.router`; "sglang"
is SGLang's own router (`palaestra.engines.clients.sglang_router`), started in front of the
run's listed (``engine.urls``) and launched (``engine.launch``) servers and stopped with the
run. `router_problems` are the load-time checks (what the choice cannot serve);
`router_launch_problems` the one only the training machine can answer (is it installed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from palaestra.config import Problem

if TYPE_CHECKING:
    from palaestra.run.sections import RunSettings


def router_problems(cfg: RunSettings) -> list[Problem]:
    """Why ``engine.router = "sglang"`` cannot route this run's requests."""
    e = cfg.engine
    if e.router != "sglang":
        if e.router_args:
            return [Problem(("engine.router_args", "engine.router"), (
                "engine.router_args are flags of SGLang's router: set engine.router = 'sglang' "
                "too, or drop them"))]
        return []
    from palaestra.run.fleet.start import engine_actor_count

    out = []
    if e.kind != "sglang":
        out.append(Problem(("engine.router", "engine.kind"), (
            "engine.router = 'sglang' routes over servers: set engine.kind = 'sglang' with "
            "engine.urls or engine.launch (the embedded engine lives in the run's process)")))
    elif engine_actor_count(cfg):
        out.append(Problem(("engine.router", "placement"), (
            "engine.router = 'sglang' fronts engine.urls and engine.launch servers; the engine "
            "actors of [placement] are routed by the run's own router: set engine.router = "
            "'palaestra'")))
    if cfg.rollout.cluster == "ray":
        out.append(Problem(("engine.router", "rollout.cluster"), (
            "engine.router = 'sglang' with rollout.cluster = 'ray' is not supported yet (the "
            "Ray workers route over their own routers); use rollout.cluster = 'local', or "
            "engine.router = 'palaestra'")))
    return out


def router_launch_problems(cfg: RunSettings) -> list[Problem]:
    """``engine.router = "sglang"`` on a machine without ``sglang-router``: the install hint."""
    if cfg.engine.router != "sglang":
        return []
    from palaestra.engines.clients.sglang_router import ROUTER_REQUIREMENT, router_installed

    if router_installed():
        return []
    return [Problem(("engine.router",), (
        f"engine.router = 'sglang' needs SGLang's router, which is not installed here: pip "
        f"install '{ROUTER_REQUIREMENT}' (a Rust binary in a wheel; it runs on CPU and pulls in "
        "neither sglang nor torch), or set engine.router = 'palaestra'"))]


__all__ = ["router_launch_problems", "router_problems"]
