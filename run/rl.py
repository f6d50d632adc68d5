"""The RL phase of ``palaestra train``: `RLRun`, one step at a time, resumable.

RL step (sync): rollout batch (engines at policy version v) -> the learner's update
(`palaestra.trainers.update`: advantages and optimizer steps) -> the backend's weights to the
engines (version v+1) by the run's push, while the rollout manager holds generation paused ->
metrics -> evaluation -> checkpoint. Async: the manager generates batch k+1 while step k trains
(the update runs in a worker thread, so the engine keeps serving), bounded by
``rollout.max_staleness``.

Exact resume (sync mode): every request samples from its own seed (run seed, task draw, episode
index, request index), batches are in draw order and never drawn ahead (`RolloutManager`'s exact
batches), so a run killed at any step and resumed trains on the same samples as an uninterrupted
one. Async mode runs episodes across a checkpoint: the checkpoint holds them whole
(`RolloutManager.checkpoint_state`), and a resumed run plays them on from their last completed
turn. Failed episodes go to ``failures.jsonl`` (with a console line per step), and a step whose
gradients are not finite is counted in ``train/skipped_steps``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, cast

from palaestra.contracts import AdapterTrainer, Closeable
from palaestra.engine import EngineStats
from palaestra.host_memory import release_freed_memory, resident_gib
from palaestra.run.best_model import BestModel
from palaestra.run.builders import build_backend
from palaestra.run.config import TrainConfig
from palaestra.run.fleet.engine_sync import EngineSync
from palaestra.run.held_out import evaluate_stage, train_rows
from palaestra.run.run_dir import RunDir
from palaestra.run.services import run_env_kwargs
from palaestra.run.step_log import Progress, failure_line, progress, step_record
from palaestra.trace_ranges import span

if TYPE_CHECKING:
    from palaestra.agents.spec import AgentSpec
    from palaestra.contracts import TrainerBackend
    from palaestra.engines.clients.sglang import SGLangEngine
    from palaestra.engines.local.local import LocalEngine
    from palaestra.engines.serve.serve import RunningServer
    from palaestra.rollout.manager import RolloutManager
    from palaestra.rollout.rewards.worker import RewardClient
    from palaestra.run.evaluation import TrainingEvaluation
    from palaestra.run.fleet.admin import AdminServer
    from palaestra.run.fleet.colocate import ColocatedPhases
    from palaestra.run.fleet.elastic import ElasticEngines
    from palaestra.run.fleet.placement import RunPlan
    from palaestra.run.fleet.weight_pushes import SyncPush
    from palaestra.run.parity import ParityCheck
    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.ppo.step import Critic
    from palaestra.trainers.update import Learner


def _trainer_group(cfg: TrainConfig) -> RunPlan | None:
    """The plan of a trainer group (``[placement]`` with several trainer ranks), else None."""
    from palaestra.run.trainer_plan import group_size, require_plan

    return require_plan(cfg) if group_size(cfg) > 1 else None


def _build_critic(cfg: TrainConfig, policy_path: Path) -> Critic | None:
    """The ``[critic]`` backend when the loss needs values (PPO's GAE), else None."""
    from palaestra.run.phases.critic import build_critic, uses_critic

    return build_critic(cfg, policy_path) if uses_critic(cfg) else None


async def run_rl(cfg: TrainConfig, run: RunDir, policy_path: Path, spec: AgentSpec,
                 engine: LocalEngine | SGLangEngine, sync: EngineSync) -> None:
    """The RL steps, resumable from the newest ``rl-*`` checkpoint (the phases: `RLRun`)."""
    rl = await RLRun.setup(cfg, run, policy_path, spec, engine, sync)
    start_step = await rl.resume()
    await rl.start(start_step)
    try:
        async with rl.manager:
            for step in range(start_step, cfg.trainer.steps):
                await rl.step(step)
        if rl.colocated is not None:  # the trainer back on its GPU for the final export
            await rl.colocated.stop()
        rl.finish()
    finally:
        await rl.close()


class RLRun:
    """One RL phase in named parts: `setup` (backend, critic, tasks, rollout manager), `resume`
    (the newest ``rl-*`` checkpoint, else the engines at the policy), `start` (progress, elastic
    engines, benchmark evaluator), `step` (rollout batch -> advantages -> update(s) -> weights ->
    metrics -> evaluation -> `checkpoint`), `finish` (the final model folders), `close`."""

    def __init__(self, cfg: TrainConfig, run: RunDir, policy_path: Path, spec: AgentSpec,
                 engine: LocalEngine | SGLangEngine, sync: EngineSync, *,
                 backend: TrainerBackend[TrainBatch, LossConfig], critic: Critic | None,
                 learner: Learner, push: SyncPush, manager: RolloutManager, rewards: RewardClient | None,
                 server: RunningServer | None) -> None:
        self.cfg, self.run, self.policy_path, self.spec = cfg, run, policy_path, spec
        self.engine, self.sync, self.backend, self.critic = engine, sync, backend, critic
        self.learner = learner  # advantages and optimizer steps (GRPO & co, or PPO)
        self.push = push  # the backend's weights to the engines, by the run's one path
        self.manager, self.rewards, self.server = manager, rewards, server
        self.counts: Counter[str] = Counter()  # skipped optimizer steps, failed episodes (run)
        self.progress: Progress | None = None
        self.admin: AdminServer | None = None
        self.elastic: ElasticEngines | None = None
        self.evaluator: TrainingEvaluation | None = None
        self.best: BestModel | None = None  # [benchmark_eval] keep_best
        self.colocated: ColocatedPhases | None = None  # [placement] colocate: phase switches
        self._engine_seen: dict[str, float] = {}  # engine stats at the last step's end
        self.parity: ParityCheck | None = None  # the full-vocabulary parity check (run/parity)

    @classmethod
    async def setup(cls, cfg: TrainConfig, run: RunDir, policy_path: Path, spec: AgentSpec,
                    engine: LocalEngine | SGLangEngine, sync: EngineSync) -> RLRun:
        """The backend, the critic, the tasks, the engines as workers see them, the manager."""
        from palaestra.engines.clients.sglang import SGLangEngine
        from palaestra.rollout.config import EngineSpec, WorkerConfig
        from palaestra.rollout.data import DataSource
        from palaestra.rollout.manager import RolloutManager
        from palaestra.run.fleet.start import trainer_placement_group
        from palaestra.run.phases.critic import optimizer_steps

        r = cfg.rollout
        backend = build_backend(cfg.trainer, policy_path, temperature=r.temperature,
                                seed=cfg.seed, optimizer_steps=optimizer_steps(cfg),
                                group=_trainer_group(cfg),
                                ray_address=r.ray_address,
                                placement_group=trainer_placement_group(engine),
                                ready_timeout_s=r.start_timeout_s)
        critic = _build_critic(cfg, policy_path)  # PPO's value model (GAE advantages), else None
        data = DataSource(train_rows(cfg), env_id=cfg.env.id, shuffle=cfg.data.shuffle,
                          seed=cfg.data.seed, epochs=cfg.data.epochs)
        server = None
        live_engine: LocalEngine | SGLangEngine | None
        if r.cluster != "ray":  # in-process workers share the engine object
            engine_spec, live_engine = EngineSpec(), engine
        elif isinstance(engine, SGLangEngine):  # engine.kind = "sglang": Ray workers attach
            engine_spec, live_engine = EngineSpec.http([c.url for c in engine.clients]), None
        else:  # the embedded engine served over loopback HTTP to Ray workers
            from palaestra.engines.serve.serve import start_server

            server = await start_server(engine, port=0)
            engine_spec = EngineSpec.http([server.url])
            live_engine = None
        from palaestra.rollout.rewards import reward_client

        # [[rewards]]: reward models/judges score each episode as it finishes (None: the env's)
        rewards = reward_client(cfg.rewards, cfg.reward_worker, r.cluster)
        worker_cfg = WorkerConfig(
            engine=engine_spec, agent=spec, sampling=r.sampling(),
            env_kwargs={cfg.env.id: run_env_kwargs(cfg)}, max_turns=r.max_turns,
            seed_sampling=True,  # a seed per request: no sample depends on a shared RNG stream
            rewards=rewards,
        )
        # [rollout] is the manager's own config (checked when the config loaded)
        manager = RolloutManager(data, worker_cfg, r, engine=live_engine, seed=cfg.seed,
                                 exact=r.mode == "sync")
        if r.mode == "sync" and r.over_sampling > 1:
            print(f"[rl] rollout.over_sampling = {r.over_sampling} draws nothing ahead in sync "
                  "mode (exact batches: groups drawn ahead would finish by timing); it applies "
                  "in async mode", flush=True)
        from palaestra.run.fleet.weight_pushes import build_push
        from palaestra.run.phases.distill import build_learner

        rl = cls(cfg, run, policy_path, spec, engine, sync, backend=backend, critic=critic,
                 learner=build_learner(cfg, backend, critic), push=build_push(sync, backend),
                 manager=manager, rewards=rewards, server=server)
        from palaestra.run.parity import ParityCheck

        rl.parity = ParityCheck.build(cfg, engine, backend)
        return rl

    async def resume(self) -> int:
        """The first step: from the newest ``rl-*`` checkpoint (its weights pushed to the
        engines), else 0 (servers, which may hold anything, get the policy)."""
        cfg, run, backend = self.cfg, self.run, self.backend
        start_step = 0
        latest = run.latest_checkpoint("rl") if cfg.checkpoint.resume else None
        if latest is not None:
            state = backend.load(latest)  # the saved extras sit beside the backend's own keys
            # the extras `_save_rl` wrote: the step, the counters, the rollout state
            start_step = int(cast(int, state["rl_step"]))
            self.counts.update(cast("dict[str, int]", state.get("counts", {})))
            if self.critic is not None:
                self.critic.load(latest / "critic")
            self.manager.load_state_dict(cast("dict[str, object]", state["rollout"]))
            await self.push.push(start_step)
            run.truncate_metrics_after("rl", start_step - 1)
            print(f"resumed RL from {latest.name} (step {start_step})", flush=True)
        elif self.engine.weight_version != 0 or cfg.engine.kind == "sglang":
            await self.push.push(0)  # servers may hold anything: the policy
        return start_step

    async def start(self, start_step: int) -> None:
        """The progress bar, the admin endpoint of elastic engines, the benchmark evaluator."""
        cfg = self.cfg
        self.progress = progress(cfg.logging.progress, cfg.trainer.steps, start_step)
        from palaestra.run.fleet.admin import start_admin

        # engines join and leave while the steps run (`palaestra engines add|remove URL`)
        self.admin = await start_admin(cfg, self.run.root, self.engine, self.sync,
                                       self.policy_path, manager=self.manager)
        self.elastic = None if self.admin is None else self.admin.elastic
        if cfg.placement is not None and cfg.placement.colocate:  # sync mode (checked at load)
            from palaestra.run.fleet.colocate import ColocatedPhases

            self.colocated = ColocatedPhases(self.engine, [self.backend, self.critic])
            await self.colocated.start()  # the first rollout: the trainer in host memory
        if cfg.benchmark_eval.benchmarks:
            from palaestra.agents import load_tokenizer
            from palaestra.run.evaluation import training_evaluator

            self.evaluator = training_evaluator(
                cfg.benchmark_eval, tokenizer=load_tokenizer(self.policy_path),
                family=cfg.agent.family, max_context=cfg.agent.max_context,
                tools_in_prompt=cfg.agent.tools_in_prompt, run_dir=self.run.root)
            if cfg.benchmark_eval.keep_best is not None:
                self.best = BestModel(cfg.benchmark_eval.keep_best, self.run.root)

    def _note(self, line: str) -> None:
        if self.progress is not None:
            self.progress.note(line)

    async def step(self, step: int) -> None:
        """One RL step: batch, update(s), weights to the engines, metrics, evaluation,
        checkpoint."""
        cfg, run, elastic = self.cfg, self.run, self.elastic
        if elastic is not None:  # joining engines get the weights of version `step`
            await elastic.apply_joins(self.push, version=step, step=step)
        t0 = time.perf_counter()
        batch = await self.manager.generate_batch(step)
        # rollout/full_vocab_*: both sides still hold the weights that sampled the batch
        parity = await self.parity.step(batch.samples, step) if self.parity is not None else {}
        t1 = time.perf_counter()
        if self.colocated is not None:  # the engine frees the GPU, the trainer comes back
            await self.colocated.to_train()
        update = await asyncio.to_thread(self.learner.update, batch.samples, step)
        if batch.failed:
            self.counts["failed_episodes"] += run.log_failures("rl", step, batch.failed)
            self._note(failure_line(step, batch, run))
        for what in update.skipped:
            self.counts["skipped_steps"] += 1
            self._note(f"[rl step {step}] {what}: the optimizer step was skipped "
                       f"({self.counts['skipped_steps']} so far)")
        t2 = time.perf_counter()
        with span("weight_sync"):
            sync_times = await self._push_weights(step + 1)
        t3 = time.perf_counter()
        record = step_record(step, batch.metrics, update.metrics, sync_times,
                              rollout_s=t1 - t0, train_s=t2 - t1, sync_s=t3 - t2,
                              warmup_steps=cfg.warmup.steps)
        record.update(self.push.metrics())
        record.update(update.mismatch)  # rollout/logprob_{max,mean}_abs_diff
        record.update(parity)  # rollout/full_vocab_{logprob_max_abs_diff,tv,...}
        record.update(update.extra)  # distill/reverse_kl (with a teacher)
        if self.colocated is not None:  # memory/{rollout,train}_gib, memory/offloaded_gib
            record.update(self.colocated.metrics())
        record.update(self._engine_deltas())
        if elastic is not None:  # engines/count, added, removed, requests per engine
            record.update(elastic.metrics())
        record.update(update.times)  # PPO's breakdown: time/values_s, time/actor_update_s
        record["train/skipped_steps"] = self.counts["skipped_steps"]
        release_freed_memory()  # what the rollout's threads freed (host_memory says why)
        record["host/rss_gib"] = resident_gib()
        if self.evaluator is not None and self.evaluator.due(step + 1):
            evaluated = await self.evaluator.evaluate(self.engine, step + 1)
            record.update(evaluated)
            if self.best is not None:
                async with (self.colocated.resident() if self.colocated is not None
                            else nullcontext()):  # FSDP2's gathers need the GPU copy
                    self.best.consider(step + 1, evaluated, self._export_policy)
                record.update(self.best.metrics())
        run.log_metrics(record)
        if self.progress is not None:
            self.progress.update(record)
        if cfg.eval.interval and (step + 1) % cfg.eval.interval == 0 \
                and step + 1 < cfg.trainer.steps:
            await evaluate_stage(cfg, run, self.engine, self.spec, f"step-{step + 1}", step + 1)
        await self.checkpoint(step + 1)

    async def _push_weights(self, version: int) -> dict[str, float]:
        """The backend's weights to the engines as ``version`` while the rollout manager holds
        generation paused; the time of each phase (``pause_s``, ``push_s``, ``resume_s``)."""
        elastic, colocated = self.elastic, self.colocated
        # colocated: engine weights back, push, trainer out, KV cache back
        async with (self.manager.weights_paused(version) as times,
                    colocated.to_rollout() if colocated is not None else nullcontext()):
            if elastic is not None:  # servers that stopped answering leave first
                await elastic.settle()
            await self.push.push(version)
            if elastic is not None:
                elastic.version = version
        return times

    def _engine_deltas(self) -> dict[str, float]:
        """The embedded engine's scheduler this step (``engine/decode_s``, ``engine/host_s``,
        steps and tokens): how much of the rollout the GPU computed and how much it waited."""
        if not isinstance(self.engine, EngineStats):  # servers: their own /get_server_info
            return {}
        stats = self.engine.stats
        keys = ("prefill_s", "decode_s", "host_s", "active_s", "decode_calls", "decode_steps",
                "decode_early_ends", "prefill_steps", "prefill_tokens", "generated_tokens")
        now = {k: float(stats[k]) for k in keys if isinstance(stats.get(k), (int, float))}
        before, self._engine_seen = self._engine_seen, now
        return {f"engine/{k}": v - before.get(k, 0.0) for k, v in now.items()}

    async def checkpoint(self, step: int) -> None:
        """Save after ``step`` steps when one is due (every ``checkpoint.interval``, the last)."""
        cfg = self.cfg
        if step % cfg.checkpoint.interval == 0 or step == cfg.trainer.steps:
            # async mode: the episodes in flight are saved whole (they go on after a
            # crash from their last completed turn); sync mode has none in flight here
            rollout = await self.manager.checkpoint_state()
            if self.colocated is None:
                _save_rl(cfg, self.run, self.backend, self.manager, step, self.counts,
                         self.critic, rollout=rollout)
                return
            async with self.colocated.resident():  # FSDP2's gathers need the GPU copy
                _save_rl(cfg, self.run, self.backend, self.manager, step, self.counts,
                         self.critic, rollout=rollout)

    def _export_policy(self, directory: Path) -> None:
        """The policy as it is now, a Hugging Face folder with the settings it plays under."""
        self.backend.export_hf(directory)
        self._record_settings(directory)

    def _record_settings(self, directory: Path) -> None:
        """`palaestra eval --model <directory>` plays as the held-out evaluation did."""
        from palaestra.trained_settings import record_trained_settings

        cfg = self.cfg
        record_trained_settings(directory, self.spec, cfg.rollout.sampling(cfg.eval.temperature),
                                env_id=cfg.env.id, env_kwargs=cfg.env.kwargs)

    def finish(self) -> None:
        """The trained policy as a Hugging Face folder (tokenizer included): `palaestra eval
        --model <out>/final-model`, SGLang or transformers load it as it is; with the settings
        it was trained under."""
        backend, root = self.backend, self.run.root
        adapter = backend if isinstance(backend, AdapterTrainer) else None
        lora = None if adapter is None else adapter.lora
        if adapter is not None and lora is not None:  # LoRA: the peft adapter folder
            adapter.export_adapter(root / "final-adapter")
        if lora is None or lora.export_merged:
            backend.export_hf(root / "final-model")  # LoRA: the adapter merged
        if self.critic is not None:  # the value model beside it (*ForTokenClassification)
            self.critic.export_hf(root / "final-critic")
        self._record_settings(root / ("final-model" if (root / "final-model").is_dir()
                                      else "final-adapter"))  # LoRA, export_merged = false

    async def close(self) -> None:
        """Stop what `setup` and `start` started (in the reverse order of their need)."""
        if self.progress is not None:
            self.progress.close()
        if self.admin is not None:
            await self.admin.close()
        if self.rewards is not None:
            await self.rewards.close()
        if self.server is not None:
            await self.server.close()
        if isinstance(self.backend, Closeable):  # a trainer group: its actors, placement group
            self.backend.close()


def _save_rl(cfg: TrainConfig, run: RunDir, backend: TrainerBackend[TrainBatch, LossConfig],
             manager: RolloutManager, step: int,
             counts: Counter[str], critic: Critic | None = None,
             rollout: dict[str, object] | None = None) -> None:
    directory = run.checkpoint_dir("rl", step)
    if critic is not None:  # before the policy: the checkpoint is complete with both or none
        critic.save(directory / "critic", extra={"rl_step": step})
    rollout = manager.state_dict() if rollout is None else rollout
    backend.save(directory, extra={"rl_step": step, "rollout": rollout,
                                   "counts": dict(counts)})
    run.mark_complete(directory)
    run.write_state({"phase": "rl", "step": step})
    run.prune_checkpoints("rl", cfg.checkpoint.keep_last)


__all__ = ["RLRun", "run_rl"]
