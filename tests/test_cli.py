"""fedfast run: config validation, overrides, run directory (synthetic data, tiny run)."""

import json
import os

import pytest

from fedfast.cli import main
from fedfast.config import build_config


def test_run_writes_config_and_metrics(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        'dataset = "synthetic"\npartition = "dirichlet"\nalpha = 0.5\nnum_clients = 10\n'
        "clients_per_round = 4\nrounds = 2\nbatch_size = 32\nlr = 0.05\n"
    )
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--set", "algorithm=kd", "--set", "kd.tau=2.0", "--out", str(out)]) == 0
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["algorithm"] == "kd" and resolved["kd"] == {"beta": 1.0, "tau": 2.0, "tau_squared": True}
    assert resolved["num_clients"] == 10 and resolved["momentum"] == 0.0 and "fedntd" not in resolved
    lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [1, 2]
    for r in lines:
        assert {"round", "test_accuracy", "test_loss", "train_loss", "seconds"} <= set(r)
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["seconds"] > 0


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--set", "nonsense=1"], "nonsense: unknown config key"),
        (["--set", "rounds=abc"], "rounds: expected an integer"),
        (["--set", "algorithm=fedsomething"], "algorithm: 'fedsomething' is not a registered method"),
        (["--set", "lr=-1"], "lr: must be > 0"),
        (["--set", "clients_per_round=500"], "clients_per_round"),
        (["--set", "algorithm=kd+asd"], "algorithm: the ASD add-on composes with"),
        (["--set", "rounds"], "--set: expected key=value"),
        (["--set", "algorithm=fedadc", "--set", "fedadc.order=red"], "fedadc.order: one of"),
        (["--set", "algorithm=fedgkd_vote", "--set", "fedgkd_vote.val_fraction=1.5"], "fedgkd_vote.val_fraction"),
        (
            ["--set", "algorithm=fedavg", "--set", "fedntd.beta=5"],
            "fedntd: an option table of fedntd, fedntd+asd, but the running method is fedavg",
        ),
        (["--set", "algorithm=fedgkd", "--set", "fedgkd.beta=5"], "fedgkd.beta: not an option of fedgkd"),
        (["--set", "beta=5"], "beta: a method option now, spelled fedntd.beta"),
        (["--set", "asd=true"], "asd: a method option now, spelled algorithm = '<base>+asd'"),
        (["--set", "algorithm=fedntd+asd", "--set", "fedntd.tau=3"], "fedntd.tau: not used by fedntd+asd"),
        (["--set", "algorithm=fedntd", "--set", "fedntd.beta=abc"], "fedntd.beta: expected a number"),
        (["--plugin", "/nonexistent/x.py"], "--plugin: no such file"),
        (["--set", "client_chunk=0"], "client_chunk"),
        (["--set", "dataset=synthetic", "--set", "num_clients=6", "--set", "clients_per_round=3"], "shards_per_client"),
    ],
)
def test_bad_config_is_rejected_naming_the_key(args, msg, capsys):
    assert main(["run", *args]) == 2
    assert msg in capsys.readouterr().err


def test_one_default_algorithm_everywhere():
    """The command line, a run config and SimConfig run the same method when none is named: FedAvg."""
    import fedfast

    assert build_config(None, [])["algorithm"] == fedfast.SimConfig().algorithm == "fedavg"


def test_build_config_defaults_and_types():
    c = build_config(None, ["rounds=3", "momentum=0", "seed=7"])
    assert c["rounds"] == 3 and c["momentum"] == 0.0 and isinstance(c["momentum"], float) and c["seed"] == 7


@pytest.mark.parametrize(
    "algorithm,extra",
    [
        ("fedgkd_vote", ["fedgkd_vote.buffer=2"]),
        ("fedadc_plus", ["fedadc_plus.order=heavy_ball"]),
        ("moon", ["moon.mu=5.0"]),
        ("scaffold+asd", ["asd.lam=5.0"]),
        ("fedcad", ["fedcad.aux_holdout=true", "fedcad.aux_per_class=4"]),
    ],
)
def test_run_new_methods(tmp_path, algorithm, extra):
    out = tmp_path / "run"
    args = [
        "run",
        "--set",
        "dataset=synthetic",
        "--set",
        "num_clients=10",
        "--set",
        "clients_per_round=3",
        "--set",
        "rounds=2",
        "--set",
        f"algorithm={algorithm}",
        "--out",
        str(out),
    ]
    for e in extra:
        args += ["--set", e]
    assert main(args) == 0
    resolved = json.loads((out / "config.json").read_text())
    table, kv = extra[0].split(".", 1)
    k, v = kv.split("=")
    assert resolved["algorithm"] == algorithm and str(resolved[table][k]).lower() == v
    lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and len(lines[-1]["class_accuracy"]) == 10 and lines[-1]["forgetting"] is not None


