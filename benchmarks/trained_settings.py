"""The settings a model was trained with (``trained_with.json``): moved to core.

The trainer writes the file and the benchmarks read it, so the format lives in
`palaestra.trained_settings` (trainers never import benchmarks); this path keeps working.
"""

from __future__ import annotations

from palaestra.trained_settings import (
    FILENAME,
    FORMAT,
    TrainedSettings,
    read_trained_settings,
    record_trained_settings,
)

__all__ = ["FILENAME", "FORMAT", "TrainedSettings", "read_trained_settings",
           "record_trained_settings"]
