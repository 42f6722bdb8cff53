"""A corpus of bad inputs: every case must end in a clear refusal (the exit status, or the exception type) whose
message names the config key, argument or file at fault, never a traceback, a NaN or a silent success. Plus the
run directory's data-loss and concurrency cases: a user's directory under --force, two processes on one run
directory, a diverged run, refused resumes, clean-up after failures."""

import json
import os
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import fedfast
from fedfast import data, nn as fnn
from fedfast.cli import main
from fedfast.rundir import LOCK, MARKER, RunDir

SMALL = [
    "--set",
    "dataset=synthetic",
    "--set",
    "num_clients=10",
    "--set",
    "clients_per_round=3",
    "--set",
    "model=mlp",
    "--set",
    "rounds=2",
    "--set",
    "algorithm=fedavg",
]
SWEEP_SMALL = SMALL[:-2]  # a sweep's methods are --methods (--set algorithm is refused there)


def sets(*kv):
    return sum([["--set", x] for x in kv], [])


def cli(capsys, *argv):
    """(exit status, stderr) of ``fedfast ARGV`` run in this process."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        code = e.code
    out = capsys.readouterr()
    return code, out.err + out.out


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    """A finished 2-round run (checkpointed every round)."""
    d = tmp_path_factory.mktemp("runs") / "done"
    assert main(["run", *SMALL, "--set", "checkpoint_every=1", "--out", str(d), "--quiet"]) == 0
    return d


def copy_run(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


# -- fedfast run: keys and values ---------------------------------------------------------------------------------
RUN_CASES = [
    (["rounds=abc"], "rounds: expected an integer"),
    (["seed=-1"], "seed: must be an integer"),
    (["seed=1.5"], "seed: expected an integer"),
    (["seed=3000000000"], "seed: must be an integer in [0, 2**31)"),
    (["lr=nan"], "lr: expected a finite number"),
    (["lr=inf"], "lr: expected a finite number"),
    (["lr=-0.1"], "lr: must be > 0"),
    (["momentum=1.0"], "momentum: must lie in [0, 1)"),
    (["device=cuda"], "device: 'cuda'"),
    (["device=cuda:7"], "device: 'cuda:7'"),
    (["device=banana"], "device: 'banana' is not a device"),
    (["dataset=imagenet"], "dataset: must be one of"),
    (["partition=foo"], "partition: must be one of"),
    (["model=vgg"], "model: must be one of"),
    (["algorithm=nope"], "algorithm"),
    (["nosuchkey=1"], "nosuchkey: unknown config key"),
    (["beta=0.5"], "fedntd.beta"),
    (["fedavg.nosuch=1"], "fedavg.nosuch"),
    (["fedprox.mu=0.1"], "fedprox"),
    (["clients_per_round=200"], "clients_per_round"),
    (["threads=-2"], "threads: must be >= 0"),
    (["checkpoint_every=-1"], "checkpoint_every: must be >= 0"),
    (["train_fraction=2"], "train_fraction"),
    (["tensorboard=maybe"], "tensorboard: expected true or false"),
    (["adam_betas=0.9"], "adam_betas"),
    (["client_sampling=weird"], "client_sampling"),
    (["alpha=0"], "alpha: must be > 0"),
    (["num_clients=0"], "num_clients: must be > 0"),
    (["batch_size=0"], "batch_size: must be an integer >= 1"),
    (["local_epochs=-1"], "local_epochs"),
    (["max_grad_norm=-1"], "max_grad_norm"),
    (["max_length=64"], "max_length: tokens per text"),
    (["dataset=ag_news"], "model: dataset 'ag_news' holds texts"),
    (["client_optimizer=adam", "momentum=0.9"], "momentum: SGD momentum"),
    (["fedntd.beta=x", "algorithm=fedntd"], "fedntd.beta: expected a number"),
]


@pytest.mark.parametrize("kv,msg", RUN_CASES, ids=[c[0][0] for c in RUN_CASES])
def test_run_refuses_bad_keys(kv, msg, capsys, tmp_path):
    code, err = cli(capsys, "run", *SMALL, *sets(*kv), "--out", tmp_path / "r", "--quiet")
    assert code == 2 and msg in err and "Traceback" not in err, err
    assert f"--set {kv[-1].split('=')[0]}" in err or msg.split(":")[0] in err
    assert not (tmp_path / "r").exists(), "a refused config left a directory"


@pytest.mark.parametrize(
    "dataset,needs",
    [
        ("cifar10", "cifar-10-batches-py"),
        ("cifar100", "cifar-100-python"),
        ("tiny_imagenet", "tiny-imagenet-200"),
        ("cinic10", "cinic"),
        ("femnist", "femnist"),
        ("idx", "train-images-idx3-ubyte"),
    ],
)
def test_missing_data_names_data_dir_and_where_to_get_it(dataset, needs, capsys, tmp_path):
    code, err = cli(
        capsys,
        "run",
        *SMALL,
        *sets(f"dataset={dataset}", f"data_dir={tmp_path / 'nodata'}"),
        "--out",
        tmp_path / "a" / "r",
        "--quiet",
    )
    assert code == 2 and "data_dir" in err and needs.lower() in err.lower() and "download=True" not in err, err
    assert not (tmp_path / "a").exists(), "a failed run left its directory (and the parent it made)"


def test_cifar_message_says_where_to_get_it(capsys, tmp_path):
    code, err = cli(capsys, "run", *SMALL, *sets("dataset=cifar10", f"data_dir={tmp_path}"), "--out", tmp_path / "r")
    assert code == 2 and "https://www.cs.toronto.edu/~kriz/cifar.html" in err


def test_partition_failure_names_config_keys_not_python_arguments(capsys, tmp_path):
    code, err = cli(
        capsys,
        "run",
        *SMALL,
        *sets("partition=dirichlet", "alpha=0.001", "num_clients=400", "clients_per_round=3"),
        "--out",
        tmp_path / "r",
    )
    assert code == 2 and "partition: dirichlet" in err and "alpha" in err and "min_size" not in err, err


def test_by_writer_needs_writers(capsys, tmp_path):
    code, err = cli(capsys, "run", *SMALL, "--set", "partition=by_writer", "--out", tmp_path / "r")
    assert code == 2 and "partition: by_writer" in err


def test_workers_must_be_positive(capsys, tmp_path):
    code, err = cli(capsys, "run", *SMALL, "--workers", "0", "--out", tmp_path / "r")
    assert code == 2 and "--workers" in err


def test_set_without_equals(capsys, tmp_path):
    code, err = cli(capsys, "run", *SMALL, "--set", "rounds", "--out", tmp_path / "r")
    assert code == 2 and "--set: expected key=value" in err


# -- config files -------------------------------------------------------------------------------------------------
FILE_CASES = [
    ("bad.toml", b'rounds = 3\nalgorithm = "fedavg\n', ["bad.toml, line 2", "not valid TOML"]),
    ("dup.toml", b"rounds = 3\nrounds = 4\n", ["dup.toml, line 2", "'rounds' is given twice"]),
    ("duptable.toml", b"[fedntd]\nbeta = 1.0\n[fedntd]\ntau = 2.0\n", ["duptable.toml, line 3", "'fedntd'"]),
    ("type.toml", b'rounds = "x"\n', ["type.toml: rounds: expected an integer"]),
    ("unknown.toml", b"roundz = 3\n", ["unknown.toml: roundz: unknown config key"]),
    ("table.toml", b"[nosuch]\nx = 1\n", ["table.toml", "nosuch"]),
    ("binary.toml", b"\xff\xfe\x00rounds", ["binary.toml: not a text file"]),
    ("damaged.json", b'{"rounds": 3,', ["damaged.json: damaged config file (line 1"]),
    ("list.json", b"[1, 2]", ["list.json: expected a JSON object"]),
    ("plugins.json", b'{"plugins": "x.py"}', ["plugins: expected a list", "plugins.json"]),
]


@pytest.mark.parametrize("name,content,msgs", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_config_file_errors_name_file_line_and_key(name, content, msgs, capsys, tmp_path):
    p = tmp_path / name
    p.write_bytes(content)
    code, err = cli(capsys, "run", p, "--out", tmp_path / "r")
    assert code == 2 and "Traceback" not in err, err
    for m in msgs:
        assert m in err, (m, err)


def test_missing_config_file(capsys, tmp_path):
    code, err = cli(capsys, "run", tmp_path / "nope.toml")
    assert code == 2 and "nope.toml: no such file" in err


def test_config_is_a_directory(capsys, tmp_path):
    code, err = cli(capsys, "run", tmp_path)
    assert code == 2 and "is a directory" in err and "config.json" in err


def test_missing_plugin_file(capsys, tmp_path):
    code, err = cli(capsys, "run", *SMALL, "--plugin", tmp_path / "nope.py", "--out", tmp_path / "r")
    assert code == 2 and "nope.py" in err


def test_plugin_with_a_syntax_error(capsys, tmp_path):
    p = tmp_path / "broken.py"
    p.write_text("def f(:\n")
    code, err = cli(capsys, "run", *SMALL, "--plugin", p, "--out", tmp_path / "r")
    assert code == 2 and "broken.py" in err, err


def test_a_runs_config_json_runs_again(done_run, tmp_path, capsys):
    """``fedfast run DIR/config.json`` re-runs a run: the same config and, on this machine, the same numbers."""
    out = tmp_path / "again"
    code, err = cli(capsys, "run", done_run / "config.json", "--out", out, "--quiet")
    assert code == 0, err
    a = json.load(open(out / "config.json"))
    b = json.load(open(done_run / "config.json"))
    assert a == b
    ma = [json.loads(x)["test_accuracy"] for x in open(out / "metrics.jsonl")]
    mb = [json.loads(x)["test_accuracy"] for x in open(done_run / "metrics.jsonl")]
    assert ma == mb


# -- presets, methods, sweep, report, plot, doctor ----------------------------------------------------------------
def test_unknown_preset_in_run(capsys, tmp_path):
    code, err = cli(capsys, "run", "--preset", "nosuch", "--out", tmp_path / "r")
    assert code == 2 and "--preset: no preset 'nosuch'" in err


def test_unknown_preset_in_presets(capsys):
    code, err = cli(capsys, "presets", "nosuch")
    assert code == 2 and "nosuch" in err


def test_unknown_method_in_methods(capsys):
    code, err = cli(capsys, "methods", "nosuch")
    assert code == 2 and "nosuch" in err and "Traceback" not in err


def test_unknown_subcommand(capsys):
    code, err = cli(capsys, "frobnicate")
    assert code == 2 and "frobnicate" in err


def test_doctor_unknown_flag(capsys):
    code, err = cli(capsys, "doctor", "--bogus")
    assert code == 2 and "--bogus" in err


def test_doctor_refuses_unknown_backend_variable(capsys, monkeypatch):
    monkeypatch.setenv("FEDFAST_BACKEND", "bogus")
    code, err = cli(capsys, "doctor", "--quick")
    assert code != 0 and "FEDFAST_BACKEND" in err and "bogus" in err, err


def test_sweep_needs_methods(capsys, tmp_path):
    code, err = cli(capsys, "sweep", *SWEEP_SMALL, "--out", tmp_path / "s")
    assert code == 2 and "--methods: which methods to run" in err and not (tmp_path / "s").exists()


def test_sweep_bad_seeds(capsys, tmp_path):
    code, err = cli(capsys, "sweep", "--methods", "fedavg", "--seeds", "a,b", "--out", tmp_path / "s")
    assert code == 2 and "--seeds" in err and not (tmp_path / "s").exists()


def test_sweep_bad_key_leaves_nothing(capsys, tmp_path):
    code, err = cli(capsys, "sweep", "--methods", "fedavg", "--set", "rounds=x", "--out", tmp_path / "s")
    assert code == 2 and "rounds: expected an integer" in err and not (tmp_path / "s").exists()


def test_sweep_unknown_method_leaves_nothing(capsys, tmp_path):
    code, err = cli(capsys, "sweep", "--methods", "fedavg,nosuch", *SWEEP_SMALL, "--out", tmp_path / "s")
    assert code == 2 and "nosuch" in err and not (tmp_path / "s").exists()


def test_sweep_out_is_a_file(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    code, err = cli(capsys, "sweep", "--methods", "fedavg", *SWEEP_SMALL, "--out", tmp_path / "f")
    assert code == 2 and "is a file" in err


def test_sweep_refuses_a_changed_study(capsys, tmp_path):
    s = tmp_path / "s"
    s.mkdir()
    (s / "study.json").write_text(
        json.dumps(
            {
                "preset": None,
                "config": None,
                "methods": ["fedavg"],
                "seeds": [0],
                "overrides": ["rounds=5"],
                "plugins": [],
            }
        )
    )
    code, err = cli(capsys, "sweep", "--methods", "fedavg", "--set", "rounds=2", "--out", s)
    assert code == 2 and "use another --out" in err


def test_sweep_damaged_study_json(capsys, tmp_path):
    s = tmp_path / "s"
    s.mkdir()
    (s / "study.json").write_text("{")
    code, err = cli(capsys, "sweep", "--methods", "fedavg", *SWEEP_SMALL, "--out", s)
    assert code == 2 and "study.json: damaged" in err


def test_report_on_an_empty_directory(capsys, tmp_path):
    code, err = cli(capsys, "report", tmp_path)
    assert code == 2 and str(tmp_path) in err


@pytest.mark.parametrize(
    "name,content,msg",
    [
        ("summary.json", '{"x": 1', "summary.json: damaged summary file (line 1"),
        ("summary.json", "[1]", "summary.json: damaged"),
        ("summary.json", '{"complete": NaN', "summary.json: damaged"),
        ("config.json", "{", "config.json: damaged config file"),
        ("config.json", "{}", "config.json: damaged"),
    ],
)
def test_report_names_the_damaged_file(name, content, msg, done_run, tmp_path, capsys):
    d = copy_run(done_run, tmp_path / "study" / "r")
    (d / name).write_text(content)
    code, err = cli(capsys, "report", tmp_path / "study")
    assert code == 2 and msg in err and str(d) in err, err


def test_report_damaged_study_json(done_run, tmp_path, capsys):
    copy_run(done_run, tmp_path / "study" / "r")
    (tmp_path / "study" / "study.json").write_text('{"methods": 3}')
    code, err = cli(capsys, "report", tmp_path / "study")
    assert code == 2 and "study.json: damaged" in err


@pytest.mark.parametrize(
    "content,msg",
    [
        ('{"round": 1, "test_accuracy": 0.5}\n{"round": 2, "test_acc', "metrics.jsonl: line 2 is damaged"),
        ('{"round": 1}\n[3]\n', "metrics.jsonl: line 2 is not a round's record"),
        (b"\xff\xfe", "metrics.jsonl"),
    ],
)
def test_plot_names_the_damaged_metrics_line(content, msg, done_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    d = copy_run(done_run, tmp_path / "r")
    (d / "metrics.jsonl").write_bytes(content if isinstance(content, bytes) else content.encode())
    code, err = cli(capsys, "plot", d, "-o", tmp_path / "p.png")
    assert code == 2 and msg in err and "Traceback" not in err, err


def test_plot_of_a_directory_without_runs(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    code, err = cli(capsys, "plot", tmp_path, "-o", tmp_path / "p.png")
    assert code == 2 and str(tmp_path) in err


# -- resume ---------------------------------------------------------------------------------------------------------
def test_resume_of_a_missing_directory(capsys, tmp_path):
    code, err = cli(capsys, "run", "--resume", tmp_path / "nope")
    assert code == 2 and "--resume" in err and "nope" in err and not (tmp_path / "nope").exists()


@pytest.mark.parametrize(
    "extra,word",
    [
        (["cfg.toml"], "a config file"),
        (["--out", "x"], "--out"),
        (["--preset", "demo"], "--preset"),
        (["--force"], "--force"),
    ],
)
def test_resume_refuses_what_it_would_ignore(extra, word, done_run, capsys, tmp_path):
    code, err = cli(capsys, "run", "--resume", done_run, *extra)
    assert code == 2 and word in err and "cannot go with it" in err, err
    assert not os.path.exists("x")


def test_resume_refuses_other_settings(done_run, capsys):
    code, err = cli(capsys, "run", "--resume", done_run, "--set", "lr=0.1")
    assert code == 2 and "lr cannot change when resuming" in err


def test_resume_refuses_fewer_rounds_than_done(done_run, tmp_path, capsys):
    d = copy_run(done_run, tmp_path / "r")
    before = (d / "config.json").read_text()
    code, err = cli(capsys, "run", "--resume", d, "--set", "rounds=1")
    assert code == 2 and "rounds: the run in" in err and "has done 2 rounds" in err, err
    assert (d / "config.json").read_text() == before, "config.json changed by a refused resume"


def test_resume_of_a_directory_that_is_not_a_run(capsys, tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"rounds": 2}))
    code, err = cli(capsys, "run", "--resume", d)
    assert code == 2 and "not a fedfast run directory" in err and sorted(os.listdir(d)) == ["config.json"], err


def test_resume_without_a_checkpoint(done_run, tmp_path, capsys):
    d = copy_run(done_run, tmp_path / "r")
    os.remove(d / "checkpoint.pt")
    code, err = cli(capsys, "run", "--resume", d)
    assert code == 2 and "checkpoint.pt" in err


def test_resume_with_a_damaged_config(done_run, tmp_path, capsys):
    d = copy_run(done_run, tmp_path / "r")
    (d / "config.json").write_text("{")
    code, err = cli(capsys, "run", "--resume", d)
    assert code == 2 and "config.json: damaged config file" in err


def test_forged_checkpoint_is_refused_without_torchs_advice(done_run, tmp_path, capsys):
    """A checkpoint whose payload pickles an object (with a valid header and hash) is refused by fedfast's loader,
    and the message does not repeat torch's advice to load it with weights_only=False."""
    import hashlib
    import io

    from fedfast import checkpoint

    d = copy_run(done_run, tmp_path / "r")
    buf = io.BytesIO()
    torch.save({"state": fedfast.SimConfig()}, buf)
    payload = buf.getvalue()
    (d / "checkpoint.pt").write_bytes(checkpoint.MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    code, err = cli(capsys, "run", "--resume", d)
    assert code == 2 and "checkpoint.pt: unreadable checkpoint payload" in err and "weights_only" not in err, err


def test_truncated_checkpoint(done_run, tmp_path, capsys):
    d = copy_run(done_run, tmp_path / "r")
    raw = (d / "checkpoint.pt").read_bytes()
    (d / "checkpoint.pt").write_bytes(raw[: len(raw) // 2])
    code, err = cli(capsys, "run", "--resume", d)
    assert code == 2 and "checkpoint.pt" in err and "truncated" in err


# -- run directories: what --force may remove, one writer, clean-up -----------------------------------------------
def test_out_is_a_file(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    code, err = cli(capsys, "run", *SMALL, "--out", tmp_path / "f")
    assert code == 2 and "is a file" in err and (tmp_path / "f").read_text() == "x"


@pytest.mark.parametrize("force", [False, True])
def test_a_users_directory_survives(force, capsys, tmp_path):
    """A directory of the user's own files named as a run's outputs is never cleared, with or without --force,
    and the message says it is not a run (rather than that it "holds a run")."""
    d = tmp_path / "mine"
    (d / "tb" / "exp1").mkdir(parents=True)
    files = {
        "config.json": "mine",
        "metrics.csv": "a,b",
        "summary.json": "{}",
        "weights.pt": "w",
        "model_best.pt": "m",
        "tb/exp1/events.out.tfevents.1": "ev",
    }
    for k, v in files.items():
        (d / k).write_text(v)
    code, err = cli(capsys, "run", *SMALL, *(["--force"] if force else []), "--out", d)
    assert code == 2 and "is not a fedfast run directory" in err and "holds a run" not in err, err
    for k, v in files.items():
        assert (d / k).read_text() == v
    assert sorted(os.listdir(d)) == sorted(
        ["config.json", "metrics.csv", "summary.json", "weights.pt", "model_best.pt", "tb"]
    ), "fedfast left files in the user's directory"


def test_other_files_in_a_directory_are_kept(capsys, tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("n")
    assert cli(capsys, "run", *SMALL, "--out", d, "--quiet")[0] == 0
    assert (d / "notes.txt").read_text() == "n" and (d / MARKER).exists()


def test_existing_run_needs_resume_or_force(done_run, tmp_path, capsys):
    d = copy_run(done_run, tmp_path / "r")
    code, err = cli(capsys, "run", *SMALL, "--out", d)
    assert code == 2 and "holds a complete run" in err and "--resume" in err and "--force" in err


def test_force_removes_only_what_the_run_wrote(done_run, tmp_path, capsys):
    d = copy_run(done_run, tmp_path / "r")
    (d / "tb" / "exp1").mkdir(parents=True)
    (d / "tb" / "exp1" / "events.x").write_text("mine")
    (d / "analysis.ipynb").write_text("mine")
    (d / ".summary.json.tmp-99999").write_text("stale")  # a killed atomic write of a listed file
    (d / ".notes.tmp-1").write_text("mine")
    before = os.path.getmtime(d / "model_final.pt")
    time.sleep(0.01)
    assert cli(capsys, "run", *SMALL, "--set", "rounds=1", "--force", "--out", d, "--quiet")[0] == 0
    assert (d / "tb" / "exp1" / "events.x").read_text() == "mine" and (d / "analysis.ipynb").read_text() == "mine"
    assert not (d / ".summary.json.tmp-99999").exists() and (d / ".notes.tmp-1").exists()
    assert os.path.getmtime(d / "model_final.pt") != before
    assert json.load(open(d / "summary.json"))["rounds"] == 1


def test_a_held_directory_is_refused_naming_the_holder(done_run, tmp_path, capsys):
    d = copy_run(done_run, tmp_path / "r")
    rd = RunDir(str(d))
    assert rd.open("resume") == "resume"
    try:
        for argv in (["run", *SMALL, "--out", d], ["run", *SMALL, "--force", "--out", d], ["run", "--resume", d]):
            code, err = cli(capsys, *argv)
            assert code == 2 and f"in use by pid {os.getpid()}" in err and "on host" in err, err
    finally:
        rd.close()
    assert (d / "model_final.pt").exists() and (d / LOCK).exists()


def test_a_failed_run_leaves_no_directory(capsys, tmp_path):
    code, _ = cli(
        capsys,
        "run",
        *SMALL,
        "--set",
        f"data_dir={tmp_path / 'x'}",
        "--set",
        "dataset=cifar10",
        "--out",
        tmp_path / "a" / "b" / "c",
    )
    assert code == 2 and not (tmp_path / "a").exists()


def _tree(d):
    """Every file under ``d`` (but the lock file, which the OS's flock needs) -> its bytes."""
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            if f != LOCK:
                out[os.path.relpath(p, d)] = open(p, "rb").read()
    return out


def test_a_failed_force_run_in_an_existing_directory_leaves_it_as_the_user_had_it(done_run, tmp_path, capsys):
    """A --force run that fails before its first round (here: its data is missing) leaves the old run as it was,
    byte for byte, marker included."""
    d = copy_run(done_run, tmp_path / "r")
    (d / "notes.txt").write_text("n")
    before = _tree(d)
    code, _ = cli(
        capsys, "run", *SMALL, "--set", "dataset=cifar10", "--set", f"data_dir={tmp_path / 'x'}", "--force", "--out", d
    )
    assert code == 2 and _tree(d) == before


def test_force_keeps_the_old_run_until_the_new_runs_first_round(done_run, tmp_path, capsys):
    """--force over a complete run with a plug-in whose hook fails in round 1 (after the config checks, after the
    old files were set aside): the old run is put back byte for byte (it was deleted: DIR left empty). Then a
    replacement killed before its first round (SIGKILL: no clean-up of its own) is undone by the next open, and a
    replacement that saves a round leaves no copy of the old run behind."""
    from fedfast.rundir import REPLACED

    d = copy_run(done_run, tmp_path / "r")
    before = _tree(d)
    plugin = tmp_path / "failing.py"
    plugin.write_text(
        "from fedfast.methods import FedAvg, register\n\n\n@register('fails_in_round_one')\n"
        "class Fails(FedAvg):\n    def round_start(self, ctx):\n        raise RuntimeError('my hook failed')\n"
    )
    code, err = cli(
        capsys, "run", "--plugin", plugin, *SMALL, "--set", "algorithm=fails_in_round_one", "--force", "--out", d
    )
    assert code == 2 and "my hook failed" in err, err
    assert _tree(d) == before
    # a replacement SIGKILLed after writing its config: the old run is back at the next open (here: a plain run,
    # refused because the directory holds a complete run)
    script = (
        "import os, sys\nfrom fedfast.rundir import RunDir\nrd = RunDir(sys.argv[1])\n"
        "assert rd.open('force') == 'new'\n"
        "assert os.path.isdir(os.path.join(sys.argv[1], '.fedfast-replaced'))\n"
        "rd.write('config.json', '{}')\nrd.add('tb/events.out.tfevents.1', dirs=('tb',))\n"
        "os.makedirs(os.path.join(sys.argv[1], 'tb'))\nos._exit(9)\n"
    )
    r = subprocess.run([sys.executable, "-c", script, str(d)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    assert _tree(d) != before  # the old run is set aside, the replacement's config in its place
    code, err = cli(capsys, "run", *SMALL, "--out", d)
    assert code == 2 and "holds a complete run" in err, err
    assert _tree(d) == before and not (d / REPLACED).exists() and not (d / "tb").exists()
    code, _ = cli(capsys, "run", *SMALL, "--set", "rounds=1", "--force", "--out", d, "--quiet")
    assert code == 0 and not (d / REPLACED).exists()
    assert json.load(open(d / "summary.json"))["rounds"] == 1 and REPLACED not in (d / MARKER).read_text()


def test_write_atomic_leaves_no_temporary_file_on_failure(tmp_path, monkeypatch):
    from fedfast import _io

    def full(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_io.os, "replace", full)
    with pytest.raises(OSError, match="No space"):
        _io.write_atomic(str(tmp_path / "x.json"), "{}")
    assert os.listdir(tmp_path) == []
    with pytest.raises(TypeError, match="data"):
        _io.write_atomic(str(tmp_path / "x.json"), 3)


def _spawn(out, *extra):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedfast",
            "run",
            *SMALL,
            "--set",
            "rounds=400",
            "--set",
            "threads=1",
            *extra,
            "--quiet",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_processes_on_one_run_directory(tmp_path):
    """Two runs started at once into one directory: one runs, the other is refused at once naming the holder;
    the directory holds one run's files, consistent with each other."""
    out = tmp_path / "same"
    a, b = _spawn(out), _spawn(out)
    t0 = time.time()
    errs = {}
    while time.time() - t0 < 120 and not errs:
        for name, p in (("a", a), ("b", b)):
            if p.poll() is not None:
                errs[name] = (p.returncode, p.stderr.read())
        time.sleep(0.05)
    assert len(errs) == 1, "neither run was refused"
    ((name, (code, err)),) = errs.items()
    other = b if name == "a" else a
    assert code == 2 and f"in use by pid {other.pid}" in err, err
    t0 = time.time()  # the winner has started its rounds (its signal handlers are in place) before it is stopped
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
        assert time.time() - t0 < 120 and other.poll() is None
        time.sleep(0.05)
    other.terminate()
    assert other.wait(60) == 128 + 15
    s = json.load(open(out / "summary.json"))
    m = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert s["rounds"] == m[-1]["round"] and s["best_test_accuracy"] == max(r["test_accuracy"] for r in m)
    assert main(["run", "--resume", str(out), "--set", f"rounds={m[-1]['round'] + 1}", "--quiet"]) == 0


def test_a_sigkilled_run_leaves_no_stale_lock(tmp_path, capsys):
    out = tmp_path / "r"
    p = _spawn(out, "--set", "checkpoint_every=1")
    t0 = time.time()
    while not (out / "checkpoint.pt").exists() and time.time() - t0 < 120:
        time.sleep(0.05)
    rd = RunDir(str(out))
    with pytest.raises(OSError, match=f"in use by pid {p.pid}"):  # held while it runs
        rd.open("resume")
    p.kill()
    p.wait()
    assert rd.open("resume") == "resume"  # the OS released the killed run's lock: a resume is let in
    rd.close()


def test_two_sweeps_split_a_study(tmp_path):
    """Two ``fedfast sweep`` processes on one study run each run once between them."""
    out = tmp_path / "study"
    cmd = [
        sys.executable,
        "-m",
        "fedfast",
        "sweep",
        "--methods",
        "fedavg,fedprox",
        "--seeds",
        "0,1",
        *SWEEP_SMALL,
        "--set",
        "rounds=15",
        "--set",
        "threads=1",
        "--out",
        str(out),
    ]  # one core each
    a = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    b = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    oa, ea = a.communicate(timeout=300)
    ob, eb = b.communicate(timeout=300)
    assert a.returncode == 0 and b.returncode == 0, ea + eb
    ran = [line for line in (oa + ob).splitlines() if "final test_acc" in line]
    assert len(ran) == 4, oa + ob  # each of the 4 runs trained exactly once
    for m in ("fedavg", "fedprox"):
        for s in (0, 1):
            assert json.load(open(out / m / f"seed{s}" / "summary.json"))["status"] == "complete"


# -- divergence -------------------------------------------------------------------------------------------------------
DIVERGE = ["--set", "lr=0.3", "--set", "momentum=0.9", "--set", "rounds=8", "--set", "algorithm=fedntd"]
SWEEP_DIVERGE = DIVERGE[:-2]  # a sweep's methods are --methods


def test_a_diverged_run_is_a_result_not_a_success(tmp_path, capsys):
    out = tmp_path / "div"
    code, err = cli(capsys, "run", *SMALL, *DIVERGE, "--out", out, "--quiet")
    assert code == 4 and "diverged" in err and "round" in err and "fedntd" in err and "lr=0.3" in err, err
    s = json.loads((out / "summary.json").read_text())  # strict JSON: no bare NaN
    assert s["status"] == "diverged" and s["complete"] is False and isinstance(s["diverged_round"], int)
    for line in open(out / "metrics.jsonl"):
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in metrics.jsonl"))
    json.loads((out / "config.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert not (out / "model_final.pt").exists()
    best = torch.load(out / "model_best.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in best.values())
    # a diverged run is not resumed (it would take the same steps again) and a sweep skips it
    code, err = cli(capsys, "run", "--resume", out)
    assert code == 2 and "diverged at round" in err


def test_engine_raises_diverged():
    tr, te = data.synthetic(10, 400, 100, (1, 8, 8), seed=0)
    part = data.iid(tr.y, 4, seed=0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    with torch.no_grad():
        model[1].weight.fill_(float("inf"))
    sim = fedfast.Simulation(fedfast.SimConfig(clients_per_round=2, rounds=2), model, tr, te, part)
    with pytest.raises(fedfast.Diverged, match="round 1: fedavg diverged"):
        sim.round()


def test_report_and_sweep_mark_diverged_runs(tmp_path, capsys):
    out = tmp_path / "study"
    code, err = cli(capsys, "sweep", "--methods", "fedntd", "--seeds", "0", *SWEEP_SMALL, *SWEEP_DIVERGE, "--out", out)
    assert code == 0, err  # the sweep went on and finished
    assert "diverged" in err
    code, err = cli(
        capsys, "sweep", "--methods", "fedntd,fedavg", "--seeds", "0", *SWEEP_SMALL, *SWEEP_DIVERGE, "--out", out
    )
    assert code == 0 and "fedntd seed 0: diverged, skipped" in err, err
    code, text = cli(capsys, "report", out)
    assert code == 0
    row = next(line for line in text.splitlines() if line.startswith("| fedntd"))
    assert "1 of 1 diverged: seed 0 at round" in row and "not in the mean" in row
    assert "diverged run" in text and "left out of the means" in text


# -- the Python API -------------------------------------------------------------------------------------------------
def _sim_inputs():
    tr, te = data.synthetic(10, 200, 50, (1, 8, 8), seed=0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    return tr, te, model, data.iid(tr.y, 4, seed=0)


SIMCONFIG_CASES = [
    (dict(algorithm="nope"), ValueError, "algorithm"),
    (dict(rounds=0), ValueError, "rounds"),
    (dict(lr=0.0), ValueError, "lr"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=True), ValueError, "seed"),
    (dict(options=[1]), TypeError, "options"),
    (dict(algorithm="fedntd", options={"fedntd": {"beta": "x"}}), ValueError, "fedntd.beta"),
    (dict(client_optimizer="rmsprop"), ValueError, "client_optimizer"),
    (dict(adam_betas=(0.9,)), ValueError, "adam_betas"),
    (dict(max_grad_norm=-1.0), ValueError, "max_grad_norm"),
    (dict(client_sampling="x"), ValueError, "client_sampling"),
    (dict(momentum=-0.1), ValueError, "momentum"),
]


@pytest.mark.parametrize(
    "kw,exc,key", SIMCONFIG_CASES, ids=[list(c[0])[-1] + "-" + str(i) for i, c in enumerate(SIMCONFIG_CASES)]
)
def test_simconfig_refuses(kw, exc, key):
    with pytest.raises(exc, match=key):
        fedfast.SimConfig(**kw)


@pytest.mark.parametrize(
    "which,exc,key",
    [
        ("model", TypeError, "model"),
        ("train", TypeError, "train"),
        ("partition", TypeError, "partition"),
        ("device", ValueError, "device"),
        ("config", TypeError, "config"),
        ("range", ValueError, "partition"),
    ],
)
def test_simulation_refuses(which, exc, key):
    tr, te, model, part = _sim_inputs()
    args = dict(config=fedfast.SimConfig(clients_per_round=2), model=model, train=tr, test=te, partition=part)
    if which == "model":
        args["model"] = "resnet"
    elif which == "train":
        args["train"] = [1, 2]
    elif which == "partition":
        args["partition"] = [np.arange(10)]
    elif which == "config":
        args["config"] = {"rounds": 2}
    elif which == "range":
        args["partition"] = data.Partition([np.arange(10), np.arange(5000, 5010)])
    kw = {"device": "cuda"} if which == "device" else {}
    with pytest.raises(exc, match=key):
        fedfast.Simulation(args["config"], args["model"], args["train"], args["test"], args["partition"], **kw)


@pytest.mark.parametrize(
    "call,key",
    [
        (lambda y: data.shards(y, 0), "num_clients"),
        (lambda y: data.iid(y, len(y) + 1), "num_clients"),
        (lambda y: data.dirichlet_lda(y, 10, alpha=-1.0), "alpha"),
        (lambda y: data.Partition([]), "indices"),
        (lambda y: data.Partition([np.array([0, -3])]), "indices: client 0: negative"),
        (lambda y: data.Partition([np.array([0.5, 1.5])]), "indices: client 0"),
        (lambda y: data.Partition([np.arange(3), np.array([], dtype=int)]), "client 1 holds no samples"),
    ],
)
def test_partition_refuses(call, key):
    y = torch.arange(100) % 10
    with pytest.raises(ValueError, match=key):
        call(y)


def test_forged_cifar_batch_runs_no_code(tmp_path):
    """The CIFAR loader unpickles numpy arrays only: a forged batch that asks for os.system is refused before
    anything runs."""
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    flag = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {flag}",))

    (root / "data_batch_1").write_bytes(pickle.dumps({b"data": Evil()}))
    with pytest.raises(ValueError, match="data_batch_1: not an official CIFAR batch.*posix.system|data_batch_1"):
        data.load_cifar(str(tmp_path), 10)
    assert not flag.exists()


def test_cifar_num_classes():
    with pytest.raises(ValueError, match="num_classes"):
        data.load_cifar("x", 7)


@pytest.mark.parametrize(
    "content",
    [b"", b"\x00\x00\x08", b"\x00\x00\x08\x03\x00", b"\x01\x02\x03\x04", b"\x00\x00\x77\x01\x00\x00\x00\x01\x00"],
)
def test_read_idx_names_the_file(content, tmp_path):
    p = tmp_path / "train-images-idx3-ubyte"
    p.write_bytes(content)
    with pytest.raises(ValueError, match="train-images-idx3-ubyte"):
        data.read_idx(str(p))


def test_read_idx_damaged_gzip(tmp_path):
    p = tmp_path / "t10k-labels-idx1-ubyte.gz"
    p.write_bytes(b"\x1f\x8b\x08garbage")
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.gz"):
        data.read_idx(str(p))


def test_array_dataset_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="x and y"):
        data.ArrayDataset(torch.zeros(3, 1, 2, 2, dtype=torch.uint8), torch.zeros(4), 2)


@pytest.mark.parametrize(
    "make,key",
    [
        (lambda: fnn.KDLoss(tau=0.0), "tau"),
        (lambda: fnn.KDLoss(reduction="avg"), "reduction"),
        (lambda: fnn.NTDLoss(tau=float("nan")), "tau"),
        (lambda: fnn.GKDLoss(reduction="median"), "reduction"),
        (lambda: fnn.ADCLoss(tau=-1.0), "tau"),
    ],
)
def test_nn_modules_refuse_bad_options(make, key):
    with pytest.raises(ValueError, match=key):
        make()


@pytest.mark.parametrize(
    "call,exc,key",
    [
        (
            lambda m: m(torch.randn(4, 5, requires_grad=True), torch.randn(4, 6), torch.zeros(4, dtype=torch.long)),
            ValueError,
            "teacher",
        ),
        (
            lambda m: m(torch.randn(4, 5, requires_grad=True), torch.randn(4, 5), torch.full((4,), 9)),
            ValueError,
            "target",
        ),
        (lambda m: m([1.0], torch.randn(4, 5), torch.zeros(4, dtype=torch.long)), TypeError, "student"),
        (
            lambda m: m(torch.randn(4, 5, requires_grad=True), torch.randn(4, 5), torch.zeros(3, dtype=torch.long)),
            ValueError,
            "target",
        ),
    ],
)
def test_nn_forward_refuses_bad_tensors(call, exc, key):
    with pytest.raises(exc, match=key):
        call(fnn.KDLoss(validate="eager"))


def test_a_run_directory_from_before_markers_is_adopted(done_run, tmp_path, capsys):
    """A run written before run markers existed (a fedfast checkpoint, no marker) still resumes, and --force
    still replaces it (its outputs only)."""
    d = copy_run(done_run, tmp_path / "old")
    os.remove(d / MARKER)
    (d / "notes.txt").write_text("n")
    assert cli(capsys, "run", "--resume", d, "--set", "rounds=3", "--quiet")[0] == 0
    assert json.load(open(d / "summary.json"))["rounds"] == 3 and (d / MARKER).exists()
    os.remove(d / MARKER)
    assert cli(capsys, "run", *SMALL, "--set", "rounds=1", "--force", "--out", d, "--quiet")[0] == 0
    assert json.load(open(d / "summary.json"))["rounds"] == 1 and (d / "notes.txt").read_text() == "n"


def test_workers_that_all_fail_at_once_fail_the_run_and_leave_nothing(tmp_path):
    """Both --workers processes refused (missing data) before the launcher polled them: exit 2, not success, and
    no directory left."""
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedfast",
            "run",
            *SMALL,
            "--set",
            "dataset=cifar10",
            "--set",
            f"data_dir={tmp_path / 'nodata'}",
            "--workers",
            "2",
            "--out",
            str(tmp_path / "w" / "x"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and "data_dir" in p.stderr and not (tmp_path / "w").exists(), p.stderr


def test_workers_diverge_together(tmp_path):
    out = tmp_path / "w"
    p = subprocess.run(
        [sys.executable, "-m", "fedfast", "run", *SMALL, *DIVERGE, "--workers", "2", "--quiet", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 4 and "diverged" in p.stderr and "SIGABRT" not in p.stderr, p.stderr
    assert json.loads((out / "summary.json").read_text())["status"] == "diverged"


@pytest.mark.parametrize("then", ["report", "resume"])
def test_report_and_resume_after_a_killed_force_see_the_old_run(done_run, tmp_path, capsys, then):
    """A --force replacement SIGKILLed before it wrote its config (only the marker and the set-aside folder left):
    ``report`` listed ``DIR/.fedfast-replaced`` as a run of its own and the first ``--resume`` said the directory
    was not a run (no config.json); both now put the old run back first (issue 70)."""
    from fedfast.rundir import REPLACED

    d = copy_run(done_run, tmp_path / "r")
    before = _tree(d)
    script = (
        "import os, sys\nfrom fedfast.rundir import RunDir\nrd = RunDir(sys.argv[1])\n"
        "assert rd.open('force') == 'new'\nos._exit(9)\n"
    )
    r = subprocess.run([sys.executable, "-c", script, str(d)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 9 and (d / REPLACED).is_dir() and not (d / "config.json").exists(), r.stderr
    if then == "report":
        code, out = cli(capsys, "report", tmp_path)
        assert code == 0 and "`r`: complete" in out and REPLACED not in out, out
    else:
        code, out = cli(capsys, "run", "--resume", d)  # the old run is complete: its final line again
        assert code == 0 and "final test_acc" in out and "no config.json" not in out, out
    assert not (d / REPLACED).exists()
    if then == "report":
        assert _tree(d) == before
