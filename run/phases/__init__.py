"""The phases of a run besides the RL steps, and the learner set-ups of the RL step:
``offline`` (SFT, DPO, the RL warm start), ``reward_model`` (Bradley-Terry RM), ``critic``
(PPO's value model) and ``distill`` (on-policy distillation's teacher, the learner of a step).
"""
