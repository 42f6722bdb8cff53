"""Run directories: checkpoint/resume (bit for bit after SIGKILL and after SIGTERM), refusal of truncated, corrupt
and mismatched checkpoints, no overwrite without --force, the saved models and summary."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import fedfast
from fedfast import checkpoint, models
from fedfast.cli import main

ARGS = [
    "--set",
    "dataset=synthetic",
    "--set",
    "num_clients=20",
    "--set",
    "clients_per_round=5",
    "--set",
    "algorithm=scaffold",
    "--set",
    "momentum=0.9",
    "--set",
    "local_epochs=2",
    "--set",
    "batch_size=20",
    "--set",
    "augment=fedgkd",
    "--set",
    "model=mlp",
]


def _metrics(d):
    out = []
    for line in open(os.path.join(d, "metrics.jsonl")):
        r = json.loads(line)
        out.append({k: v for k, v in r.items() if k not in ("seconds", "timers")})
    return out


def _final(d):
    return torch.load(os.path.join(d, "model_final.pt"), weights_only=True)


def _spawn(out, rounds, extra=()):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedfast",
            "run",
            *ARGS,
            "--set",
            f"rounds={rounds}",
            "--set",
            "checkpoint_every=1",
            *extra,
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_rounds(out, n, proc, timeout=120):
    path = os.path.join(out, "metrics.jsonl")
    t0 = time.time()
    while time.time() - t0 < timeout:
        if os.path.exists(path) and len(open(path).read().splitlines()) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    raise AssertionError("the run made no progress")


def test_resume_after_sigkill_is_bit_exact(tmp_path):
    """A run killed (SIGKILL, possibly mid-round or mid-write) and resumed ends with the same metrics and final
    model, bit for bit, as one never stopped (SCAFFOLD: per-client state; augmentation: a generator's state)."""
    ref = tmp_path / "ref"
    assert main(["run", *ARGS, "--set", "rounds=7", "--out", str(ref), "--quiet"]) == 0
    out = tmp_path / "killed"
    proc = _spawn(out, 7)
    _wait_rounds(out, 3, proc)
    time.sleep(0.1)
    proc.kill()
    proc.wait()
    done = len(open(out / "metrics.jsonl").read().splitlines())
    assert done < 7, "the run finished before it could be killed"
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert _metrics(out) == _metrics(ref)
    a, b = _final(out), _final(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.load(open(out / "summary.json"))["complete"] is True


def test_sigterm_checkpoints_then_resumes(tmp_path):
    out = tmp_path / "run"
    proc = _spawn(out, 40, ("--set", "checkpoint_every=0"))
    _wait_rounds(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "--resume" in err, err[-1000:]
    s = json.load(open(out / "summary.json"))
    n = len(_metrics(out))
    assert s["complete"] is False and s["rounds"] == n < 40
    assert checkpoint.load(str(out / "checkpoint.pt"))["state"]["round"] == n
    assert main(["run", "--resume", str(out), "--set", f"rounds={n + 2}", "--quiet"]) == 0
    assert [r["round"] for r in _metrics(out)] == list(range(1, n + 3))


def test_refuses_truncated_corrupt_and_mismatched_checkpoints(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(["run", *ARGS, "--set", "rounds=2", "--out", str(out), "--quiet"]) == 0
    ck = out / "checkpoint.pt"
    good = ck.read_bytes()

    def refused(msg):
        assert main(["run", "--resume", str(out), "--quiet"]) == 2
        assert msg in capsys.readouterr().err

    ck.write_bytes(good[: len(good) // 2])
    refused("checksum mismatch")
    ck.write_bytes(good[:40])
    refused("truncated")
    bad = bytearray(good)
    bad[-100] ^= 0xFF
    ck.write_bytes(bytes(bad))
    refused("corrupt")
    ck.write_bytes(b"PK\x03\x04 not ours")
    refused("not a fedfast checkpoint")
    ck.write_bytes(good)
    cfg = json.load(open(out / "config.json"))
    (out / "config.json").write_text(json.dumps({**cfg, "lr": 0.5}))
    refused("differs in lr")
    (out / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr("fedfast.runner.__version__", "9.9.9")
    refused("this is fedfast 9.9.9")
    monkeypatch.undo()
    assert main(["run", "--resume", str(out), "--set", "lr=0.5"]) == 2
    assert "cannot change when resuming" in capsys.readouterr().err
    # a checkpoint is plain data: loading never unpickles an object
    import io
    import pickle

    evil = io.BytesIO()
    pickle.dump({"x": fedfast.SimConfig()}, evil)
    import hashlib

    ck.write_bytes(checkpoint.MAGIC + hashlib.sha256(evil.getvalue()).hexdigest().encode() + b"\n" + evil.getvalue())
    refused("unreadable checkpoint payload")


def test_no_overwrite_without_force(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", *ARGS, "--set", "rounds=1", "--out", str(out), "--quiet"]
    assert main(args) == 0
    before = (out / "metrics.jsonl").read_text()
    assert main(args) == 2 and "--force" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == before
    assert main(args + ["--force"]) == 0


def test_outputs_models_summary_and_csv(tmp_path):
    out = tmp_path / "run"
    assert main(["run", *ARGS, "--set", "rounds=4", "--set", "eval_every=2", "--out", str(out), "--quiet"]) == 0
    hist = [json.loads(s) for s in open(out / "metrics.jsonl")]
    s = json.load(open(out / "summary.json"))
    ev = [h for h in hist if h["test_accuracy"] is not None]
    assert [h["round"] for h in ev] == [2, 4]
    assert s["final_test_accuracy"] == ev[-1]["test_accuracy"] and s["best_test_accuracy"] == max(
        h["test_accuracy"] for h in ev
    )
    assert s["mean_last10_test_accuracy"] == pytest.approx(sum(h["test_accuracy"] for h in ev) / 2)
    assert s["wall_seconds"] == pytest.approx(sum(h["seconds"] for h in hist))
    rows = (out / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("round,test_accuracy") and len(rows) == 5 and rows[1].split(",")[1] == ""
    model = models.MLP(784, (200, 200), 10)
    model.load_state_dict(torch.load(out / "model_final.pt", weights_only=True))  # one line, plain weights
    from fedfast import data

    _, test = data.synthetic(10, 5000, 1000, (1, 28, 28), seed=0)
    x, y = test.batch(torch.arange(len(test)))
    with torch.no_grad():
        acc = float((model(x).argmax(1) == y).float().mean())
    assert acc == pytest.approx(ev[-1]["test_accuracy"], abs=1e-6)
    model.load_state_dict(torch.load(out / "model_best.pt", weights_only=True))
    with torch.no_grad():
        assert float((model(x).argmax(1) == y).float().mean()) == pytest.approx(s["best_test_accuracy"], abs=1e-6)


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    assert main(["run", *ARGS, "--set", "rounds=2", "--set", "tensorboard=true", "--out", str(out), "--quiet"]) == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("test_accuracy")] == [1, 2]


@pytest.mark.slow
def test_workers_equal_one_process_and_a_dead_worker_fails_fast(tmp_path):
    """--workers 2: two local processes over torch.distributed give the one-process run's metrics and model; a
    worker killed mid-run stops the run within seconds with a message naming it, and --resume continues."""
    one, two = tmp_path / "one", tmp_path / "two"
    ntd = [*ARGS, "--set", "algorithm=fedntd", "--set", "rounds=3"]  # teacher and augmentation on every step
    assert main(["run", *ntd, "--out", str(one), "--quiet"]) == 0
    assert main(["run", *ntd, "--workers", "2", "--out", str(two), "--quiet"]) == 0
    # equal up to the summation order of the all-reduce (augmentation included: it does not depend on the split;
    # SCAFFOLD's multi-process equality: test_distributed)
    for a, b in zip(_metrics(one), _metrics(two), strict=True):
        assert a["test_accuracy"] == b["test_accuracy"]
        assert abs(a["test_loss"] - b["test_loss"]) <= 1e-5 * a["test_loss"]
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-5 * a["train_loss"]
    fa, fb = (torch.cat([v.reshape(-1) for v in _final(d).values()]) for d in (one, two))
    assert (fa - fb).abs().max() <= 1e-5 * fa.abs().max()

    out = tmp_path / "dead"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedfast",
            "run",
            *ARGS,
            "--set",
            "rounds=200",
            "--set",
            "checkpoint_every=1",
            "--workers",
            "2",
            "--out",
            str(out),
            "--quiet",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    _wait_rounds(out, 2, proc)
    kids = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "spawn_main"], capture_output=True, text=True)
    pids = [int(p) for p in kids.stdout.split()]
    assert len(pids) == 2, kids
    t0 = time.time()
    os.kill(pids[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert time.time() - t0 < 30 and proc.returncode == 3, err[-2000:]
    assert "died with signal SIGKILL" in err and "--resume" in err
    done = checkpoint.load(str(out / "checkpoint.pt"))["state"]["round"]
    assert main(["run", "--resume", str(out), "--workers", "2", "--set", f"rounds={done + 1}", "--quiet"]) == 0
    assert json.load(open(out / "summary.json"))["complete"] is True


def test_adam_run_resumes_to_the_uninterrupted_result(tmp_path):
    """client_optimizer = adamw with its betas from --set: 3 rounds straight equal 2 rounds then --resume to 3 (the
    tuple-valued adam_betas survives config.json and the checkpoint's config check)."""
    opt = [
        "--set",
        "algorithm=fedntd",
        "--set",
        "client_optimizer=adamw",
        "--set",
        "adam_betas=0.8,0.99",
        "--set",
        "momentum=0",
        "--set",
        "lr=1e-3",
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["run", *ARGS, *opt, "--set", "rounds=3", "--out", str(a), "--quiet"]) == 0
    assert main(["run", *ARGS, *opt, "--set", "rounds=2", "--out", str(b), "--quiet"]) == 0
    assert main(["run", "--resume", str(b), "--set", "rounds=3", "--quiet"]) == 0
    assert json.load(open(b / "config.json"))["adam_betas"] == [0.8, 0.99]
    assert _metrics(a) == _metrics(b)
    assert all(torch.equal(x, y) for x, y in zip(_final(a).values(), _final(b).values(), strict=True))


def test_threads_are_recorded_and_a_resume_keeps_them(tmp_path, capsys):
    """config.json records the thread count and the determinism settings; a resume runs with the recorded count
    (bit-exact whatever this process's default), and says so when told to use another."""
    old = torch.get_num_threads()
    try:
        ref, cut = tmp_path / "ref", tmp_path / "cut"
        assert main(["run", *ARGS, "--set", "rounds=4", "--set", "threads=2", "--out", str(ref), "--quiet"]) == 0
        assert (
            main(
                [
                    "run",
                    *ARGS,
                    "--set",
                    "rounds=2",
                    "--set",
                    "threads=2",
                    "--set",
                    "checkpoint_every=1",
                    "--out",
                    str(cut),
                    "--quiet",
                ]
            )
            == 0
        )
        cfg = json.load(open(cut / "config.json"))
        assert cfg["threads"] == 2 and cfg["determinism"]["threads"] == 2
        assert set(cfg["determinism"]) >= {"deterministic_algorithms", "float32_matmul_precision", "interop_threads"}
        torch.set_num_threads(1)
        capsys.readouterr()
        assert main(["run", "--resume", str(cut), "--set", "rounds=4", "--quiet"]) == 0
        assert "bit-exact" not in capsys.readouterr().err
        assert json.load(open(cut / "config.json"))["determinism"]["threads"] == 2  # the resume ran with 2
        assert torch.get_num_threads() == 1  # and gave the process its own count back
        assert _metrics(cut) == _metrics(ref)
        a, b = _final(cut), _final(ref)
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert main(["run", "--resume", str(cut), "--set", "rounds=5", "--set", "threads=1", "--quiet"]) == 0
        err = capsys.readouterr().err
        assert "threads: 1 now, 2 when the run was checkpointed" in err and "not bit-exact" in err
        assert json.load(open(cut / "config.json"))["threads"] == 1
    finally:
        torch.set_num_threads(old)
