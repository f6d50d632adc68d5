"""Named host-time ranges for a profiled step, free when no step is being profiled.

The code that can keep a GPU waiting marks itself with a cause, one line at its call site::

    with trace_ranges.span("tokenization"):
        ids = encode(text)

While no recorder is on, `span` returns one shared no-op context manager (a global read and a
call: ~0.1 us; nothing is imported). `record` turns recording on for the duration of a block and
collects every range closed meanwhile, on every thread (the embedded engine computes on its own
thread and the trainer in a worker thread, which ``torch.profiler``'s ``record_function`` does
not see), as ``(cause, start_ns, end_ns, thread id)`` on `time.perf_counter_ns`'s clock. The
loop benchmark's ``--trace`` sets them against a ``torch.profiler`` trace's kernel timeline
(`palaestra.benchmarks.perf.idle`).

The causes (`CAUSES`, finest first: where ranges nest or overlap, the first one active names the
instant):

- ``tokenization``: encoding and decoding text (the agent's template deltas, stop strings);
- ``admission_stop``: the engine scheduler's admission and its per-token stop checks;
- ``http_serialization``: requests and responses of a served engine (client side);
- ``weight_sync``: weights from the trainer to the engine;
- ``optimizer``: gradient clipping and the optimizer step;
- ``trainer_data``: samples to a train batch, micro-batches, their copy to the device;
- ``engine_step``: the embedded engine's prefill/decode call on its thread (batch assembly,
  kernel launches, sampling, the wait for its tokens): engine scheduler host time where the GPU
  is idle;
- ``train_compute``: the trainer's forward and backward passes (launches where the GPU is idle);
- ``env_agent``: env resets and steps, the agent's turn parsing and observation handling.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Literal

Cause = Literal["tokenization", "admission_stop", "http_serialization", "weight_sync",
                "optimizer", "trainer_data", "engine_step", "train_compute", "env_agent"]
CAUSES: tuple[Cause, ...] = ("tokenization", "admission_stop", "http_serialization",
                             "weight_sync", "optimizer", "trainer_data", "engine_step",
                             "train_compute", "env_agent")

Range = tuple[str, int, int, int]  # cause, start ns, end ns, thread id

_NULL = contextlib.nullcontext()
_recording: list[Range] | None = None  # the ranges of the running `record`, else None


class _Span:
    __slots__ = ("cause", "sink", "start")

    def __init__(self, cause: str, sink: list[Range]) -> None:
        self.cause, self.sink = cause, sink
        self.start = 0

    def __enter__(self) -> None:
        self.start = time.perf_counter_ns()

    def __exit__(self, *exc: object) -> None:
        # list.append is atomic under the GIL: threads record without a lock
        self.sink.append((self.cause, self.start, time.perf_counter_ns(),
                          threading.get_ident()))


def span(cause: Cause) -> contextlib.AbstractContextManager[None]:
    """A range of ``cause`` while a `record` is on; a shared no-op otherwise."""
    sink = _recording
    if sink is None:
        return _NULL
    return _Span(cause, sink)


@contextlib.contextmanager
def record() -> Iterator[list[Range]]:
    """Record every `span` closed inside the block (all threads); yields the growing list."""
    global _recording
    if _recording is not None:
        raise RuntimeError("trace_ranges.record() is already on")
    ranges: list[Range] = []
    _recording = ranges
    try:
        yield ranges
    finally:
        _recording = None


__all__ = ["CAUSES", "Cause", "Range", "record", "span"]
