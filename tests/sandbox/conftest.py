"""Sandbox test setup: keep BLAS/OpenMP single-threaded on the shared 2-core machine."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
