"""A Tinker-compatible training and sampling server over palaestra's engine and torch trainer.

``palaestra tinker-server --model DIR`` serves the REST API that the ``tinker`` SDK (0.38)
speaks, protobuf bodies included, so SDK scripts and tinker-cookbook recipes train LoRA
adapters of a local model: several training clients at once on one base model, each with its
own adapter and optimizer, and sampling from any of them through one embedded engine. The
SDK's own generated protobuf module and pydantic types are used on the server side, so the
component needs the ``tinker`` extra (``pip install 'palaestra[tinker]'``); nothing here is
imported by ``import palaestra``. See docs/tinker.md.
"""
