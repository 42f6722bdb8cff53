"""Errors that name their cause: a hook's wrong return named with the hook, its file and line; a file that cannot be
written named with its path and how to continue (a full disk, a size limit)."""

import json
import os
import resource
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from sequential_loop import setup_data

import fedfast
from fedfast import methods
from fedfast.cli import main
from fedfast.methods import FedAvg, opt, register, unregister

HERE = os.path.dirname(os.path.abspath(__file__))


def _line_of(cls, hook: str) -> int:
    return getattr(cls, hook).__code__.co_firstlineno


@pytest.fixture(autouse=True)
def _unregister():
    yield
    for n in ("rowloss", "detached", "badserver", "badterms", "badeval"):
        unregister(n)


def _sim(alg, **kw):
    train, test, part, model = setup_data()
    return fedfast.Simulation(
        fedfast.SimConfig(algorithm=alg, clients_per_round=3, batch_size=16, **kw), model, train, test, part
    )


def test_a_loss_returning_per_row_losses_is_named_with_file_and_line():
    @register("rowloss")
    class RowLoss(FedAvg):
        @dataclass
        class Options:
            x: int = opt(0, "nothing")

        def loss(self, ctx, b):  # per-row losses [R], not their per-client means summed
            return torch.nn.functional.cross_entropy(b.logits, b.target, reduction="none", ignore_index=-100)

    with pytest.raises(TypeError) as e:
        _sim("rowloss").round()
    msg = str(e.value)
    assert msg.startswith(
        f"rowloss.loss ({__file__}, line {_line_of(RowLoss, 'loss')}): must return one number: a 0-d float tensor"
    ), msg
    assert "weighted_mean_rows" in msg and "got a torch.float32 tensor of shape (48,)" in msg


def test_a_loss_without_a_gradient_is_named():
    @register("detached")
    class Detached(FedAvg):
        @dataclass
        class Options:
            x: int = opt(0, "nothing")

        def loss(self, ctx, b):
            return super().loss(ctx, b).detach()

    with pytest.raises(
        TypeError,
        match=r"detached.loss \(.*test_named_errors.py, line \d+\): must return .* has no "
        r"gradient",
    ):
        _sim("detached").round()


def test_a_loss_fn_of_the_wrong_shape_is_named():
    train, test, part, model = setup_data()

    def my_loss(z, t, y, seg, n):
        return torch.nn.functional.cross_entropy(z, y, reduction="none", ignore_index=-100)

    sim = fedfast.Simulation(fedfast.SimConfig(clients_per_round=3), model, train, test, part, loss_fn=my_loss)
    with pytest.raises(
        TypeError,
        match=rf"loss_fn \({__file__}, line {my_loss.__code__.co_firstlineno}\): must "
        rf"return one number",
    ):
        sim.round()


@pytest.mark.parametrize(
    "hook,body,msg",
    [
        (
            "server",
            "return avg[:-1]",
            r"must return the new global model, a float tensor \[P\] = \(\d+,\) on cpu, got a "
            r"torch.float32 tensor of shape \(\d+,\)",
        ),
        ("server", "return avg.long()", r"must return the new global model.*got a torch.int64 tensor"),
        (
            "step_terms",
            "return [1]",
            r"must return a dict of fedfast.ops.client_step keyword arguments.*got list \[1\]",
        ),
        ("evaluated", "return None", r"must return the model to evaluate.*got NoneType None"),
    ],
)
def test_a_server_or_step_hook_returning_the_wrong_thing_is_named(hook, body, msg):
    name = {"server": "badserver", "step_terms": "badterms", "evaluated": "badeval"}[hook]
    ns = {}
    args = {"server": "self, ctx, avg", "step_terms": "self, ctx, n", "evaluated": "self, flat"}[hook]
    exec(f"def {hook}({args}):\n    {body}\n", ns)  # noqa: S102
    cls = register(name)(type(name, (FedAvg,), {hook: ns[hook], "__module__": __name__}))
    with pytest.raises(TypeError, match=rf"{name}.{hook} \(<string>, line 1\): {msg}"):
        sim = _sim(name)
        sim.round()
    assert cls is methods.get(name)


# -- files that cannot be written ------------------------------------------------------------------------------
SMALL = [
    "--set",
    "dataset=synthetic",
    "--set",
    "num_clients=6",
    "--set",
    "clients_per_round=2",
    "--set",
    "partition=iid",
    "--set",
    "model=mlp",
    "--quiet",
]


def test_a_full_disk_names_the_file_and_how_to_continue(tmp_path, monkeypatch, capsys):
    """ENOSPC while writing the checkpoint of round 4: the message names checkpoint.pt and the round the last good
    checkpoint holds; --resume then finishes the run equal to one never stopped."""
    from fedfast import _io

    real = _io.os.fsync
    state = {"n": 0}

    def full(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if "checkpoint.pt" in path:
            state["n"] += 1
            if state["n"] == 2:  # the second checkpoint (round 4)
                raise OSError(28, "No space left on device")
        return real(fd)

    out, ref = tmp_path / "r", tmp_path / "ref"
    assert main(["run", *SMALL, "--set", "rounds=5", "--set", "checkpoint_every=2", "--out", str(ref)]) == 0
    monkeypatch.setattr(_io.os, "fsync", full)
    capsys.readouterr()
    assert main(["run", *SMALL, "--set", "rounds=5", "--set", "checkpoint_every=2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        f"{out}/checkpoint.pt: could not be written (No space left on device); the run's files up to its "
        f"checkpoint of round 2 are intact: free space (or lift the limit) and continue with `fedfast run "
        f"--resume {out}`" in err
    ), err
    assert not any(f.startswith(".checkpoint.pt.tmp") for f in os.listdir(out))
    monkeypatch.setattr(_io.os, "fsync", real)
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    a = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    assert [r["test_loss"] for r in a] == [r["test_loss"] for r in b]


def test_a_file_size_limit_names_the_file_in_a_real_process(tmp_path):
    """The OS refuses the write (RLIMIT_FSIZE: EFBIG, the way a quota or a full disk refuses it): the run exits 2
    naming the file it was writing, no traceback."""

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # the model file is ~800 KB

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "r"
    r = subprocess.run(
        [sys.executable, "-m", "fedfast", "run", *SMALL, "--set", "rounds=2", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=limit,
        timeout=300,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{out}/model_best.pt: could not be written (File too large)" in r.stderr, r.stderr
    assert "start it again with `--force`" in r.stderr


def test_a_hook_error_in_a_worker_process_is_a_named_error_not_a_dead_worker(tmp_path):
    plugin = tmp_path / "rows.py"
    plugin.write_text(
        "import torch\nfrom fedfast.methods import FedAvg, register\n\n\n@register('rowloss2')\n"
        "class RowLoss(FedAvg):\n    def loss(self, ctx, b):\n"
        "        return torch.nn.functional.cross_entropy(b.logits, b.target, reduction='none',\n"
        "                                                 ignore_index=-100)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedfast",
            "run",
            "--plugin",
            str(plugin),
            *SMALL,
            "--set",
            "algorithm=rowloss2",
            "--set",
            "rounds=1",
            "--workers",
            "2",
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"rowloss2.loss ({plugin}, line 7): must return one number" in r.stderr, r.stderr
