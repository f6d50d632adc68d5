"""PPO with a learned critic: the ``[critic]`` section, the critic backend and the PPO step.

- ``config``: `CriticSection` (torch-free; a field of `TrainConfig`)
- ``critic``: `build_critic`, the value model's backend (torch or Megatron) beside the policy
- ``step``: `ppo_step`, one rollout batch through values, GAE and the actor/critic epochs
- ``stats``: explained variance, value/return/advantage statistics of a batch

Nothing is imported here, so ``palaestra.trainers.ppo.config`` stays light.
"""
