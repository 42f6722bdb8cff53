"""fedfast run: config validation, overrides, run directory (synthetic data, tiny run)."""
import json

import pytest

from fedfast.cli import main
from fedfast.config import build_config


def test_run_writes_config_and_metrics(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('dataset = "synthetic"\npartition = "dirichlet"\nalpha = 0.5\nnum_clients = 10\n'
                   'clients_per_round = 4\nrounds = 2\nbatch_size = 32\nlr = 0.05\n')
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--set", "algorithm=kd", "--set", "tau=2.0", "--out", str(out)]) == 0
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["algorithm"] == "kd" and resolved["tau"] == 2.0 and resolved["num_clients"] == 10
    lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [1, 2]
    for r in lines:
        assert {"round", "test_accuracy", "test_loss", "train_loss", "seconds"} <= set(r)
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["seconds"] > 0


@pytest.mark.parametrize("args,msg", [
    (["--set", "nonsense=1"], "nonsense: unknown config key"),
    (["--set", "rounds=abc"], "rounds: expected a int"),
    (["--set", "algorithm=fedsomething"], "algorithm: one of"),
    (["--set", "lr=-1"], "lr: must be > 0"),
    (["--set", "clients_per_round=500"], "clients_per_round"),
    (["--set", "asd=true", "--set", "algorithm=kd"], "asd: the ASD add-on composes with"),
    (["--set", "rounds"], "--set: expected key=value"),
    (["--set", "adc_order=red"], "adc_order: one of"),
    (["--set", "val_fraction=1.5"], "val_fraction"),
    (["--set", "client_chunk=0"], "client_chunk"),
    (["--set", "dataset=synthetic", "--set", "num_clients=6", "--set", "clients_per_round=3"], "shards_per_client"),
])
def test_bad_config_is_rejected_naming_the_key(args, msg, capsys):
    assert main(["run", *args]) == 2
    assert msg in capsys.readouterr().err


def test_build_config_defaults_and_types():
    c = build_config(None, ["rounds=3", "momentum=0", "seed=7"])
    assert c["rounds"] == 3 and c["momentum"] == 0.0 and isinstance(c["momentum"], float) and c["seed"] == 7


@pytest.mark.parametrize("algorithm,extra", [("fedgkd_vote", ["gkd_buffer=2"]), ("fedadc_plus", ["adc_order=heavy_ball"]),
                                             ("moon", ["moon_mu=5"]), ("scaffold", ["asd=true"]),
                                             ("fedcad", ["cad_aux_holdout=true"])])
def test_run_new_methods(tmp_path, algorithm, extra):
    out = tmp_path / "run"
    args = ["run", "--set", "dataset=synthetic", "--set", "num_clients=10", "--set", "clients_per_round=3",
            "--set", "rounds=2", "--set", f"algorithm={algorithm}", "--out", str(out)]
    for e in extra:
        args += ["--set", e]
    assert main(args) == 0
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["algorithm"] == algorithm and resolved["tau"] is not None and resolved["momentum"] is not None
    lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and len(lines[-1]["class_accuracy"]) == 10 and lines[-1]["forgetting"] is not None


def test_per_method_defaults_resolved():
    assert build_config(None, ["algorithm=fedadc_plus"])["tau"] == 4.0
    assert build_config(None, ["algorithm=fedadc"])["momentum"] == 0.0
    assert build_config(None, ["algorithm=fedadc", "momentum=0.5"])["momentum"] == 0.5
    assert build_config(None, ["algorithm=fedgkd_vote"])["gkd_buffer"] == 5


def test_torchrun_two_processes(tmp_path):
    """`torchrun --nproc_per_node=2 -m fedfast run ...` (gloo on CPU): rank 0 writes the run directory, with the
    same metrics as one process."""
    import os
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun not installed")
    args = ["--set", "dataset=synthetic", "--set", "num_clients=10", "--set", "clients_per_round=4",
            "--set", "rounds=2", "--set", "algorithm=scaffold", "--set", "partition=iid"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    r = subprocess.run([torchrun, "--nproc_per_node=2", f"--master_port={port}", "-m", "fedfast", "run", *args,
                        "--out", str(tmp_path / "dist")], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    assert main(["run", *args, "--out", str(tmp_path / "one")]) == 0
    d = [json.loads(s) for s in (tmp_path / "dist" / "metrics.jsonl").read_text().splitlines()]
    o = [json.loads(s) for s in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert len(d) == len(o) == 2
    for a, b in zip(d, o):
        assert abs(a["test_loss"] - b["test_loss"]) <= 1e-4 * abs(b["test_loss"])
