"""One run in a run directory: ``fedfast run`` and each run of ``fedfast sweep``.

The directory holds:

* ``config.json``: the resolved configuration (run and engine keys, the method's resolved options, plug-ins);
* ``metrics.jsonl`` (one JSON object per round) and ``metrics.csv`` (its scalar columns);
* ``checkpoint.pt``: the whole state (global model, server, method and per-client state, random generators,
  round counter, metrics so far), written every ``checkpoint_every`` rounds, at the end, and when SIGINT or
  SIGTERM stops the run (after the round in progress); ``fedfast run --resume DIR`` continues from it and ends
  with the same metrics and model, bit for bit on CPU, as a run never stopped;
* ``model_final.pt`` / ``model_best.pt``: ``state_dict``s of the model (``model.load_state_dict(torch.load(
  "model_final.pt", weights_only=True))``), the evaluated global model after the last round and after the round
  of best test accuracy;
* ``summary.json``: final and best accuracy, mean of the last 10 evaluations, forgetting, wall time, device,
  versions, and ``complete``;
* ``tb/``: TensorBoard event files with ``tensorboard = true`` (the ``tensorboard`` package, an optional extra).

Every file is written atomically, and every JSON file is valid JSON (non-finite numbers as ``null``). The
directory's marker (``.fedfast-run.json``) lists what fedfast wrote and its lock (``.fedfast.lock``) keeps one
writer at a time (:mod:`fedfast.rundir`): an existing run is never overwritten without ``force``, and ``force``
removes only what the marker lists.

A run that diverges (a non-finite training loss, client update, global model or test loss) stops at that round
(:class:`fedfast.Diverged`): ``metrics.jsonl`` ends with the round (non-finite values as ``null``),
``summary.json`` says ``"status": "diverged"`` and ``"diverged_round"``, ``model_best.pt`` holds the best finite
model, and no checkpoint or ``model_final.pt`` of the diverged model is written.
"""
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
from .checkpoint import load as load_checkpoint
from .checkpoint import save as save_checkpoint
from .engine import Diverged
from ._io import WriteError, append_line
from .rundir import RunDir, dumps

# keys that may differ between a checkpoint and the run that resumes it (they do not change what is computed;
# threads: the sums' order, so a resume with other threads is not bit-exact, and says so)
RESUMABLE = ("rounds", "checkpoint_every", "tensorboard", "eval_every", "device", "plugins", "profile", "threads")
_CSV = ("round", "test_accuracy", "best_test_accuracy", "test_loss", "train_loss", "forgetting", "seconds")


class Interrupted(Exception):
    """SIGINT/SIGTERM stopped the run after a round; the checkpoint is written."""

    def __init__(self, signum: int, rnd: int, out_dir: str, message: str | None = None):
        super().__init__(message or f"stopped by {signal.Signals(signum).name} after round {rnd}; continue with "
                                    f"`fedfast run --resume {out_dir}`")
        self.signum = signum


class RunWriteError(OSError):
    """Writing one of the run's files failed (a full disk, a quota, a size limit): the path, the OS's reason and
    how to continue."""

    def __init__(self, err: OSError, out_dir: str, saved_round: int):
        super().__init__(err.errno, err.strerror)
        path = getattr(err, "path", None) or err.filename or out_dir
        how = (f"the run's files up to its checkpoint of round {saved_round} are intact: free space (or lift the "
               f"limit) and continue with `fedfast run --resume {out_dir}`" if saved_round else
               f"no round was checkpointed yet: free space (or lift the limit) and start it again with `--force`")
        self.message = f"{path}: could not be written ({err.strerror or err}); {how}"

    def __str__(self) -> str:
        return self.message


class RunDiverged(Exception):
    """The run diverged (:class:`fedfast.Diverged`); its directory holds the results up to that round."""

    def __init__(self, err: Diverged | None, out_dir: str, best_round=None, message: str | None = None):
        keep = (f"model_best.pt holds the best finite model (round {best_round})" if best_round else
                "no finite model was evaluated")
        super().__init__(message or f"{err}. The run stopped: {out_dir} records it (summary.json: status "
                                    f"\"diverged\"); {keep}")
        self.error = err


def determinism() -> dict:
    """The process settings a bit-exact rerun or resume depends on (recorded in config.json)."""
    return {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark)}


def _comparable(cfg_json: dict) -> dict:
    return {k: v for k, v in cfg_json.items() if k not in RESUMABLE}


def _versions() -> dict:
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


