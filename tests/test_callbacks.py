"""fedfast.callbacks: the run loop's order of calls, and each callback alone against a stand-in Simulation
(issue 37): the record files, checkpoints, TensorBoard, progress lines and the stop on a signal."""

import json
import os
import signal

import pytest
import torch

from fedfast import Diverged, SimConfig
from fedfast.callbacks import (
    Callback,
    Checkpointer,
    Progress,
    RunFiles,
    StopOnSignal,
    TensorBoard,
    best_round,
    run_rounds,
)
from fedfast.checkpoint import load as load_checkpoint
from fedfast.collectives import Local
from fedfast.rundir import RunDir

ACCS = [0.5, None, 0.7, 0.6, 0.8]  # test accuracy per round (None: not evaluated)


class FakeSim:
    """What the callbacks read of a Simulation: rnd, history, device, comm, round(), checkpoint(), state_dict()."""

    def __init__(self, accs=ACCS, diverge_at=None):
        self.rnd, self.history, self.accs, self.diverge_at = 0, [], accs, diverge_at
        self.device, self.comm = torch.device("cpu"), Local()

    def round(self):
        if self.rnd + 1 == self.diverge_at:
            raise Diverged(self.rnd + 1, "fedavg", "the training loss", SimConfig(), self._rec(self.rnd + 1))
        self.rnd += 1
        rec = self._rec(self.rnd)
        self.history.append(rec)
        return rec

    def _rec(self, r):
        acc = self.accs[r - 1]
        best = max([a for a in self.accs[:r] if a is not None], default=None)
        return {
            "round": r,
            "test_accuracy": acc,
            "test_loss": 1.0 if acc is not None else None,
            "train_loss": 2.0,
            "best_test_accuracy": best,
            "forgetting": None,
            "seconds": 0.1,
            "clients": [0, 1],
            "method_metrics": {"m": float(r)},
        }

    def checkpoint(self):
        return {"round": self.rnd}

    def state_dict(self):
        return {"w": torch.full((2,), float(self.rnd))}


class Log(Callback):
    def __init__(self, name, log, stop_at=None):
        self.name, self.log, self.stop_at = name, log, stop_at

    def on_start(self, sim):
        self.log.append((self.name, "start", sim.rnd))

    def on_round(self, sim, rec):
        self.log.append((self.name, "round", rec["round"]))

    def stop_requested(self, sim):
        return signal.SIGTERM if sim.rnd == self.stop_at else 0

    def on_interrupt(self, sim, signum):
        self.log.append((self.name, "interrupt", sim.rnd))

    def on_diverged(self, sim, err):
        self.log.append((self.name, "diverged", err.round))

    def on_end(self, sim):
        self.log.append((self.name, "end", sim.rnd))

    def close(self):
        self.log.append((self.name, "close"))


def _rd(tmp_path):
    rd = RunDir(str(tmp_path / "run"))
    rd.open("new")
    return rd


def test_the_loop_calls_each_callback_in_order():
    log = []
    assert run_rounds(FakeSim(), 2, [Log("a", log), Log("b", log)]) == 0
    assert log == [
        ("a", "start", 0),
        ("b", "start", 0),
        ("a", "round", 1),
        ("b", "round", 1),
        ("a", "round", 2),
        ("b", "round", 2),
        ("a", "end", 2),
        ("b", "end", 2),
        ("a", "close"),
        ("b", "close"),
    ]
    log.clear()
    assert run_rounds(FakeSim(), 5, [Log("a", log, stop_at=2)]) == signal.SIGTERM
    assert log[-2:] == [("a", "interrupt", 2), ("a", "close")] and ("a", "end", 2) not in log
    log.clear()
    with pytest.raises(Diverged):
        run_rounds(FakeSim(diverge_at=3), 5, [Log("a", log)])
    assert log[-2:] == [("a", "diverged", 3), ("a", "close")]


