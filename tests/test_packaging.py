"""fedfast as a library user gets it: the sdist and the wheel built from a clean copy of the checkout, installed into
a fresh virtual environment that holds only the pinned torch, and used from a directory outside the checkout.

One module-scoped environment serves every test here (the build and the environment take about 90 s on 2 cores).
pip fetches what a user's pip would from the package index: numpy for the fresh environment, setuptools and wheel
for the isolated builds. What is checked:

* ``make dist``'s build (sdist, then the wheel from that sdist): the sdist carries csrc/ and kernels/, the wheel
  the compiled CPU library and the presets;
* in the fresh environment: ``fedfast --version``, ``fedfast doctor``, ``fedfast presets``, a 2-round ``fedfast run``,
  ``fedfast.nn.NTDLoss`` forward and backward on the compiled ``cpu`` backend, and ``pip check``;
* no compiler: ``FEDFAST_NO_EXT=1`` gives a pure-Python wheel (built without torch, in pip's isolated
  environment) that runs on the reference backends with one warning per backend, and a doctor that names the
  missing extension and how to build it; a failing compiler gives a wheel without the library and a warning, or,
  with ``FEDFAST_REQUIRE_EXT=1``, a failed build; building with isolation but without ``FEDFAST_NO_EXT`` stops
  with a message that says what to type.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

import fedfast

pytestmark = pytest.mark.slow  # every test here builds or installs the wheel (about 1.5 min in all)

ROOT = Path(__file__).resolve().parent.parent
TORCH_PIN = torch.__version__.split("+")[0]


def _env(**extra) -> dict:
    """The environment of a user's shell: nothing of this test session (PYTHONPATH, fedfast's switches)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "TRITON_INTERPRET", "VIRTUAL_ENV") and not k.startswith("FEDFAST_")
    }
    env.update(MAX_JOBS="2", **extra)
    return env


def _run(cmd, cwd, timeout=600, check=True, **extra) -> subprocess.CompletedProcess:
    p = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=_env(**extra), capture_output=True, text=True, timeout=timeout
    )
    if check and p.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n"
            f"--- stderr\n{p.stderr[-4000:]}"
        )
    return p


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of what a fresh clone would hold (tracked and new, non-ignored files): no build outputs."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs the git checkout (the test builds from a clean copy of its files)")
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    dst = tmp_path_factory.mktemp("src") / "fedfast"
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)
    return dst


@pytest.fixture(scope="module")
def dist(source, tmp_path_factory) -> Path:
    """``make dist``'s command: the sdist, then the wheel built from it, against this environment's torch."""
    out = tmp_path_factory.mktemp("dist")
    _run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", out, source], cwd=source, FEDFAST_REQUIRE_EXT="1"
    )
    return out


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh virtual environment with the pinned torch and nothing else."""
    v = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", v], cwd=v.parent)
    _run([v / "bin" / "python", "-m", "pip", "install", "-q", f"torch=={TORCH_PIN}"], cwd=v.parent)
    return v


@pytest.fixture(scope="module")
def installed(dist, venv) -> Path:
    """The wheel installed into the fresh environment (its dependencies resolved by pip: numpy)."""
    (wheel,) = dist.glob("fedfast-*.whl")
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", wheel], cwd=venv.parent)
    return venv


@pytest.fixture()
def outside(tmp_path) -> Path:
    """A working directory away from the checkout."""
    d = tmp_path / "elsewhere"
    d.mkdir()
    return d


NTD_SCRIPT = r"""
import json, sys, warnings
warnings.simplefilter("error")                      # any fallback warning fails this script
import torch, fedfast
from fedfast.ops import _backend
g = torch.Generator().manual_seed(0)
z = torch.randn(64, 10, generator=g, dtype=torch.float32, requires_grad=True)
t = torch.randn(64, 10, generator=g)
y = torch.randint(0, 10, (64,), generator=g)
out = {"file": fedfast.__file__, "version": fedfast.__version__,
       "cpu_ext": getattr(_backend.cpu_ext(), "__file__", None)}
