"""Runs: the ``palaestra train`` application, the composition root on top of every component.

A run is assembled here from the learners (`palaestra.trainers`), the rollout
(`palaestra.rollout`), the engines (`palaestra.engines`), the envs and the evaluation harness
(`palaestra.benchmarks`); nothing below imports this package.

- ``cli``: ``palaestra train CONFIG``; ``config`` / ``config_checks``: the typed config tree and
  every problem at once; ``dry_run``: the resolved config and plan.
- ``loop``: `RLRun` (rollout -> train -> weight push, sync and async) and its phases:
  ``offline`` (SFT, DPO), ``reward_model`` (Bradley-Terry RM), ``critic`` (PPO's value model).
- ``builders``: config sections -> engines, backends, rollout; ``run_dir``: run directory and
  resume; ``services`` / ``retriever``: servers beside the run; ``evaluation`` / ``tasks``:
  held-out evaluation during training.
- Engines of a run: ``engine_sync`` (weight push), ``run_engines`` / ``engine_actors`` /
  ``server_launch`` (starting them), ``elastic`` / ``engines_cli`` (join and leave),
  ``placement`` / ``trainer_plan`` (GPU plans), ``colocate`` (time-sliced GPUs).

Importing this package is light: each module imports torch, ray or the engines inside the
functions that use them.
"""
