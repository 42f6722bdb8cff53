"""`make bench` cannot break unseen (issue 59: it collected no test and exited 2): every pytest-benchmark
microbenchmark runs once here, with timing off (``--benchmark-disable``) at small shapes (``FEDFAST_BENCH_SMOKE=1``:
a few clients, one tiny transformer, one whole command; the losses at 64 x 10), in a process of its
own as `make bench` runs them."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_every_microbenchmark_runs_once():
    env = {**os.environ, "FEDFAST_BENCH_SMOKE": "1"}
    for key in ("FEDFAST_BACKEND", "FEDFAST_BENCH_SHAPES", "FEDFAST_BENCH_DEVICE"):
        env.pop(key, None)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks", "--benchmark-disable", "-q", "-p", "no:warnings", "-x"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    last = r.stdout.strip().splitlines()[-1]
    assert " passed" in last and "failed" not in last, last
    assert int(last.split(" passed")[0].split()[-1]) >= 60, last  # every benchmark file was collected
