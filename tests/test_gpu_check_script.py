"""scripts/gpu_check.sh's own logic, on a machine without a GPU: an unknown stage and a stage past DEADLINE are
reported in the log and the exit status (a device call is killed at 600 s: the script must end, log written,
before that), and a stage that fits runs with its limit shown."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *stages, **env):
    e = dict(
        os.environ,
        OUT=str(tmp_path),
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        **{k: str(v) for k, v in env.items()},
    )
    p = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), *stages],
        env=e,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return p.returncode, (tmp_path / "gpu_check.log").read_text()


def test_stage_past_the_deadline_is_skipped_and_reported(tmp_path):
    rc, log = _run(tmp_path, "bogus", "test", DEADLINE=1)
    assert rc == 1
    assert "unknown stage bogus" in log
    assert "=== test: skipped" in log and "DEADLINE=1" in log
    assert "FAILED stages: bogus test(skipped)" in log


def test_a_stage_that_fits_runs_with_its_limit(tmp_path):
    rc, log = _run(tmp_path, "test", DEADLINE=400, STAGE_TIMEOUT=200)
    assert "=== test (limit 200 s)" in log  # the stage timeout, under the time left
    assert "=== test: exit 0" in log and rc == 0, log[-2000:]  # the GPU tests skip here, and pass
