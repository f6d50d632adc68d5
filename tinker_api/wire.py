"""Protobuf bodies of the Tinker API, read and written with the SDK's generated module.

The SDK (0.25 and later) sends ``forward_backward`` as a ``tinker_public.ForwardBackwardRequest``
(``Content-Type: application/x-protobuf``) and asks for
``ForwardBackwardOutput`` and ``SampleResponse`` results as protobuf (``Accept:
application/x-protobuf``). This module turns the request into plain `TrainBatch` data (token
lists and numpy arrays) and the server's results back into protobuf bytes; the JSON form of a
forward/backward request (older SDKs) is read through the SDK's pydantic type. Nothing here
imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from palaestra.tinker_api.errors import ApiError, not_served

PROTO_CONTENT_TYPE = "application/x-protobuf"


@dataclass
class TrainDatum:
    """One datum: the input tokens and its loss inputs (``target_tokens``, ``weights``, ...)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class TrainBatch:
    """A forward or forward/backward request, decoded."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    data: list[TrainDatum]
    forward_only: bool = False


def _pb() -> Any:
    """The SDK's generated protobuf module (imported when a body is read or written)."""
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def _tensor_to_numpy(msg: Any) -> np.ndarray:
    """A public ``Tensor`` (dense or sparse CSR, padding 0) as a dense numpy array."""
    pb = _pb()
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64,
              pb.DTYPE_INT32: np.int32}
    dtype = dtypes.get(msg.dtype)
    if dtype is None:
        raise ApiError(f"tensor dtype {msg.dtype} is not served (float32, int64 or int32)")
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        if len(shape) != 2:
            raise ApiError(f"a sparse CSR tensor needs a 2-D shape, got {shape}")
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(crow) != shape[0] + 1 or len(col) != len(values) or (
                len(col) and (col.min() < 0 or col.max() >= shape[1])):
            raise ApiError(f"malformed sparse CSR tensor of shape {shape}")
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, col] = values
        return dense
    arr = np.frombuffer(msg.dense, dtype=dtype)
    if shape:
        if int(np.prod(shape)) != arr.size:
            raise ApiError(f"tensor of shape {shape} carries {arr.size} values")
        arr = arr.reshape(shape)
    return arr.copy()


def _chunk_tokens(chunk: Any) -> list[int]:
    kind = chunk.WhichOneof("chunk")
    if kind != "encoded_text":
        raise not_served(f"{kind or 'empty'} model-input chunks",
                         "the served models take text tokens only")
    return np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()


def decode_forward_backward(body: bytes) -> TrainBatch:
    """A protobuf ``ForwardBackwardRequest`` body (aiohttp has undone any Content-Encoding it
    supports; the client config asks the SDK not to compress)."""
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise ApiError(f"the forward_backward body is not a ForwardBackwardRequest: {exc}") from exc
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = []
    for datum in msg.data:
        tokens = [t for chunk in datum.model_input for t in _chunk_tokens(chunk)]
        inputs = {name: _tensor_to_numpy(t) for name, t in datum.loss_fn_inputs.items()}
        data.append(TrainDatum(tokens, inputs))
    return TrainBatch(msg.model_id, int(msg.seq_id), msg.loss_fn, config, data,
                      bool(msg.forward_only))


def decode_forward_backward_json(payload: Mapping[str, object], forward_only: bool) -> TrainBatch:
    """The JSON form (``ForwardBackwardRequest`` of older SDKs), checked by the SDK's type."""
    from pydantic import ValidationError
    from tinker.types._pydantic_types.forward_backward_input import ForwardBackwardInput

    try:
        fbi = ForwardBackwardInput.model_validate(payload.get("forward_backward_input"))
    except ValidationError as exc:
        raise ApiError(f"bad forward_backward_input: {exc}") from exc
    data = []
    for datum in fbi.data:
        try:
            tokens = datum.model_input.to_ints()
        except ValueError as exc:
            raise not_served("non-text model-input chunks", "the served models take text "
                             "tokens only") from exc
        inputs = {k: np.asarray(td.to_numpy()) for k, td in datum.loss_fn_inputs.items()}
        data.append(TrainDatum(tokens, inputs))
    seq_id = payload.get("seq_id")
    return TrainBatch(str(payload.get("model_id", "")),
                      int(seq_id) if isinstance(seq_id, int) else 0, fbi.loss_fn,
                      dict(fbi.loss_fn_config or {}), data, forward_only)


def _batched(arrays: Sequence[np.ndarray]) -> Any:
    """Per-datum arrays (same trailing shape) as one ``BatchedTensor``."""
    pb = _pb()
    floats = all(a.dtype.kind == "f" for a in arrays)
    dtype = np.float32 if floats else np.int64
    parts = [np.ascontiguousarray(a, dtype=dtype) for a in arrays]
    sizes = [p.nbytes for p in parts]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    trailing = list(parts[0].shape[1:]) if parts else []
    return pb.BatchedTensor(
        data=b"".join(p.tobytes() for p in parts), offsets=offsets.tobytes(),
        dtype=pb.DTYPE_FLOAT32 if floats else pb.DTYPE_INT64,
        trailing_shape=trailing)


def encode_forward_backward_output(outputs: Sequence[Mapping[str, np.ndarray]],
                                   metrics: Mapping[str, float]) -> bytes:
    """``ForwardBackwardOutput``: one ``ArrayRecord`` with a field per output name."""
    pb = _pb()
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in (outputs[0].keys() if outputs else ()):
        record.fields[name].CopyFrom(_batched([o[name] for o in outputs]))
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord",
                                   metrics={k: float(v) for k, v in metrics.items()})
    msg.loss_fn_outputs.append(record)
    return bytes(msg.SerializeToString())


@dataclass
class SampledOut:
    """One sampled sequence: tokens, their logprobs, ``stop`` or ``length``."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


@dataclass
class SampleOut:
    """A sampling answer: the sequences and, when asked, prompt logprobs (NaN where none) and
    top-k prompt logprobs (``[len(prompt), k]`` ids and logprobs)."""

    sequences: list[SampledOut]
    prompt_logprobs: list[float] | None = None
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None


def encode_sample_response(out: SampleOut) -> bytes:
    """``SampleResponse`` protobuf bytes."""
    pb = _pb()
    msg = pb.SampleResponse()
    for seq in out.sequences:
        msg.sequences.append(pb.SampledSequence(
            stop_reason=pb.STOP_REASON_STOP if seq.stop_reason == "stop"
            else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes()))
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(out.prompt_logprobs, dtype=np.float32).tobytes()
    if out.topk_ids is not None and out.topk_logprobs is not None:
        n, k = out.topk_ids.shape
        msg.topk_prompt_logprobs.CopyFrom(pb.TopkLogprobs(
            token_ids=out.topk_ids.astype(np.int32).tobytes(),
            logprobs=out.topk_logprobs.astype(np.float32).tobytes(), k=k, length=n))
    return bytes(msg.SerializeToString())


__all__ = ["PROTO_CONTENT_TYPE", "SampleOut", "SampledOut", "TrainBatch", "TrainDatum",
           "decode_forward_backward", "decode_forward_backward_json",
           "encode_forward_backward_output", "encode_sample_response"]
