"""Shared set-up of the pytest-benchmark microbenchmarks (``make bench``; ``tests/test_bench_smoke.py`` runs each
once with ``--benchmark-disable`` and ``FEDFAST_BENCH_SMOKE=1``, small shapes, so the command cannot break)."""

import os
import sys

if os.environ.get("FEDFAST_BENCH_DEVICE", "cuda" if "--gpu" in sys.argv else "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "0")