for be in ("cpu", "reference"):
    zz = z.detach().clone().requires_grad_(True)
    loss = fedfast.nn.NTDLoss(tau=2.0, beta=1.0, backend=be)(zz, t, y)
    loss.backward()
    out[be] = {"loss": loss.item(), "grad": zz.grad.flatten().tolist()}
print(json.dumps(out))
"""


def _close(a, b, tol=1e-5):
    return all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b, strict=True)) and len(a) == len(b)


def test_dist_contents(dist):
    (sdist,) = dist.glob("fedfast-*.tar.gz")
    (wheel,) = dist.glob("fedfast-*.whl")
    names = tarfile.open(sdist).getnames()
    prefix = f"fedfast-{fedfast.__version__}/"
    for f in (
        "pyproject.toml",
        "setup.py",
        "README.md",
        "CHANGELOG.md",
        "csrc/bindings.cpp",
        "csrc/fedfast_cpu.h",
        "kernels/distill.cu",
        "kernels/common.cuh",
        "fedfast/presets/demo.toml",
    ):
        assert prefix + f in names, f
    assert not any(n.endswith((".so", ".o")) for n in names)
    assert wheel.name.startswith(f"fedfast-{fedfast.__version__}-")
    wnames = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("fedfast/_C.") and n.endswith(".so") for n in wnames)
    assert "fedfast/presets/fedntd-table1.toml" in wnames and "fedfast/cli.py" in wnames
    meta = zipfile.ZipFile(wheel).read(f"fedfast-{fedfast.__version__}.dist-info/METADATA").decode()
    assert "Requires-Dist: numpy" in meta and "Requires-Python: >=3.11" in meta
    assert f"Version: {fedfast.__version__}\n" in meta
    # the compiled wheel needs the torch minor release it was compiled against; the sdist, any tested release
    minor = ".".join(TORCH_PIN.split(".")[:2])
    assert f"Requires-Dist: torch=={minor}.*\n" in meta, meta
    pkg = tarfile.open(sdist).extractfile(prefix + "PKG-INFO").read().decode()
    assert "Requires-Dist: torch<2.14,>=2.11\n" in pkg and "Requires-Dist: numpy" in pkg, pkg


def test_installed_wheel_works_outside_the_checkout(installed, outside):
    py, cli = installed / "bin" / "python", installed / "bin" / "fedfast"
    v = _run([cli, "--version"], cwd=outside).stdout
    assert f"fedfast {fedfast.__version__}" in v and f"torch {TORCH_PIN}" in v

    doc = _run([cli, "doctor", "--quick"], cwd=outside).stdout
    assert "cpu extension yes" in doc and "all checks passed" in doc and "automatic backend on cpu: cpu" in doc

    pre = _run([cli, "presets"], cwd=outside).stdout
    assert "fedntd-table1/mnist-shards" in pre and "asd-cifar100/delta0.3" in pre

    run = outside / "runs" / "two"
    _run(
        [
            cli,
            "run",
            "--set",
            "dataset=synthetic",
            "--set",
            "num_clients=10",
            "--set",
            "clients_per_round=4",
            "--set",
            "rounds=2",
            "--set",
            "algorithm=fedntd",
            "--out",
            run,
        ],
        cwd=outside,
    )
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and (run / "summary.json").exists()
    assert json.loads((run / "summary.json").read_text())["versions"]["fedfast"] == fedfast.__version__

    res = json.loads(_run([py, "-c", NTD_SCRIPT], cwd=outside).stdout)
    site = str(installed)
    assert res["file"].startswith(site) and not res["file"].startswith(str(ROOT)), res["file"]
    assert res["cpu_ext"] is not None and res["cpu_ext"].startswith(site), res["cpu_ext"]
    assert _close([res["cpu"]["loss"]], [res["reference"]["loss"]])
    assert _close(res["cpu"]["grad"], res["reference"]["grad"])

    chk = _run([py, "-m", "pip", "check"], cwd=outside)
    assert "No broken requirements" in chk.stdout


def test_failing_compiler_warns_or_fails(source, tmp_path):
    """A compiler that fails: the wheel builds without fedfast._C and says so; FEDFAST_REQUIRE_EXT=1 makes it an
    error (what make and CI set)."""
    out = tmp_path / "w"
    p = _run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps", "-w", out, source],
        cwd=tmp_path,
        CC="/bin/false",
        CXX="/bin/false",
    )
    assert "WARNING: could not build fedfast._C" in p.stdout + p.stderr
    (wheel,) = out.glob("fedfast-*.whl")
    assert not any(n.endswith(".so") for n in zipfile.ZipFile(wheel).namelist())
    p = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", tmp_path / "w2", source],
        cwd=tmp_path,
        check=False,
        CC="/bin/false",
        CXX="/bin/false",
        FEDFAST_REQUIRE_EXT="1",
    )
    assert p.returncode != 0 and not list((tmp_path / "w2").glob("*.whl"))


def test_isolated_build_without_torch_says_what_to_type(source, venv, tmp_path):
    """pip's default (an isolated build environment, no torch in it) stops with the commands that work."""
    p = _run(
        [venv / "bin" / "python", "-m", "pip", "wheel", "--no-deps", "-w", tmp_path / "w", source],
        cwd=tmp_path,
        check=False,
    )
    assert p.returncode != 0
    assert "--no-build-isolation" in p.stdout + p.stderr and "FEDFAST_NO_EXT=1" in p.stdout + p.stderr


