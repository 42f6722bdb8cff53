"""The run loop and its callbacks (pfl-research's model): :func:`run_rounds` runs a Simulation's rounds and calls
each :class:`Callback` at fixed points; everything a run does besides its rounds is a callback, each testable alone
(``tests/test_callbacks.py``):

* :class:`RunFiles`: ``metrics.jsonl`` (a line per round, flushed), ``metrics.csv``, ``summary.json``,
  ``model_best.pt`` (on each new best test accuracy) and ``model_final.pt``;
* :class:`Checkpointer`: ``checkpoint.pt`` every ``checkpoint_every`` rounds, when a signal stops the run, and at
  the end (the summary beside it);
* :class:`TensorBoard`: the records' scalars into ``tb/`` (the optional ``tensorboard`` package);
* :class:`Progress`: a bar (tqdm on a terminal) or a line per round;
* :class:`StopOnSignal`: SIGINT / SIGTERM end the run after the round in progress (under torch.distributed: on
  every rank at the same round).

A callback's hooks, in the order the loop calls them: ``on_start`` (before the first round), ``on_round`` (after
each round, with its record), ``stop_requested`` (a signal number ends the run after this round), ``on_interrupt``
(then, before the loop returns the signal), ``on_diverged`` (a :class:`fedfast.Diverged` round, re-raised after),
``on_end`` (every round done) and ``close`` (always, last). The callbacks are called in list order."""

from __future__ import annotations

import csv
import io
import os
import platform
import signal
import sys
import time

import torch

from . import __version__
from ._io import append_line
from .checkpoint import save as save_checkpoint
from .rundir import RunDir, dumps
from .sim.diverged import Diverged


class Callback:
    """A run loop's hooks; each does nothing here (override the ones a callback needs)."""

    def on_start(self, sim) -> None:
        """Before the first round of this process's loop (a resumed run: after the restore)."""

    def on_round(self, sim, rec: dict) -> None:
        """After each round, with its record (``sim.rnd`` has advanced)."""

    def stop_requested(self, sim) -> int:
        """A signal number to end the run after this round (0: go on)."""
        return 0

    def on_interrupt(self, sim, signum: int) -> None:
        """The run ends after this round because of ``signum``."""

    def on_diverged(self, sim, err: Diverged) -> None:
        """A round diverged (``err.record``: its record, or None); the loop re-raises ``err`` after."""

    def on_end(self, sim) -> None:
        """Every round is done."""

    def close(self) -> None:
        """Always called, last (after an error too)."""


def run_rounds(sim, rounds: int, callbacks: list[Callback]) -> int:
    """Rounds of ``sim`` until it has done ``rounds``, the callbacks called at each point (module docstring).
    Returns 0 when every round ran, or the signal that ended the run early; :class:`fedfast.Diverged` propagates
    (after ``on_diverged``)."""
    try:
        for cb in callbacks:
            cb.on_start(sim)
        while sim.rnd < rounds:
            try:
                rec = sim.round()
            except Diverged as e:
                for cb in callbacks:
                    cb.on_diverged(sim, e)
                raise
            for cb in callbacks:
                cb.on_round(sim, rec)
            sig = max((cb.stop_requested(sim) for cb in callbacks), default=0)
            if sig:
                for cb in callbacks:
                    cb.on_interrupt(sim, sig)
                return sig
        for cb in callbacks:
            cb.on_end(sim)
        return 0
    finally:
        for cb in callbacks:
            cb.close()


def best_round(history: list[dict]) -> int | None:
    """The round of the best test accuracy in ``history`` (None before an evaluation)."""
    return max(
        (h for h in history if h["test_accuracy"] is not None), key=lambda h: h["test_accuracy"], default={}
    ).get("round")


