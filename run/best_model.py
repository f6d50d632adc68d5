"""The best policy by a validation metric: ``[benchmark_eval] keep_best`` exports the policy to
``<out>/best-model`` each time that metric beats every earlier evaluation of the run.

A run that overfits its training questions (a small RL set, many steps) peaks before its last
step; this keeps the peak, chosen on a validation benchmark and not on the held-out set. The
selection (step and value) is written beside the weights as ``selected.json``, and read back when
a killed run resumes, so that a resumed run selects as the uninterrupted one would.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

#: the folder, under the run's root, that holds the selected policy
BEST_MODEL_DIR = "best-model"
SELECTION_FILE = "selected.json"


class BestModel:
    """Tracks ``metric`` over a run's evaluations and exports the policy when it improves."""

    def __init__(self, metric: str, root: str | Path) -> None:
        self.metric = metric
        self.directory = Path(root) / BEST_MODEL_DIR
        self.step: int | None = None
        self.value = -math.inf
        selection = self.directory / SELECTION_FILE
        if selection.is_file():  # a resumed run: the peak so far
            saved = json.loads(selection.read_text())
            if saved.get("metric") == metric:
                self.step, self.value = int(saved["step"]), float(saved["value"])

    def consider(self, step: int, metrics: Mapping[str, float],
                 export: Callable[[Path], object]) -> bool:
        """Export with ``export(directory)`` when ``metrics[metric]`` beats the best so far (a
        tie keeps the earlier policy); whether it did. A step whose evaluation lacks the metric
        (every episode failed) is never selected."""
        value = metrics.get(self.metric)
        if value is None or not math.isfinite(value) or value <= self.value:
            return False
        # written beside and swapped in whole: a run killed mid-export keeps the earlier best
        staging = self.directory.with_name(self.directory.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        export(staging)
        (staging / SELECTION_FILE).write_text(json.dumps(
            {"metric": self.metric, "step": step, "value": float(value)}) + "\n")
        shutil.rmtree(self.directory, ignore_errors=True)
        staging.rename(self.directory)
        self.step, self.value = step, float(value)
        return True

    def metrics(self) -> dict[str, float]:
        """``best/step`` and ``best/value`` for the training log (nothing before the first)."""
        if self.step is None:
            return {}
        return {"best/step": float(self.step), "best/value": self.value}


__all__ = ["BEST_MODEL_DIR", "BestModel"]
