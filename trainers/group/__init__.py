"""The trainer group: one Ray actor per trainer rank on the run's placement group.

``[placement] trainer_ranks = N`` (N > 1) makes ``palaestra train`` create a Ray placement group
from the plan (`palaestra.run.fleet.placement.plan_run`), start one `TrainerRank` actor per bundle,
each running one rank of the torch backend (FSDP2; gloo on CPU, NCCL on GPU) in one process group
rendezvousing at rank 0's address, and drive them through `TrainerGroup` (the same methods as a
backend: ``train_step``, ``forward_logprobs``, weights for the engines, ``save``/``load``,
``export_hf``, ``offload``/``onload``). One rank trains in the driver process, as before.

The plan itself (`palaestra.run.trainer_plan`) belongs to the run. Nothing heavy is imported here:
`group` and `actor` import Ray and torch inside their functions.
"""

from __future__ import annotations

__all__: list[str] = []
