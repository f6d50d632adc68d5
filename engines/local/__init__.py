"""The embedded engine (`LocalEngine`): our own torch generation loop and its parts.

`local` (the scheduler and continuous batching), `model` (the Qwen/Llama decoder), `moe` and
`deepseek` (mixture-of-experts and MLA layers), `kv_cache` and `prefix_cache`, `cuda_graphs`,
`decode_attention`, `sampling` and `lora` (adapters served beside the base weights).
"""
