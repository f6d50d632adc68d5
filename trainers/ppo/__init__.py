"""PPO with a learned critic: the ``[critic]`` section, the critic backend and the PPO step.

- ``config``: `CriticSection` (torch-free; a field of `TrainConfig`); the critic's backend is
  built by the run (`palaestra.run.phases.critic`)
- ``step``: `ppo_step`, one rollout batch through values, GAE and the actor/critic epochs
- ``stats``: explained variance, value/return/advantage statistics of a batch

Nothing is imported here, so ``palaestra.trainers.ppo.config`` stays light.
"""