class RunFiles(Callback):
    """The run's record files in ``rd``: ``metrics.jsonl`` (appended a line per round, flushed), ``model_best.pt``
    (on a new best test accuracy), and on demand (:meth:`summary`) ``metrics.csv`` and ``summary.json``; at the
    end ``model_final.pt`` (and ``model_best.pt`` when no round was evaluated). ``history``: the rounds before
    this process's loop (a resumed run's), whose best the next rounds must beat."""

    def __init__(self, rd: RunDir, cfg_json: dict, history: list[dict]):
        self.rd, self.cfg_json = rd, cfg_json
        self.path = os.path.join(rd.path, "metrics.jsonl")
        evs = [h["test_accuracy"] for h in history if h["test_accuracy"] is not None]
        self.best = max(evs) if evs else None
        self.best_round = best_round(history)
        self.f = None

    def on_start(self, sim) -> None:
        self.f = open(self.path, "a")

    def on_round(self, sim, rec: dict) -> None:
        append_line(self.f, self.path, dumps(jsonable(rec)) + "\n")
        self.rd.saved = True
        if rec["test_accuracy"] is not None and (self.best is None or rec["test_accuracy"] > self.best):
            self.best, self.best_round = rec["test_accuracy"], rec["round"]
            self.rd.write("model_best.pt", model_bytes(sim))

    def on_diverged(self, sim, err: Diverged) -> None:
        if err.record is not None:
            append_line(self.f, self.path, dumps(jsonable(err.record)) + "\n")
        self.summary(sim, False, err)
        self.rd.saved = True

    def on_end(self, sim) -> None:
        self.rd.write("model_final.pt", model_bytes(sim))
        if self.best is None:
            self.rd.write("model_best.pt", model_bytes(sim))

    def summary(self, sim, complete: bool, diverged: Diverged | None = None) -> None:
        """``metrics.csv`` and ``summary.json`` from the history so far."""
        self.rd.write("metrics.csv", csv_text(sim.history))
        self.rd.write(
            "summary.json", dumps(summarize(sim.history, self.cfg_json, str(sim.device), complete, diverged), indent=2)
        )

    def close(self) -> None:
        if self.f is not None:
            try:
                self.f.close()
            except OSError:
                pass


class Checkpointer(Callback):
    """``checkpoint.pt`` in ``rd`` (at ``path``): ``header`` (version, config, fingerprint) with the Simulation's
    checkpoint and the thread count, every ``every`` rounds before the last (0: never), when a signal ends the
    run, and after the last round; ``files.summary`` beside each. ``saved_round``: the round the newest checkpoint
    holds (a resumed run starts with the one it restored)."""

    def __init__(
        self, rd: RunDir, path: str, header: dict, every: int, rounds: int, files: RunFiles, *, saved_round: int = 0
    ):
        self.rd, self.path, self.header, self.every, self.rounds, self.files = rd, path, header, every, rounds, files
        self.saved_round = saved_round

    def save(self, sim, complete: bool) -> None:
        self.rd.add("checkpoint.pt")
        save_checkpoint(self.path, {**self.header, "state": sim.checkpoint(), "threads": torch.get_num_threads()})
        self.saved_round = sim.rnd
        self.files.summary(sim, complete)
        self.rd.saved = True

    def on_round(self, sim, rec: dict) -> None:
        if self.every and sim.rnd % self.every == 0 and sim.rnd < self.rounds:
            self.save(sim, False)

    def on_interrupt(self, sim, signum: int) -> None:
        if self.saved_round != sim.rnd:
            self.save(sim, False)

    def on_end(self, sim) -> None:
        self.save(sim, True)


class TensorBoard(Callback):
    """Each round's metrics, seconds and the method's own values as TensorBoard scalars in ``rd``'s ``tb/`` (a
    resumed run purges the steps after the round it resumes from); the event files go into the run's marker."""

    def __init__(self, rd: RunDir):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError(
                "tensorboard: needs the `tensorboard` package (pip install tensorboard, or the "
                "fedfast[tensorboard] extra)"
            ) from None
        self.rd, self._writer_cls, self.w = rd, SummaryWriter, None
        self.dir = os.path.join(rd.path, "tb")
        self.before: set = set()

    def on_start(self, sim) -> None:
        if not os.path.isdir(self.dir):
            self.rd.add(dirs=("tb",))
        self.before = set(os.listdir(self.dir)) if os.path.isdir(self.dir) else set()
        self.w = self._writer_cls(self.dir, purge_step=sim.rnd + 1)
        self._list()  # the event file exists from here on: listed before the first round's scalars

    def on_round(self, sim, rec: dict) -> None:
        for k in (
            "test_accuracy",
            "test_loss",
            "train_loss",
            "best_test_accuracy",
            "forgetting",
            "val_accuracy",
            "val_loss",
        ):
            if rec.get(k) is not None:
                self.w.add_scalar(k, rec[k], rec["round"])
        if rec["seconds"] is not None:  # None: a private run's (unaccounted)
            self.w.add_scalar("seconds", rec["seconds"], rec["round"])
        for k, v in (rec.get("method_metrics") or {}).items():
            self.w.add_scalar(f"method/{k}", v, rec["round"])

    def close(self) -> None:
        if self.w is not None:
            self.w.close()
            self._list()

    def _list(self) -> None:
        """The event files this run's writer made go into the marker (files someone else put in tb/ do not)."""
        if os.path.isdir(self.dir):
            new = set(os.listdir(self.dir)) - self.before
            self.rd.add(*sorted(f"tb/{n}" for n in new if os.path.isfile(os.path.join(self.dir, n))))


