"""Runs: the ``palaestra train`` application, the composition root on top of every component.

A run is assembled here from the learners (`palaestra.trainers`), the rollout
(`palaestra.rollout`), the engines (`palaestra.engines`), the envs and the evaluation harness
(`palaestra.benchmarks`); nothing below imports this package.

- ``cli``: ``palaestra train CONFIG``; ``config`` / ``config_checks``: the typed config tree and
  every problem at once; ``dry_run``: the resolved config and plan.
- ``train``: ``palaestra train`` end to end (warm start, RL, evaluations, curves); ``rl``:
  `RLRun`, one RL step (rollout -> learner update -> weight push, sync and async).
- ``phases``: ``offline`` (SFT, DPO), ``reward_model`` (Bradley-Terry RM), ``critic`` (PPO's
  value model), ``distill`` (the teacher; the learner of a step).
- ``fleet``: the engines of a run: ``engine_sync`` / ``weight_pushes`` (weight push),
  ``start`` / ``actors`` / ``launch`` / ``router`` (starting them), ``elastic`` (join and
  leave), ``placement`` (GPU plans), ``colocate`` (time-sliced GPUs).
- ``builders``: config sections -> engines, backends, rollout; ``run_dir``: run directory and
  resume; ``services`` / ``retriever``: servers beside the run; ``evaluation`` / ``tasks``:
  held-out evaluation during training; ``trainer_plan`` / ``cluster_fit``: the trainer
  group's plan and whether a Ray cluster fits the run; ``engines_cli``: ``palaestra engines``.

Importing this package is light: each module imports torch, ray or the engines inside the
functions that use them.
"""