def test_no_extension_install_runs_on_reference(installed, source, outside, tmp_path):
    """FEDFAST_NO_EXT=1: built in pip's isolated environment (so without torch), a pure-Python wheel; installed, it
    warns once per backend, computes the same loss, and its doctor names what is missing and how to build it."""
    py, cli = installed / "bin" / "python", installed / "bin" / "fedfast"
    w = tmp_path / "w"
    _run([py, "-m", "pip", "wheel", "--no-deps", "-w", w, source], cwd=tmp_path, FEDFAST_NO_EXT="1")
    (wheel,) = w.glob("fedfast-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    meta = zipfile.ZipFile(wheel).read(f"fedfast-{fedfast.__version__}.dist-info/METADATA").decode()
    assert "Requires-Dist: torch<2.14,>=2.11\n" in meta, meta
    # the last test of the module: it replaces the compiled install in the shared environment
    _run([py, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", wheel], cwd=outside)
    script = NTD_SCRIPT.replace('warnings.simplefilter("error")', 'warnings.simplefilter("always")')
    script = script.replace(
        "print(json.dumps(out))",
        """
with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    for _ in range(3):
        fedfast.nn.NTDLoss(backend="cpu")(z, t, y)
        fedfast.nn.NTDLoss()(z, t, y)
out["warnings"] = [str(r.message) for r in rec if issubclass(r.category, RuntimeWarning)]
print(json.dumps(out))""",
    )
    res = json.loads(_run([py, "-c", script], cwd=outside).stdout.strip().splitlines()[-1])
    assert res["cpu_ext"] is None
    assert _close([res["cpu"]["loss"]], [res["reference"]["loss"]], 1e-6)
    assert _close(res["cpu"]["grad"], res["reference"]["grad"], 1e-6)
    # the first fallback warned inside the NTD loop above; none of the six later calls warns again
    assert res["warnings"] == [], res["warnings"]
    first = _run(
        [
            py,
            "-W",
            "always",
            "-c",
            "import torch, fedfast; z = torch.randn(4, 3); fedfast.nn.NTDLoss()(z, z, torch.tensor([0,1,2,0]))",
        ],
        cwd=outside,
    )
    assert first.stderr.count("RuntimeWarning") == 1, first.stderr
    assert "backend 'cpu' is not usable (fedfast._C not built" in first.stderr
    assert "--no-build-isolation" in first.stderr

    doc = _run([cli, "doctor", "--quick"], cwd=outside).stdout
    assert "cpu extension NO" in doc and "fedfast._C: not built" in doc and "--no-build-isolation" in doc
    assert "all checks passed" in doc and "automatic backend on cpu: reference" in doc

    run = outside / "runs" / "ref"
    _run(
        [
            cli,
            "run",
            "--set",
            "dataset=synthetic",
            "--set",
            "num_clients=10",
            "--set",
            "clients_per_round=3",
            "--set",
            "rounds=2",
            "--out",
            run,
        ],
        cwd=outside,
    )
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