class Progress(Callback):
    """A live bar over rounds (tqdm, on a terminal) or one plain line per round; nothing when ``quiet``."""

    def __init__(self, total: int, initial: int, quiet: bool, label: str = ""):
        self.quiet, self.total, self.label = quiet, total, label
        self.bar = None
        self.t0, self.n0 = time.perf_counter(), initial
        if not quiet and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, unit="round", desc=label or None, dynamic_ncols=True)
            except ImportError:
                pass

    def on_round(self, sim, rec: dict) -> None:
        self.update(rec)

    def update(self, rec: dict) -> None:
        if self.quiet:
            return
        acc = rec["test_accuracy"]
        fields = {
            "acc": f"{100 * acc:.2f}%" if acc is not None else "-",
            "best": f"{100 * rec['best_test_accuracy']:.2f}%" if rec["best_test_accuracy"] is not None else "-",
            "loss": f"{rec['train_loss']:.4f}" if rec["train_loss"] is not None else "-",
        }
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
            return
        done = rec["round"] - self.n0
        per = (time.perf_counter() - self.t0) / max(done, 1)
        eta = per * (self.total - rec["round"])
        print(
            f"{self.label + '  ' if self.label else ''}round {rec['round']:4d}/{self.total}  test_acc "
            f"{fields['acc']:>7}  best {fields['best']:>7}  train_loss {fields['loss']}  "
            + (f"test_loss {rec['test_loss']:.4f}  " if rec["test_loss"] is not None else "")
            + (f"{rec['seconds']:.2f}s  " if rec["seconds"] is not None else "")
            + f"eta {time.strftime('%H:%M:%S', time.gmtime(eta))}",
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class StopOnSignal(Callback):
    """SIGINT / SIGTERM noted while a round runs end the run after it (outside the main thread: no handlers);
    under torch.distributed any rank's signal ends it on every rank (one all-reduce of a flag per round). The old
    handlers come back at :meth:`close`."""

    def __init__(self):
        self.sig = 0
        self.old: dict = {}

    def on_start(self, sim) -> None:
        def handler(signum, _frame):
            self.sig = signum

        try:
            self.old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread: no signal handling
            self.old = {}

    def stop_requested(self, sim) -> int:
        sig = int(self.sig)
        if sim.comm.world > 1:  # one read of a device tensor: only where there is something to agree on
            t = torch.tensor([sig], device=sim.device)
            sim.comm.max_(t)
            sig = int(t)
        return sig

    def close(self) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)
        self.old = {}


# -- what the files hold ---------------------------------------------------------------------------------------
_CSV = ("round", "test_accuracy", "best_test_accuracy", "test_loss", "train_loss", "forgetting", "seconds")


def versions() -> dict:
    """fedfast's, torch's and Python's versions, and the checkout's commit where there is one."""
    v = {"fedfast": __version__, "torch": torch.__version__, "python": platform.python_version()}
    c = source_commit()
    if c:
        v["commit"] = c
    return v


