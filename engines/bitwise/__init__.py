"""The batch-invariant forward shared by the embedded engine and the torch trainer (bitwise
on-policy mode), and what both read to build it:

- ``decoder_config``: a model's shape (`DecoderConfig`) and rotary tables;
- ``invariant`` / ``invariant_triton``: batch-invariant operations (the same bits whatever the
  batch a row is in), in torch and in Triton;
- ``forward``: the forward over the fused layout (`BitwiseWeights`), prefill and decode;
- ``lora_merge``: an adapter merged into its base weight with the same bits on both sides.

The trainer imports these modules, never the engine's internals (`palaestra.engines.local`).
"""