def test_run_files_write_metrics_best_model_and_summary(tmp_path):
    rd, sim = _rd(tmp_path), FakeSim()
    files = RunFiles(rd, {"algorithm": "fedavg", "seed": 0, "rounds": 5}, [])
    run_rounds(sim, 5, [files])
    lines = [json.loads(x) for x in open(os.path.join(rd.path, "metrics.jsonl"))]
    assert [x["round"] for x in lines] == [1, 2, 3, 4, 5] and "clients" not in lines[0]
    assert files.best_round == 5 == best_round(sim.history)
    assert float(torch.load(os.path.join(rd.path, "model_best.pt"))["w"][0]) == 5
    assert float(torch.load(os.path.join(rd.path, "model_final.pt"))["w"][0]) == 5
    files.summary(sim, True)
    s = json.load(open(os.path.join(rd.path, "summary.json")))
    assert (s["status"], s["best_test_accuracy"], s["best_round"], s["final_test_accuracy"]) == (
        "complete",
        0.8,
        5,
        0.8,
    )
    assert open(os.path.join(rd.path, "metrics.csv")).read().splitlines()[0].startswith("round,test_accuracy")


def test_run_files_keep_a_resumed_runs_best_and_record_a_divergence(tmp_path):
    rd = _rd(tmp_path)
    sim = FakeSim(accs=[0.9, 0.5, 0.6], diverge_at=3)
    files = RunFiles(rd, {"algorithm": "fedavg"}, [{"round": 0, "test_accuracy": 0.95}])  # the earlier rounds' best
    with pytest.raises(Diverged):
        run_rounds(sim, 3, [files])
    assert not os.path.exists(os.path.join(rd.path, "model_best.pt"))  # 0.9 and 0.5 do not beat 0.95
    lines = [json.loads(x) for x in open(os.path.join(rd.path, "metrics.jsonl"))]
    assert [x["round"] for x in lines] == [1, 2, 3]  # the diverged round's record is the last line
    s = json.load(open(os.path.join(rd.path, "summary.json")))
    assert s["status"] == "diverged" and s["diverged_round"] == 3


def test_checkpointer_every_n_rounds_on_a_signal_and_at_the_end(tmp_path):
    rd, sim = _rd(tmp_path), FakeSim()
    path = os.path.join(rd.path, "checkpoint.pt")
    files = RunFiles(rd, {"algorithm": "fedavg"}, [])
    saved = []
    ck = Checkpointer(rd, path, {"version": "x"}, 2, 5, files)
    real = ck.save
    ck.save = lambda s, complete: (saved.append((s.rnd, complete)), real(s, complete))
    run_rounds(sim, 5, [files, ck])
    assert saved == [(2, False), (4, False), (5, True)]  # every 2 rounds before the last; the last one complete
    got = load_checkpoint(path)
    assert got["version"] == "x" and got["state"] == {"round": 5} and got["threads"] == torch.get_num_threads()
    assert json.load(open(os.path.join(rd.path, "summary.json")))["complete"] is True
    saved.clear()
    sim2 = FakeSim()
    run_rounds(sim2, 5, [files, ck, Log("stop", [], stop_at=2)])  # a signal at a checkpoint round: saved once
    assert saved == [(2, False)] and ck.saved_round == 2
    saved.clear()
    run_rounds(FakeSim(), 5, [files, ck, Log("stop", [], stop_at=3)])
    assert saved == [(2, False), (3, False)]


def test_tensorboard_logs_each_rounds_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rd = _rd(tmp_path)
    tb = TensorBoard(rd)
    run_rounds(FakeSim(), 3, [tb])
    ev = EventAccumulator(os.path.join(rd.path, "tb"))
    ev.Reload()
    assert [s.step for s in ev.Scalars("test_accuracy")] == [1, 3] and [s.value for s in ev.Scalars("method/m")] == [
        1.0,
        2.0,
        3.0,
    ]
    assert any(n.startswith("tb/") for n in rd.read_marker()["files"])  # the event file is the run's


def test_progress_prints_a_line_per_round_unless_quiet(capsys):
    run_rounds(FakeSim(), 2, [Progress(2, 0, quiet=False, label="x")])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("x  round    1/2  test_acc  50.00%") and "train_loss 2.0000" in out[1]
    run_rounds(FakeSim(), 2, [Progress(2, 0, quiet=True)])
    assert capsys.readouterr().out == ""


def test_stop_on_signal_ends_after_the_round_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopOnSignal()

    class Kill(Callback):
        def on_round(self, sim, rec):
            if rec["round"] == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # arrives while the run is going: noted, not fatal

    sim = FakeSim()
    assert run_rounds(sim, 5, [Kill(), stop]) == signal.SIGTERM and sim.rnd == 2
    assert signal.getsignal(signal.SIGTERM) is before
