"""Rollout: tasks -> groups of episodes -> scored, token-exact samples, fast and without loss.

`play_episode(EpisodeRequest)` is the one episode loop (`run_episode`: its token-level call); `RolloutManager` runs it at scale on rollout
workers (Ray actors, or in-process with ``cluster="local"``) and hands the trainer
`RolloutBatch`es. Import names from their modules (``palaestra.rollout.manager`` and so
on); this package exports nothing, and nothing here imports ray or torch until a function needs
it.

Engines and Ray workers: engines run as HTTP servers (SGLang in production, `palaestra serve`
with the embedded engine otherwise) and every worker reaches them through a `Router` of
`SGLangClient`s (``EngineSpec.http(urls)``): sticky sessions keep an episode's turns on one
engine's prefix cache, a dead engine's requests are retried on another, and the manager holds
one more client for pause / weight update / resume. Engines that are cheap to copy (the scripted
engine of tests and benchmarks) can instead be built inside each worker
(``EngineSpec.from_factory``), and ``cluster="local"`` can share one live engine object. Engines
are not wrapped as Ray actors: the HTTP path is the one SGLang needs anyway, and it keeps weight
updates, aborts and failover in one place.

Modules: `episode` (the loop), `data` (data source), `groups` (filters), `worker` / `cluster` /
`manager` (scale-out and batches), `tool_cache` (record/replay), `metrics`, `config`, `testing`
(scripted policies and faulty envs for tests and benchmarks). GPU placement plans live in
`palaestra.run.fleet.placement`. Samples become tensors in `palaestra.trainers.batching` (DP balance,
micro-batches).
"""

from __future__ import annotations
