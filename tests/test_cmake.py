"""CMakeLists.txt builds the C++ kernels as a library (plus the CUDA kernels where nvcc exists) and the
C++ tests pass under ctest."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_cmake_build_and_ctest(tmp_path):
    ninja = os.path.join(os.path.dirname(sys.executable), "ninja")
    gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if os.path.exists(ninja) else []
    env = dict(os.environ)
    cfg = subprocess.run(
        [
            "cmake",
            "-S",
            ROOT,
            "-B",
            str(tmp_path),
            *gen,
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert cfg.returncode == 0, cfg.stdout[-3000:] + cfg.stderr[-3000:]
    b = subprocess.run(["cmake", "--build", str(tmp_path), "-j", "2"], capture_output=True, text=True, env=env)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    t = subprocess.run(["ctest", "--output-on-failure"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert t.returncode == 0, t.stdout[-3000:] + t.stderr[-3000:]
    assert "100% tests passed" in t.stdout
