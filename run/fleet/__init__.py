"""The engine fleet of a run: where the engines run, how they start, how they get weights.

- ``placement``: GPU plans (placement groups and bundles) from ``[placement]``;
- ``start`` / ``actors`` / ``launch`` / ``router``: engines as Ray actors on their bundles,
  servers the run launches itself, the router in front of them;
- ``engine_sync`` / ``weight_pushes``: the weight path to the engines and one push class per
  path, built once per run;
- ``colocate``: trainer and engine time-slicing one GPU;
- ``elastic``: engines joining and leaving a running run.
"""
