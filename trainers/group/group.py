"""`TrainerGroup`: the trainer ranks of a run as Ray actors on one placement group.

`start` reserves the plan's trainer bundles (`palaestra.run.fleet.placement.RunPlan`: GPU bundles,
or CPU bundles on CPU nodes) as a Ray placement group (or, given ``placement_group``, starts in
an existing one of the whole plan: colocated engine actors reserved it, and rank r goes on bundle
``plan.trainer_bundles[r]`` beside engine r, asking ``plan.trainer_gpu_fraction`` of its GPU and
``plan.trainer_cpus``; the group then leaves it to its owner), starts one `TrainerRank` actor
per bundle, asks rank 0 for its address and a free port and has every rank join that process
group (NCCL on GPU, gloo on CPU) and load its backend: the torch backend sharded with FSDP2 (a
`TorchBackendConfig`), or Megatron-core with the tp/ep of a `MegatronBackendConfig` and data
parallelism over the rest of the world. The group has the backend's methods, so the loop drives
it as it drives one in-process backend:

- ``train_step(batch, loss_cfg)``: the batch is split by data-parallel rank with balanced token
  counts (`split_across_ranks`), the loss weights are computed once over the whole batch, and
  each data-parallel rank's shard goes into the object store with ``ray.put`` and reaches its
  ranks (every TP rank of it) as an object reference (no rank receives another data-parallel
  rank's sequences). Counts come back summed over data-parallel ranks.
- ``forward_logprobs``: the same shards; each data-parallel rank's rows are put back in batch
  order.
- ``push_weights(spec, version)``: every rank gathers the full weights, rank 0 sends them to the
  SGLang-compatible servers itself (`palaestra.trainers.group.push`); the weights never pass
  through the driver. `EngineSync` takes this path for servers.
- ``state_dict_for_engines`` / ``iter_engine_weight_buckets``: full weights from rank 0 into the
  driver, for the embedded engine, which lives there (counted in ``weight_relays``);
  ``save``/``load`` (one checkpoint, full state dicts), ``export_hf``, ``offload``/``onload``
  (host memory while a colocated engine serves), ``close``.

A rank that dies (its process, or its node) fails the call with `TrainerRankLost`, naming the
rank and its node, and saying that the next start resumes from the last checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from palaestra.errors import ConfigError, MissingExtraError, PalaestraError

if TYPE_CHECKING:
    import torch

    from palaestra.engines.weights.weight_transfer import TransferStats
    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.group.push import EnginePushSpec


class TrainerRankLost(PalaestraError, RuntimeError):
    """A trainer rank (its actor, process or node) died during a collective call."""


class TrainerGroup:
    """``len(plan.trainer_bundles)`` ranks of one backend as Ray actors (see the module doc)."""

    def __init__(self, model_path: str | Path, config: Any, plan: Any, *,
                 address: str | None = None, ready_timeout_s: float = 300.0,
                 placement_group: Any = None) -> None:
        self.model_path = Path(model_path)
        self.config = config
        self.plan = plan
        self.address = address
        self.ready_timeout_s = ready_timeout_s
        self.world_size = len(plan.trainer_bundles)
        self.actors: list[Any] = []
        self.ranks: list[dict[str, Any]] = []
        # an existing placement group of the whole plan (colocated engine actors reserved it:
        # rank r on its bundle ``plan.trainer_bundles[r]``, beside engine r); not removed here
        self.placement_group: Any = placement_group
        self._owns_placement_group = placement_group is None
        self._started_ray = False
        self._lost = False
        self.weight_relays = 0  # full state dicts brought into the driver (embedded engine)
        self.last_push: dict[str, Any] | None = None  # rank 0's answer to the last push
        self.last_senders: list[dict[str, Any]] = []  # the answers of the ranks that sent

    # ------------------------------------------------------------------------ lifecycle
    def start(self) -> TrainerGroup:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as exc:
            raise MissingExtraError.for_module("ray", "ray") from exc
        bundles = [dict(self.plan.bundles[b]) for b in self.plan.trainer_bundles]
        if not ray.is_initialized():
            self._started_ray = self.address is None and not os.environ.get("RAY_ADDRESS")
            kwargs: dict[str, Any] = {"include_dashboard": False}
            if self._started_ray:  # logical CPUs: the ranks, rollout workers and the driver
                need = sum(b.get("CPU", 0) for b in bundles)
                kwargs["num_cpus"] = max(os.cpu_count() or 1, int(need) + 4)
            ray.init(address=self.address, **kwargs)
        have = ray.cluster_resources()
        for key in ("GPU", "CPU"):
            need = sum(b.get(key, 0) for b in bundles)
            if need > have.get(key, 0):
                raise ConfigError(
                    f"the trainer group needs {need:g} {key} for {self.world_size} ranks but the "
                    f"Ray cluster has {have.get(key, 0):g}; lower placement.trainer_ranks or "
                    "placement.cpus_per_rank, or add nodes")
        if self._owns_placement_group:
            self.placement_group = placement_group(bundles, strategy=self.plan.strategy)
            indices = list(range(self.world_size))
        else:  # the plan's bundles: the trainer ranks' are plan.trainer_bundles
            indices = list(self.plan.trainer_bundles)
        try:
            ray.get(self.placement_group.ready(), timeout=self.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            from palaestra.ray_capacity import cluster_view

            view = cluster_view()
            raise ConfigError(
                f"the Ray cluster could not place the trainer bundles {bundles} with strategy "
                f"{self.plan.strategy} within {self.ready_timeout_s:.0f} s: it has "
                f"{view.describe('CPU')} and {view.describe('GPU')} (ray status shows what "
                "holds them); lower placement.trainer_ranks or placement.cpus_per_rank, free "
                "or add nodes, or raise rollout.start_timeout_s") from None
        from palaestra.trainers.group.actor import TrainerRank

        for rank, (bundle, index) in enumerate(zip(bundles, indices, strict=True)):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=index)
            # a colocated bundle also holds an engine actor: the rank asks its own share
            cpus = min(bundle.get("CPU", 0),
                       getattr(self.plan, "trainer_cpus", bundle.get("CPU", 0)))
            actor_cls = ray.remote(num_cpus=cpus,
                                   num_gpus=self.plan.trainer_gpu_fraction if bundle.get("GPU")
                                   else 0, max_restarts=0)(TrainerRank)
            self.actors.append(actor_cls.options(scheduling_strategy=strategy).remote(
                rank, self.world_size))
        if not self._owns_placement_group:
            print(f"[trainer group] {self.world_size} ranks on bundles {indices} of the engines' "
                  f"placement group {self.placement_group.id.hex()[:12]}", flush=True)
        addr, port = self._get([self.actors[0].address.remote()])[0]
        self.ranks = self._get([a.init.remote(str(self.model_path), self.config, addr, port)
                                for a in self.actors])
        return self

    def close(self) -> None:
        """Stop the ranks, free the placement group (and the Ray cluster this group started)."""
        import ray

        actors, self.actors = self.actors, []
        if actors and not self._lost:  # after a lost rank the others hang in a collective
            try:
                ray.get([a.shutdown.remote() for a in actors], timeout=30)
            except Exception:  # noqa: BLE001,S110 - a dead rank has nothing left to shut down
                pass
        for actor in actors:
            ray.kill(actor)
        if self.placement_group is not None and self._owns_placement_group:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
        self.placement_group = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> TrainerGroup:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------- calls
    def _get(self, refs: Sequence[Any]) -> list[Any]:
        """Every result; the first rank that fails fails the call at once (the others may be
        blocked in a collective that will never finish). A failure because a rank died (its
        own, or its peers' collective breaking) is `TrainerRankLost`."""
        import ray

        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                ray.get(done)
            return list(ray.get(list(refs)))
        except PalaestraError:
            raise
        except Exception as exc:
            died = isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError))
            lost = self._lost_ranks(wait_s=15.0 if not died else 5.0)
            if not lost and not died:
                raise
            self._lost = True
            where = ", ".join(f"rank {r} (node {self.ranks[r]['node']})" if r < len(self.ranks)
                              else f"rank {r}" for r in lost) or "a rank"
            raise TrainerRankLost(
                f"trainer {where} of {self.world_size} died ({type(exc).__name__}); the run "
                "stops here. Start `palaestra train` again with the same config: it resumes "
                "from the last checkpoint in the run directory") from exc

    def _lost_ranks(self, wait_s: float) -> list[int]:
        """Ranks whose actor is dead (Ray may take a few seconds to notice a lost node)."""
        import time

        import ray

        deadline = time.monotonic() + wait_s
        while True:
            lost = []
            probes = {actor.address.remote(): rank for rank, actor in enumerate(self.actors)}
            ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=2.0)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - any failure of a probe: the rank is gone
                    lost.append(probes[ref])
            if lost or time.monotonic() > deadline:
                return sorted(lost)

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (the world for FSDP2; world / (tp x pp) for Megatron)."""
        return int(self.ranks[0]["dp_size"]) if self.ranks else self.world_size

    def shards(self, batch: TrainBatch, loss_cfg: LossConfig | None = None
               ) -> tuple[list[list[int]], list[Any]]:
        """The sequence indices of each data-parallel rank (token-balanced) and an object ref
        per data-parallel rank holding its sub-batch and (with ``loss_cfg``) its sequences' loss
        weights over the whole batch."""
        import ray

        from palaestra.trainers.algorithms.objective import batch_loss_weights
        from palaestra.trainers.micro_batches import split_across_ranks

        parts = split_across_ranks(batch.lengths, self.dp_size, units=batch.units())
        if any(not p for p in parts):
            raise ConfigError(
                f"a batch of {batch.num_sequences} sequences cannot feed {self.dp_size} "
                "data-parallel trainer ranks; raise rollout.batch_size x group_size or lower "
                "placement.trainer_ranks")
        weights = batch_loss_weights(batch, loss_cfg) if loss_cfg is not None else None
        refs = [ray.put((batch.select(p), None if weights is None else [weights[i] for i in p]))
                for p in parts]
        return parts, refs

    def _dp_of(self, rank: int) -> int:
        return int(self.ranks[rank]["dp_rank"]) if self.ranks else rank

    def _leaders(self) -> list[int]:
        """One rank per data-parallel rank (TP rank 0): whose counts and rows are taken."""
        return [r for r, info in enumerate(self.ranks) if info.get("dp_leader", 1)]

    # ------------------------------------------------------------- the backend's methods
    def train_step(self, batch: TrainBatch, loss_cfg: LossConfig) -> dict[str, float]:
        _, refs = self.shards(batch, loss_cfg)
        results = self._get([a.train_step.remote(refs[self._dp_of(r)], loss_cfg)
                             for r, a in enumerate(self.actors)])
        out = dict(results[0])  # all-reduced on the ranks: the same everywhere
        leaders = [results[r] for r in self._leaders()]
        for key in ("num_tokens", "num_loss_tokens"):
            out[key] = float(sum(r[key] for r in leaders))
        out["step_time_s"] = max(r["step_time_s"] for r in results)
        return out

    def forward_logprobs(self, batch: TrainBatch, *, ref: bool = False) -> list[torch.Tensor]:
        parts, refs = self.shards(batch)
        results = self._get([a.forward_logprobs.remote(refs[self._dp_of(r)], ref)
                             for r, a in enumerate(self.actors)])
        rows: list[Any] = [None] * batch.num_sequences
        for rank in self._leaders():
            for i, v in zip(parts[self._dp_of(rank)], results[rank]):
                rows[i] = v
        return rows

    def push_weights(self, spec: EnginePushSpec, version: int, *, keep: bool = True
                     ) -> TransferStats:
        """Every rank gathers the full weights, rank 0 sends them to ``spec``'s servers as
        ``version``, or each rank to the server beside it (ipc on shared bundles:
        `EnginePushSpec.for_rank`); the driver receives only the senders' timings."""
        from palaestra.engines.weights.weight_transfer import TransferStats

        answers = self._all("push_weights", spec, version, keep)
        self.last_push = answers[0]
        self.last_senders = [a for a in answers if a["stats"] is not None]
        sent = [a["stats"] for a in self.last_senders]
        if len(sent) == 1:
            return sent[0]  # type: ignore[no-any-return]
        # ranks sending side by side (each to its own server): the slowest, and all the bytes
        return TransferStats(max(t.seconds for t in sent), sum(t.num_bytes for t in sent),
                             sum(t.num_tensors for t in sent), sum(t.num_buckets for t in sent))

    def state_dict_for_engines(self, *, dtype: Any = None,
                               device: Any = "cpu") -> dict[str, Any]:
        """Full weights gathered on rank 0 (a collective of all ranks), here on ``device``: the
        embedded engine's path (servers get them from rank 0 itself: `push_weights`)."""
        self.weight_relays += 1
        full = self._all("state_dict_for_engines", dtype, "cpu")[0]
        if str(device) == "cpu":
            return full  # type: ignore[no-any-return]
        return {k: v.to(device) for k, v in full.items()}

    def iter_engine_weight_buckets(self, bucket_bytes: int = 512 << 20, *, dtype: Any = None,
                                   device: Any = "cpu") -> Iterator[list[tuple[str, Any]]]:
        from palaestra.engines.weights.weight_transfer import bucketize

        return bucketize(self.state_dict_for_engines(dtype=dtype, device=device).items(),
                         bucket_bytes)

    def save(self, directory: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
        return Path(self._all("save", str(directory), extra)[0])

    def load(self, directory: str | Path) -> dict[str, Any]:
        return self._all("load", str(directory))[0]  # type: ignore[no-any-return]

    def export_hf(self, directory: str | Path, *, dtype: Any = None) -> Path:
        if dtype is not None:
            raise ConfigError("TrainerGroup.export_hf exports in the training dtype")
        return Path(self._all("export_hf", str(directory))[0])

    @property
    def step(self) -> int:
        return int(self._all("step")[0])

    def offload(self) -> list[dict[str, float]]:
        """Every rank's weights, gradients and optimizer state to host memory; GPU memory after."""
        return self._all("offload")

    def onload(self) -> list[dict[str, float]]:
        return self._all("onload")

    def memory(self) -> list[dict[str, float]]:
        return self._all("memory")


__all__ = ["TrainerGroup", "TrainerRankLost"]
