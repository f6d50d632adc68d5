"""How new weights reach the engines: the transfer wire
formats and process groups (`weight_transfer`, `weight_group`), and the tensor payloads sent
over HTTP or CUDA IPC (`tensor_payload`, `ipc_payload`).
"""