def source_commit() -> str | None:
    """The git commit of the checkout fedfast runs from (an editable install), read from ``.git`` without
    running git; None when installed from a wheel or the checkout is unreadable."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = os.path.join(root, ".git")
    try:
        if os.path.isfile(git):  # a worktree: "gitdir: PATH"
            with open(git) as f:
                git = os.path.join(root, f.read().split(":", 1)[1].strip())
        with open(os.path.join(git, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref: "):
            return head[:40] or None
        ref = head[5:]
        common = git
        if os.path.isfile(os.path.join(git, "commondir")):
            with open(os.path.join(git, "commondir")) as f:
                common = os.path.join(git, f.read().strip())
        for base in (git, common):
            p = os.path.join(base, ref)
            if os.path.isfile(p):
                with open(p) as f:
                    return f.read().strip()[:40] or None
        with open(os.path.join(common, "packed-refs")) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref:
                    return parts[0]
    except (OSError, IndexError):
        return None
    return None


def _evaluated(rounds: list[dict], tail: list[dict], name: str) -> tuple[dict | None, dict | None, float | None]:
    """Over the rounds that evaluated ``{name}_accuracy``: the final record (``tail``'s, a diverged round, where
    given), the best one and the mean accuracy of the last 10."""
    key = f"{name}_accuracy"
    ev = [h for h in rounds if h.get(key) is not None]
    end = (ev + tail)[-1] if ev or tail else None
    last = [h[key] for h in ev[-10:]]
    return end, max(ev, key=lambda h: h[key], default=None), (sum(last) / len(last) if last else None)


def summarize(
    history: list[dict], cfg_json: dict, device: str, complete: bool, diverged: Diverged | None = None
) -> dict:
    """The run's summary from its per-round metrics. A diverged run's best is over its finite rounds (before
    the diverged one); its final values are the diverged round's (``None`` where not finite)."""
    tail = [diverged.record] if diverged is not None and diverged.record is not None else []
    fin = history[:-1] if tail else history
    end, best, last10 = _evaluated(fin, tail, "test")
    if diverged is not None:
        state = {"status": "diverged", "diverged_round": diverged.round, "diverged": str(diverged)}
    else:
        state = {"status": "complete" if complete else "incomplete"}
    val = {}
    if any("val_accuracy" in h for h in history):  # a validation split (val_fraction): its metrics beside the test's
        vend, vbest, vlast10 = _evaluated(fin, tail, "val")
        val = {
            "final_val_accuracy": vend.get("val_accuracy") if vend else None,
            "final_val_loss": vend.get("val_loss") if vend else None,
            "best_val_accuracy": vbest["val_accuracy"] if vbest else None,
            "mean_last10_val_accuracy": vlast10,
        }
    return {
        **state,
        "complete": complete,
        "algorithm": cfg_json.get("algorithm"),
        "seed": cfg_json.get("seed"),
        "rounds": history[-1]["round"] if history else 0,
        "rounds_planned": cfg_json.get("rounds"),
        "final_test_accuracy": end["test_accuracy"] if end else None,
        "final_test_loss": end["test_loss"] if end else None,
        "best_test_accuracy": best["test_accuracy"] if best else None,
        "best_round": best["round"] if best else None,
        "mean_last10_test_accuracy": last10,
        "final_forgetting": end.get("forgetting") if end else None,
        **val,
        **{k: history[-1][k] for k in ("dp_epsilon", "dp_epsilon_poisson") if history and k in history[-1]},
        # a private run's round times are not recorded (unaccounted, docs/privacy.md): None then
        "wall_seconds": (
            sum(h.get("seconds") or 0.0 for h in history)
            if any(h.get("seconds") is not None for h in history) or not history
            else None
        ),
        "device": device,
        "versions": versions(),
    }


def csv_text(history: list[dict]) -> str:
    """metrics.csv: the records' scalar columns (and the validation split's where there is one)."""
    buf = io.StringIO()
    w = csv.writer(buf)
    cols = _CSV + (("val_accuracy", "val_loss") if any("val_accuracy" in h for h in history) else ())
    w.writerow(cols)
    for h in history:
        w.writerow(["" if h.get(k) is None else h[k] for k in cols])
    return buf.getvalue()


def model_bytes(sim) -> bytes:
    """The evaluated model's ``state_dict`` as ``torch.save`` writes it."""
    buf = io.BytesIO()
    torch.save(sim.state_dict(), buf)
    return buf.getvalue()


def jsonable(rec: dict) -> dict:
    """A round's record as metrics.jsonl keeps it (without the cohort's client ids)."""
    return {k: v for k, v in rec.items() if k != "clients"}
