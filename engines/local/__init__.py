"""The embedded engine (`LocalEngine`): our own torch generation loop and its parts.

`local` (the `LocalEngine` facade), `scheduler` (admission and the prefill/decode loop),
`slots` (the running batch's KV slots and the prefix cache behind them), `batch_sampling` (a
batch's sampling step), `runner` (the compute calls, the engine's stream, CUDA graphs hook-up),
`request` (the request record); `model` (the Qwen/Llama decoder), `moe` and `deepseek`
(mixture-of-experts and MLA layers), `kv_cache` and `prefix_cache`, `cuda_graphs`,
`decode_attention`, `sampling` and `lora` (adapters served beside the base weights).
"""
