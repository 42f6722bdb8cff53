"""Methods that fail at their defaults under some settings say so: their caveats (fedfast methods), a warning when a
run uses those settings, and the presets never use them. scripts/check_methods.py checks a study against this."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from sequential_loop import setup_data

import fedfast
from fedfast import methods, models, presets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _warnings(cfg, model):
    train, test, part, _ = setup_data()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fedfast.Simulation(cfg, model, train, test, part)
    return [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize(
    "momentum,alpha,warns",
    [(0.9, 10.0, True), (0.9, 1.0, False), (0.0, 10.0, False), (0.5, 10.0, True), (0.5, 5.0, False)],
)
def test_fedgen_warns_when_momentum_inflates_its_weights(momentum, alpha, warns):
    _, _, _, model = setup_data()
    cfg = fedfast.SimConfig(
        algorithm="fedgen", momentum=momentum, options=dict(alpha=alpha, beta=alpha), clients_per_round=2
    )
    got = [w for w in _warnings(cfg, model) if w.startswith("fedgen: ")]
    assert bool(got) == warns, got
    if warns:
        assert f"fedgen.beta to {10 * (1 - momentum):g}" in got[0] and "momentum = 0" in got[0]


def test_moon_warns_on_an_mlp_only():
    _, _, _, mlp = setup_data()
    cfg = fedfast.SimConfig(algorithm="moon", clients_per_round=2)
    assert any(w.startswith("moon: mu = 1 on an MLP") for w in _warnings(cfg, mlp))
    assert not _warnings(fedfast.SimConfig(algorithm="moon", options=dict(mu=0.1), clients_per_round=2), mlp)
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 5)
    )
    assert not _warnings(cfg, cnn)


def test_caveats_are_printed_and_presets_never_hit_them():
    for name in ("fedgen", "moon"):
        assert "caveat: " in methods.describe(name) and methods.get(name).caveats
    for cell in presets.load_all().values():
        for m in cell.methods:
            if not methods.get(m).caveats:
                continue
            cfg = fedfast.config.build_config(None, [], base=cell.config(m)).sim_config()
            model = (
                models.build(cell.keys.get("model", "mlp"))
                if not str(cell.keys.get("model", "")).startswith("hf:")
                else models.FedAvgCNN()
            )
            assert not cfg.method().check_settings(cfg, model), (cell.name, m)


def test_check_methods_script(tmp_path):
    study = tmp_path / "s.toml"
    study.write_text("""
[preset]
paper = "t"
table = "t"
metric = "final"
seeds = [0]
methods = ["fedavg", "moon"]
[protocol]
dataset = "synthetic"
num_clients = 6
clients_per_round = 2
rounds = 2
model = "mlp"
partition = "iid"
[cells.c]
""")
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run(
        [sys.executable, "-m", "fedfast", "sweep", str(study), "--out", str(tmp_path / "o"), "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    ok = subprocess.run(
        [sys.executable, "scripts/check_methods.py", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert ok.returncode == 0 and "| moon |" in ok.stdout, ok.stdout + ok.stderr
    strict = subprocess.run(
        [sys.executable, "scripts/check_methods.py", str(tmp_path / "o"), "--points", "-100"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    out = strict.stdout
    assert strict.returncode == 1 and "| fedavg |" in out and "FAILS, no caveat" in out
    assert "below FedAvg: its caveat, and a warning" in out  # moon: its caveat, and it warned for an MLP
