"""Helpers the pytest-benchmark files share."""

import os

SMOKE = os.environ.get("FEDFAST_BENCH_SMOKE") == "1"  # one run of each benchmark at small shapes


def median(benchmark):
    """The timed rounds' median in seconds, or None when timing is off (``--benchmark-disable``: the function ran
    once, a smoke test, and there is nothing to record)."""
    stats = getattr(benchmark, "stats", None)
    return None if getattr(benchmark, "disabled", False) or stats is None else stats.stats.median
