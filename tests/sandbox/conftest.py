"""Sandbox test setup: plant host secrets before any sandbox starts (they must stay invisible)."""

from __future__ import annotations

import os

from sandbox_testutil import HOST_SECRET

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["PALAESTRA_TEST_SECRET"] = HOST_SECRET
os.environ["AWS_SECRET_ACCESS_KEY"] = HOST_SECRET