def summarize(history: list[dict], cfg_json: dict, device: str, complete: bool, diverged: Diverged | None = None
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
        val = {"final_val_accuracy": vend.get("val_accuracy") if vend else None,
               "final_val_loss": vend.get("val_loss") if vend else None,
               "best_val_accuracy": vbest["val_accuracy"] if vbest else None, "mean_last10_val_accuracy": vlast10}
    return {**state, "complete": complete, "algorithm": cfg_json.get("algorithm"), "seed": cfg_json.get("seed"),
            "rounds": history[-1]["round"] if history else 0, "rounds_planned": cfg_json.get("rounds"),
            "final_test_accuracy": end["test_accuracy"] if end else None,
            "final_test_loss": end["test_loss"] if end else None,
            "best_test_accuracy": best["test_accuracy"] if best else None,
            "best_round": best["round"] if best else None,
            "mean_last10_test_accuracy": last10,
            "final_forgetting": end.get("forgetting") if end else None,
            **val, "wall_seconds": sum(h.get("seconds") or 0.0 for h in history), "device": device,
            "versions": _versions()}


def _csv_text(history: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    cols = _CSV + (("val_accuracy", "val_loss") if any("val_accuracy" in h for h in history) else ())
    w.writerow(cols)
    for h in history:
        w.writerow(["" if h.get(k) is None else h[k] for k in cols])
    return buf.getvalue()


class Progress:
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

    def update(self, rec: dict) -> None:
        if self.quiet:
            return
        acc = rec["test_accuracy"]
        fields = {"acc": f"{100 * acc:.2f}%" if acc is not None else "-",
                  "best": f"{100 * rec['best_test_accuracy']:.2f}%" if rec["best_test_accuracy"] is not None else "-",
                  "loss": f"{rec['train_loss']:.4f}"}
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
            return
        done = rec["round"] - self.n0
        per = (time.perf_counter() - self.t0) / max(done, 1)
        eta = per * (self.total - rec["round"])
        print(f"{self.label + '  ' if self.label else ''}round {rec['round']:4d}/{self.total}  test_acc "
              f"{fields['acc']:>7}  best {fields['best']:>7}  train_loss {fields['loss']}  "
              + (f"test_loss {rec['test_loss']:.4f}  " if rec["test_loss"] is not None else "")
              + f"{rec['seconds']:.2f}s  eta {time.strftime('%H:%M:%S', time.gmtime(eta))}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _model_bytes(sim) -> bytes:
    buf = io.BytesIO()
    torch.save(sim.state_dict(), buf)
    return buf.getvalue()


def _check_resume(ck: dict, ck_path: str, cfg, cfg_json: dict) -> None:
    if ck.get("version") != __version__:
        raise ValueError(f"{ck_path}: written by fedfast {ck.get('version')}, this is fedfast {__version__}")
    mine, theirs = _comparable(cfg_json), ck.get("config", {})
    diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if "plugin_sha256" in diff:
        from .config import check_plugin_hashes
        check_plugin_hashes(theirs.get("plugin_sha256"), ck_path)
    if diff:
        raise ValueError(f"{ck_path}: the checkpoint's config differs in {', '.join(diff)} (checkpoint: "
                         + ", ".join(f"{k}={theirs.get(k)!r}" for k in diff[:4]) + "; now: "
                         + ", ".join(f"{k}={mine.get(k)!r}" for k in diff[:4]) + ")")
    done = int(ck.get("state", {}).get("round", 0))
    if cfg["rounds"] < done:
        raise ValueError(f"rounds: the run in {os.path.dirname(ck_path)} has done {done} rounds; rounds={cfg['rounds']} "
                         f"cannot take them back (--set rounds=N with N >= {done} extends it)")
    was = ck.get("threads")
    if was is not None and was != torch.get_num_threads():
        print(f"fedfast: warning: threads: {torch.get_num_threads()} now, {was} when the run was checkpointed: the "
              f"rest of the run sums in another order and is not bit-exact against a run never stopped (resume "
              f"without --set threads to keep {was})", file=sys.stderr, flush=True)


def execute(sim, cfg, rd: RunDir | None, *, resume: bool = False, quiet: bool = False, label: str = "",
            out_dir: str | None = None, cell: str | None = None) -> list[dict]:
    """Run ``cfg["rounds"]`` rounds of ``sim`` (a fresh Simulation) with the run directory's bookkeeping.
    ``rd``: the run directory, held by this process (None on the ranks that do not write: torchrun's ranks > 0
    and the worker processes of ``--workers`` but rank 0). ``cell``: the directory of a sweep's cell (the run's
    siblings: other seeds of the same method and grid point), whose runs must share this run's fingerprint."""
    lead = rd is not None
    out_dir = rd.path if lead else out_dir
    cfg_json = cfg.to_json()
    ck_path = os.path.join(out_dir, "checkpoint.pt")
    fp = _start(sim, cfg, rd, cfg_json, ck_path, resume, cell)
    rounds = cfg["rounds"]
    tb = _tensorboard(rd, sim.rnd) if lead and cfg["tensorboard"] else None
    evs = [h["test_accuracy"] for h in sim.history if h["test_accuracy"] is not None]
    best = max(evs) if evs else None
    best_round = max((h for h in sim.history if h["test_accuracy"] is not None),
                     key=lambda h: h["test_accuracy"], default={}).get("round")
    stop: dict = {}

    old = _catch_stop(stop) if lead or sim.comm.world > 1 else {}

    def summary(complete: bool, diverged=None):
        rd.write("metrics.csv", _csv_text(sim.history))
        rd.write("summary.json", dumps(summarize(sim.history, cfg_json, str(sim.device), complete, diverged),
                                       indent=2))

    saved = {"round": sim.rnd}  # the round the newest checkpoint holds (a resumed run's: the one it restored)

    def checkpoint(complete: bool):
        if not lead:
            return
        rd.add("checkpoint.pt")
        save_checkpoint(ck_path, {"version": __version__, "config": _comparable(cfg_json), "state": sim.checkpoint(),
                                  "threads": torch.get_num_threads(), "fingerprint": fp})
        saved["round"] = sim.rnd
        summary(complete)
        rd.saved = True

    progress = Progress(rounds, sim.rnd, quiet or not lead, label)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    try:
        f = open(metrics_path, "a") if lead else None
        try:
            while sim.rnd < rounds:
                try:
                    rec = sim.round()
                except Diverged as e:
                    if lead:
                        if e.record is not None:
                            append_line(f, metrics_path, dumps(_jsonable(e.record)) + "\n")
                        summary(False, e)
                        rd.saved = True
                    raise RunDiverged(e, out_dir, best_round) from None
                if lead:
                    best, best_round = _write_round(rd, f, metrics_path, tb, sim, rec, best, best_round)
                progress.update(rec)
                sig = _agreed_stop(sim, stop)
                if sig:
                    checkpoint(False)
                    raise Interrupted(sig, sim.rnd, out_dir)
                if cfg["checkpoint_every"] and sim.rnd % cfg["checkpoint_every"] == 0 and sim.rnd < rounds:
                    checkpoint(False)
        finally:
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
    except WriteError as e:
        raise RunWriteError(e, out_dir, saved["round"]) from None
    finally:
        progress.close()
        if tb is not None:
            tb.close()
            _list_tb(rd)
        for s, h in old.items():
            signal.signal(s, h)
    if lead:
        try:
            rd.write("model_final.pt", _model_bytes(sim))
            if best is None:
                rd.write("model_best.pt", _model_bytes(sim))
            checkpoint(True)
        except WriteError as e:
            raise RunWriteError(e, out_dir, saved["round"]) from None
    return sim.history


def _start(sim, cfg, rd: RunDir | None, cfg_json: dict, ck_path: str, resume: bool, cell: str | None) -> dict:
    """Restore a resumed run from its checkpoint (checked against its config and fingerprint), check a sweep's
    cell, and write the run's config with its fingerprint and the rounds so far (lead process only); returns the
    fingerprint."""
    from . import fingerprint
    ck = load_checkpoint(ck_path) if resume else None
    recorded = (ck or {}).get("fingerprint")
    fp = fingerprint.current(cfg.plugins, getattr(cfg, "data_files", None) or (), sim.comm.world, recorded,
                             getattr(cfg, "code_files", None) or ())
    if resume:
        _check_resume(ck, ck_path, cfg, cfg_json)
        if recorded is not None:
            _check_fingerprint(recorded, fp, ck_path)
        sim.restore(ck["state"])
    if cell is not None:
        _check_cell(cell, fp, os.path.dirname(ck_path))
    if rd is not None:
        rd.write("config.json", dumps({**cfg_json, "determinism": determinism(), "fingerprint": fp,
                                       "world_size": sim.comm.world}, indent=2, sort_keys=True))
        rd.write("metrics.jsonl", "".join(dumps(_jsonable(h)) + "\n" for h in sim.history))
        if sim.history:
            rd.saved = True
    return fp


def _check_fingerprint(recorded: dict, now: dict, ck_path: str) -> None:
    """A resume continues on the code and data the run started with: a change is refused, naming it; another number
    of processes is allowed, with a warning (the sums run in another order: not bit-exact)."""
    from .fingerprint import changes
    what = changes(recorded, now)
    if what:
        raise ValueError(f"{ck_path}: what the run's results depend on changed since it started: {'; '.join(what)}. "
                         f"Continuing would mix two versions of the run: restore them, or start a new run with --out")
    was = recorded.get("world_size")
    if was is not None and was != now.get("world_size"):
        print(f"fedfast: warning: {now.get('world_size')} process(es) now, {was} when the run started: the rest of the "
              f"run sums in another order and is not bit-exact against a run never stopped", file=sys.stderr,
              flush=True)


def _check_cell(cell: str, fp: dict, own: str) -> None:
    """A sweep adds a run to a cell (a method at a grid point) only if the cell's other runs share its fingerprint:
    seeds of other code or data are never averaged into one mean."""
    import glob

    from ._io import read_json
    from .fingerprint import changes
    for cj in sorted(glob.glob(os.path.join(cell, "*", "config.json"))):
        if os.path.abspath(os.path.dirname(cj)) == os.path.abspath(own):
            continue
        try:
            other = read_json(cj, "config").get("fingerprint")
        except (OSError, ValueError, AttributeError):
            continue
        what = "; ".join(changes(other, fp)) if other is not None else ""
        if what:
            raise ValueError(f"sweep: {os.path.dirname(cj)} was run on other code or data than this run would be "
                             f"({what}); "
                             f"its seeds and this one's would be averaged into one mean. Sweep into a new study "
                             f"directory (--out), or restore the code and data that run used")


def _catch_stop(stop: dict) -> dict:
    """SIGINT/SIGTERM noted in ``stop`` (the run stops after its round, checkpointed); the old handlers."""
    def handler(signum, _frame):
        stop["sig"] = signum
    try:
        return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: no signal handling
        return {}


def _write_round(rd: RunDir, f, path: str, tb, sim, rec: dict, best, best_round):
    """A round's record into metrics.jsonl (flushed), a new best model into model_best.pt, TensorBoard; returns
    the best accuracy and its round."""
    append_line(f, path, dumps(_jsonable(rec)) + "\n")
    rd.saved = True
    if rec["test_accuracy"] is not None and (best is None or rec["test_accuracy"] > best):
        best, best_round = rec["test_accuracy"], rec["round"]
        rd.write("model_best.pt", _model_bytes(sim))
    if tb is not None:
        _tb_log(tb, rec)
    return best, best_round


def _tb_log(tb, rec: dict) -> None:
    """One round's record into TensorBoard: the metrics, the round's seconds, the method's own values."""
    for k in ("test_accuracy", "test_loss", "train_loss", "best_test_accuracy", "forgetting", "val_accuracy",
              "val_loss"):
        if rec.get(k) is not None:
            tb.add_scalar(k, rec[k], rec["round"])
    tb.add_scalar("seconds", rec["seconds"], rec["round"])
    for k, v in (rec.get("method_metrics") or {}).items():
        tb.add_scalar(f"method/{k}", v, rec["round"])


def _agreed_stop(sim, stop: dict) -> int:
    """The signal that stops the run after this round (under torch.distributed: any rank's, on every rank)."""
    sig = int(stop.get("sig", 0))
    if sim.comm.world > 1:  # one read of a device tensor: only where there is something to agree on
        t = torch.tensor([sig], device=sim.device)
        sim.comm.max_(t)
        sig = int(t)
    return sig


def _jsonable(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k != "clients"}


def _tensorboard(rd: RunDir, purge_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("tensorboard: needs the `tensorboard` package (pip install tensorboard, or the "
                         "fedfast[tensorboard] extra)") from None
    d = os.path.join(rd.path, "tb")
    if not os.path.isdir(d):
        rd.add(dirs=("tb",))
    rd.tb_before = set(os.listdir(d)) if os.path.isdir(d) else set()
    w = SummaryWriter(d, purge_step=purge_step + 1)
    _list_tb(rd)  # the event file exists from here on: listed before the first round's scalars
    return w


def _list_tb(rd: RunDir) -> None:
    """The event files this run's SummaryWriter wrote go into the marker (files someone else put in tb/ do not)."""
    d = os.path.join(rd.path, "tb")
    if os.path.isdir(d):
        new = set(os.listdir(d)) - getattr(rd, "tb_before", set())
        rd.add(*sorted(f"tb/{n}" for n in new if os.path.isfile(os.path.join(d, n))))
