"""Checks that run before a request is queued, so bad input gets a 400 that says why.

Token ids must be inside the model's vocabulary, sequences inside its context, every
``loss_fn_inputs`` tensor as long as the datum's tokens, the loss one this server computes, and
a batch or a sampling request within the server's limits (`Limits`, set by the command's
flags). A refused request is never queued, so it cannot stall the requests behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from palaestra.tinker_api.errors import ApiError, not_served
from palaestra.tinker_api.losses import CONFIG_KEYS, OPTIONAL_INPUTS, REFUSED, REQUIRED_INPUTS
from palaestra.tinker_api.wire import TrainBatch, TrainDatum

#: inputs read as token ids; every other loss input is read as float32
INT_INPUTS = ("target_tokens",)


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    vocab_size: int
    max_context: int
    max_batch_datums: int = 1024
    max_batch_tokens: int = 65536
    max_num_samples: int = 128
    max_sample_tokens: int = 4096


def check_tokens(tokens: Sequence[int], limits: Limits, what: str) -> None:
    """Ids inside the vocabulary, a length inside the context."""
    if not tokens:
        raise ApiError(f"{what} has no tokens")
    if len(tokens) > limits.max_context:
        raise ApiError(f"{what} has {len(tokens)} tokens, more than the model's context of "
                       f"{limits.max_context}")
    arr = np.asarray(tokens, dtype=np.int64)
    bad = arr[(arr < 0) | (arr >= limits.vocab_size)]
    if bad.size:
        raise ApiError(f"{what} has token id {int(bad[0])} outside the vocabulary "
                       f"[0, {limits.vocab_size})")


def check_loss_fn(loss_fn: str) -> None:
    """A loss this server computes; the ones it refuses say why."""
    if loss_fn in REFUSED:
        raise not_served(f"loss_fn {loss_fn!r}", REFUSED[loss_fn])
    if loss_fn not in REQUIRED_INPUTS:
        raise ApiError(f"unknown loss_fn {loss_fn!r}; served: {', '.join(REQUIRED_INPUTS)}")


def _check_datum(i: int, datum: TrainDatum, loss_fn: str, limits: Limits) -> None:
    check_tokens(datum.tokens, limits, f"datum {i}'s model_input")
    n = len(datum.tokens)
    targets = datum.inputs.get("target_tokens")
    if targets is None:
        raise ApiError(f"datum {i} has no loss_fn_inputs['target_tokens']")
    if targets.ndim not in (1, 2) or targets.shape[0] != n:
        raise ApiError(f"datum {i}: target_tokens has shape {list(targets.shape)} but the "
                       f"model_input has {n} tokens (they must have the same length)")
    if targets.ndim == 2 and loss_fn != "cross_entropy":
        raise ApiError(f"datum {i}: 2-D target_tokens are served for cross_entropy only")
    check_tokens(targets.reshape(-1).tolist(), Limits(limits.vocab_size, targets.size),
                 f"datum {i}'s target_tokens")
    allowed = {"target_tokens", *REQUIRED_INPUTS[loss_fn], *OPTIONAL_INPUTS.get(loss_fn, ())}
    for name in REQUIRED_INPUTS[loss_fn]:
        if name not in datum.inputs:
            raise ApiError(f"datum {i}: loss_fn {loss_fn!r} needs loss_fn_inputs[{name!r}]")
    for name, arr in datum.inputs.items():
        if name not in allowed:
            raise ApiError(f"datum {i}: loss_fn_inputs[{name!r}] is not read by {loss_fn!r} "
                           f"(it reads {', '.join(sorted(allowed))})")
        if name != "target_tokens" and arr.shape != targets.shape:
            raise ApiError(f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(arr.shape)}, "
                           f"target_tokens {list(targets.shape)} (they must match)")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise ApiError(f"datum {i}: loss_fn_inputs[{name!r}] has a NaN or infinity")


def check_batch(batch: TrainBatch, limits: Limits) -> None:
    """A forward/backward request this server can run."""
    check_loss_fn(batch.loss_fn)
    if not batch.data:
        raise ApiError("the request has no data")
    if len(batch.data) > limits.max_batch_datums:
        raise ApiError(f"the batch has {len(batch.data)} datums, more than this server's "
                       f"--max-batch-datums {limits.max_batch_datums}")
    total = sum(len(d.tokens) for d in batch.data)
    if total > limits.max_batch_tokens:
        raise ApiError(f"the batch has {total} tokens, more than this server's "
                       f"--max-batch-tokens {limits.max_batch_tokens}")
    known = CONFIG_KEYS.get(batch.loss_fn, ())
    for key, value in batch.loss_fn_config.items():
        if key not in known:
            raise ApiError(f"loss_fn_config[{key!r}] is not read by {batch.loss_fn!r} (it reads "
                           f"{', '.join(known) or 'no config'})")
        if not isinstance(value, float) or not np.isfinite(value):
            raise ApiError(f"loss_fn_config[{key!r}] = {value!r}: a finite number is needed")
    for i, datum in enumerate(batch.data):
        _check_datum(i, datum, batch.loss_fn, limits)


def check_sample(prompt: Sequence[int], num_samples: int, max_tokens: int,
                 limits: Limits) -> None:
    """A sampling request this server can run."""
    check_tokens(prompt, limits, "the prompt")
    if not 1 <= num_samples <= limits.max_num_samples:
        raise ApiError(f"num_samples {num_samples} is outside 1..{limits.max_num_samples} "
                       "(--max-num-samples)")
    if not 0 <= max_tokens <= limits.max_sample_tokens:
        raise ApiError(f"max_tokens {max_tokens} is outside 0..{limits.max_sample_tokens}")
    if len(prompt) + max_tokens > limits.max_context:
        raise ApiError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the "
                       f"model's context of {limits.max_context}")


__all__ = ["INT_INPUTS", "Limits", "check_batch", "check_loss_fn", "check_sample",
           "check_tokens"]