def test_toml_tables_and_resolved_defaults(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('algorithm = "fedntd+asd"\nmomentum = 0.9\n[fedntd]\n[asd]\nlam = 5.0\n')
    c = build_config(str(cfg), [])
    j = c.to_json()
    assert j["asd"]["lam"] == 5.0 and j["asd"]["entropy_tau"] == 1.0 and j["asd"]["not_true"] is True
    assert j["fedntd"] == {} and j["max_grad_norm"] == 10.0 and j["momentum"] == 0.9
    assert build_config(None, ["algorithm=fedgkd_vote"]).to_json()["fedgkd_vote"]["beta"] == 0.2
    assert build_config(None, ["algorithm=fedadc"])["momentum"] == 0.0
    cfg.write_text('algorithm = "fedavg"\n[fedgkd]\ngamma = 0.1\n')
    with pytest.raises(ValueError, match="fedgkd: an option table of .* the running method is fedavg"):
        build_config(str(cfg), [])


def test_methods_command_lists_options(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in ("fedavg", "fedntd", "fedgkd_vote", "fedcad", "fedadc_plus", "moon", "scaffold", "feddyn", "kd"):
        assert f"\n{name}: " in "\n" + out
    assert "beta = 1.0" in out and "fedntd+asd" in out
    assert main(["methods", "fedgkd"]) == 0
    one = capsys.readouterr().out
    assert "max_grad_norm=10" in one and "skip_first_round = True" in one and "Eq. 4" in one
    assert main(["methods", "nosuch"]) == 2


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
    args = [
        "--set",
        "dataset=synthetic",
        "--set",
        "num_clients=10",
        "--set",
        "clients_per_round=4",
        "--set",
        "rounds=2",
        "--set",
        "algorithm=scaffold",
        "--set",
        "partition=iid",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    r = subprocess.run(
        [
            torchrun,
            "--nproc_per_node=2",
            f"--master_port={port}",
            "-m",
            "fedfast",
            "run",
            *args,
            "--out",
            str(tmp_path / "dist"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert main(["run", *args, "--out", str(tmp_path / "one")]) == 0
    d = [json.loads(s) for s in (tmp_path / "dist" / "metrics.jsonl").read_text().splitlines()]
    o = [json.loads(s) for s in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert len(d) == len(o) == 2
    for a, b in zip(d, o, strict=True):
        assert abs(a["test_loss"] - b["test_loss"]) <= 1e-4 * abs(b["test_loss"])


@pytest.mark.slow
def test_console_exits_with_mains_code_after_flushing(tmp_path):
    """``python -m fedfast`` ends with os._exit (no interpreter teardown): its exit codes and printed output must be
    main()'s, and the run's files complete."""
    import subprocess
    import sys

    env = {**os.environ, "FEDFAST_CACHE": str(tmp_path / "cache")}

    def go(*a):
        return subprocess.run(
            [sys.executable, "-m", "fedfast", *a], capture_output=True, text=True, env=env, timeout=300
        )

    r = go("methods")
    assert r.returncode == 0 and "fedntd" in r.stdout
    assert go("--help").returncode == 0
    r = go("run", "--bogus")
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr
    r = go("run", "--set", "nope=1", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "nope" in r.stderr
    r = go(
        "run",
        "--quiet",
        "--out",
        str(tmp_path / "run"),
        "--set",
        "dataset=synthetic",
        "--set",
        "rounds=2",
        "--set",
        "num_clients=5",
        "--set",
        "clients_per_round=2",
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["complete"] and summary["rounds"] == 2


def test_femnist_by_writer_run(tmp_path, capsys):
    """dataset = femnist (LEAF JSON) with its writers grouped into clients (partition = by_writer)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for split, users in (("train", [f"w{i}" for i in range(6)]), ("test", ["w0", "w1"])):
        (tmp_path / "leaf" / split).mkdir(parents=True)
        blob = {
            "users": users,
            "num_samples": [4] * len(users),
            "user_data": {
                u: {"x": (rng.integers(0, 256, (4, 784)) / 255).tolist(), "y": rng.integers(0, 62, 4).tolist()}
                for u in users
            },
        }
        (tmp_path / "leaf" / split / "all_data_0.json").write_text(json.dumps(blob))
    args = [
        "run",
        "--quiet",
        "--set",
        "dataset=femnist",
        "--set",
        f"data_dir={tmp_path / 'leaf'}",
        "--set",
        "partition=by_writer",
        "--set",
        "num_clients=3",
        "--set",
        "clients_per_round=2",
        "--set",
        "rounds=2",
        "--set",
        "batch_size=4",
        "--set",
        "algorithm=fedavg",
    ]
    assert main(args + ["--out", str(tmp_path / "run")]) == 0
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["complete"] and s["rounds"] == 2
    assert (
        main(["run", "--set", "dataset=synthetic", "--set", "partition=by_writer", "--out", str(tmp_path / "x")]) == 2
    )
    assert "by_writer needs a dataset with writers" in capsys.readouterr().err


def test_version_in_one_place(capsys):
    """fedfast --version, fedfast.__version__ and the package metadata (pyproject.toml's dynamic version) all read
    fedfast/_version.py."""
    import os
    import re

    import fedfast

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"fedfast {fedfast.__version__} (torch ")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    import tomllib
    from importlib import metadata

    setup_py = open(os.path.join(root, "setup.py")).read()
    assert not re.search(r"version\s*=", setup_py)
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        proj = tomllib.load(f)
    assert "version" in proj["project"]["dynamic"] and "version" not in proj["project"]
    assert proj["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fedfast._version.__version__"}
    assert metadata.version("fedfast") == fedfast.__version__  # what the installed (editable) package says
    src = open(os.path.join(root, "fedfast", "_version.py")).read()
    assert f'__version__ = "{fedfast.__version__}"' in src
