"""One run in a run directory: ``fedfast run`` and each run of ``fedfast sweep``.

The directory holds (:mod:`fedfast.callbacks` writes them, :func:`execute` wires the callbacks):

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

import glob
import os
import signal
import sys

import torch

from . import __version__, fingerprint
from ._io import WriteError, read_json
from .callbacks import (
    Callback,
    Checkpointer,
    Progress,
    RunFiles,
    StopOnSignal,
    TensorBoard,
    best_round,
    jsonable,
    run_rounds,
)
from .checkpoint import load as load_checkpoint
from .config import check_plugin_hashes
from .fingerprint import changes
from .rundir import RunDir, dumps
from .sim.diverged import Diverged

# keys that may differ between a checkpoint and the run that resumes it (they do not change what is computed;
# threads: the sums' order, so a resume with other threads is not bit-exact, and says so)
RESUMABLE = ("rounds", "checkpoint_every", "tensorboard", "eval_every", "device", "plugins", "profile", "threads")


class Interrupted(Exception):
    """SIGINT/SIGTERM stopped the run after a round; the checkpoint is written."""

    def __init__(self, signum: int, rnd: int, out_dir: str, message: str | None = None):
        super().__init__(
            message
            or f"stopped by {signal.Signals(signum).name} after round {rnd}; continue with "
            f"`fedfast run --resume {out_dir}`"
        )
        self.signum = signum


class RunWriteError(OSError):
    """Writing one of the run's files failed (a full disk, a quota, a size limit): the path, the OS's reason and
    how to continue."""

    def __init__(self, err: OSError, out_dir: str, saved_round: int):
        super().__init__(err.errno, err.strerror)
        path = getattr(err, "path", None) or err.filename or out_dir
        how = (
            f"the run's files up to its checkpoint of round {saved_round} are intact: free space (or lift the "
            f"limit) and continue with `fedfast run --resume {out_dir}`"
            if saved_round
            else "no round was checkpointed yet: free space (or lift the limit) and start it again with `--force`"
        )
        self.message = f"{path}: could not be written ({err.strerror or err}); {how}"

    def __str__(self) -> str:
        return self.message


class RunDiverged(Exception):
    """The run diverged (:class:`fedfast.Diverged`); its directory holds the results up to that round."""

    def __init__(self, err: Diverged | None, out_dir: str, best_round=None, message: str | None = None):
        keep = (
            f"model_best.pt holds the best finite model (round {best_round})"
            if best_round
            else "no finite model was evaluated"
        )
        super().__init__(
            message or f'{err}. The run stopped: {out_dir} records it (summary.json: status "diverged"); {keep}'
        )
        self.error = err


def determinism() -> dict:
    """The process settings a bit-exact rerun or resume depends on (recorded in config.json)."""
    return {
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
    }


def _comparable(cfg_json: dict) -> dict:
    return {k: v for k, v in cfg_json.items() if k not in RESUMABLE}


def _check_resume(ck: dict, ck_path: str, cfg, cfg_json: dict) -> None:
    if ck.get("version") != __version__:
        raise ValueError(f"{ck_path}: written by fedfast {ck.get('version')}, this is fedfast {__version__}")
    mine, theirs = _comparable(cfg_json), ck.get("config", {})
    diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if "plugin_sha256" in diff:
        check_plugin_hashes(theirs.get("plugin_sha256"), ck_path)
    if diff:
        raise ValueError(
            f"{ck_path}: the checkpoint's config differs in {', '.join(diff)} (checkpoint: "
            + ", ".join(f"{k}={theirs.get(k)!r}" for k in diff[:4])
            + "; now: "
            + ", ".join(f"{k}={mine.get(k)!r}" for k in diff[:4])
            + ")"
        )
    done = int(ck.get("state", {}).get("round", 0))
    if cfg["rounds"] < done:
        raise ValueError(
            f"rounds: the run in {os.path.dirname(ck_path)} has done {done} rounds; "
            f"rounds={cfg['rounds']} "
            f"cannot take them back (--set rounds=N with N >= {done} extends it)"
        )
    was = ck.get("threads")
    if was is not None and was != torch.get_num_threads():
        print(
            f"fedfast: warning: threads: {torch.get_num_threads()} now, {was} when the run was checkpointed: the "
            f"rest of the run sums in another order and is not bit-exact against a run never stopped (resume "
            f"without --set threads to keep {was})",
            file=sys.stderr,
            flush=True,
        )


def execute(
    sim,
    cfg,
    rd: RunDir | None,
    *,
    resume: bool = False,
    quiet: bool = False,
    label: str = "",
    out_dir: str | None = None,
    cell: str | None = None,
) -> list[dict]:
    """Run ``cfg["rounds"]`` rounds of ``sim`` (a fresh Simulation) with the run directory's bookkeeping: the loop
    :func:`run_rounds` with the callbacks of :mod:`fedfast.callbacks`. ``rd``: the run directory, held by this
    process (None on the ranks that do not write: torchrun's ranks > 0 and the worker processes of ``--workers``
    but rank 0). ``cell``: the directory of a sweep's cell (the run's siblings: other seeds of the same method and
    grid point), whose runs must share this run's fingerprint."""
    lead = rd is not None
    out_dir = rd.path if lead else out_dir
    cfg_json = cfg.to_json()
    ck_path = os.path.join(out_dir, "checkpoint.pt")
    fp = _start(sim, cfg, rd, cfg_json, ck_path, resume, cell)
    callbacks: list[Callback] = []
    files = ckpt = None
    if lead:
        for store in sim.stores:  # the per-client state's files, if a store moves to disk (state_store)
            rd.add(*(os.path.basename(p) for p in store.file_paths()))
        files = RunFiles(rd, cfg_json, sim.history)
        callbacks.append(files)
        if cfg["tensorboard"]:
            callbacks.append(TensorBoard(rd))
    callbacks.append(Progress(cfg["rounds"], sim.rnd, quiet or not lead, label))
    if lead or sim.comm.world > 1:
        callbacks.append(StopOnSignal())
    if lead:  # modules first imported at round time join the fingerprint before the round's checkpoint
        callbacks.append(fingerprint.CodeWatch(rd, fp))
        ckpt = Checkpointer(
            rd,
            ck_path,
            {"version": __version__, "config": _comparable(cfg_json), "fingerprint": fp},
            cfg["checkpoint_every"],
            cfg["rounds"],
            files,
            saved_round=sim.rnd,
        )
        callbacks.append(ckpt)
    try:
        sig = run_rounds(sim, cfg["rounds"], callbacks)
    except Diverged as e:
        raise RunDiverged(e, out_dir, best_round(sim.history)) from None
    except WriteError as e:
        raise RunWriteError(e, out_dir, ckpt.saved_round if ckpt is not None else sim.rnd) from None
    if sig:
        raise Interrupted(sig, sim.rnd, out_dir)
    return sim.history


def _start(sim, cfg, rd: RunDir | None, cfg_json: dict, ck_path: str, resume: bool, cell: str | None) -> dict:
    """Restore a resumed run from its checkpoint (checked against its config and fingerprint), check a sweep's
    cell, and write the run's config with its fingerprint and the rounds so far (lead process only); returns the
    fingerprint."""
    ck = load_checkpoint(ck_path) if resume else None
    recorded = (ck or {}).get("fingerprint")
    fp = fingerprint.current(cfg.plugins, cfg.data_files, sim.comm.world, recorded, cfg.code_files)
    if resume:
        _check_resume(ck, ck_path, cfg, cfg_json)
        if recorded is not None:
            _check_fingerprint(recorded, fp, ck_path)
        sim.restore(ck["state"])
    if cell is not None:
        _check_cell(cell, fp, os.path.dirname(ck_path))
    if rd is not None:
        rd.write(
            "config.json",
            dumps(
                {**cfg_json, "determinism": determinism(), "fingerprint": fp, "world_size": sim.comm.world},
                indent=2,
                sort_keys=True,
            ),
        )
        rd.write("metrics.jsonl", "".join(dumps(jsonable(h)) + "\n" for h in sim.history))
        if sim.history:
            rd.saved = True
    return fp


def _check_fingerprint(recorded: dict, now: dict, ck_path: str) -> None:
    """A resume continues on the code and data the run started with: a change is refused, naming it; another number
    of processes is allowed, with a warning (the sums run in another order: not bit-exact)."""
    what = changes(recorded, now)
    if what:
        raise ValueError(
            f"{ck_path}: what the run's results depend on changed since it started: {'; '.join(what)}. "
            f"Continuing would mix two versions of the run: restore them, or start a new run with --out"
        )
    was = recorded.get("world_size")
    if was is not None and was != now.get("world_size"):
        print(
            f"fedfast: warning: {now.get('world_size')} process(es) now, {was} when the run started: the rest of the "
            f"run sums in another order and is not bit-exact against a run never stopped",
            file=sys.stderr,
            flush=True,
        )


def _check_cell(cell: str, fp: dict, own: str) -> None:
    """A sweep adds a run to a cell (a method at a grid point) only if the cell's other runs share its fingerprint:
    seeds of other code or data are never averaged into one mean."""
    for cj in sorted(glob.glob(os.path.join(cell, "*", "config.json"))):
        if os.path.abspath(os.path.dirname(cj)) == os.path.abspath(own):
            continue
        try:
            other = read_json(cj, "config").get("fingerprint")
        except (OSError, ValueError, AttributeError):
            continue
        what = "; ".join(changes(other, fp)) if other is not None else ""
        if what:
            raise ValueError(
                f"sweep: {os.path.dirname(cj)} was run on other code or data than this run would be "
                f"({what}); "
                f"its seeds and this one's would be averaged into one mean. Sweep into a new study "
                f"directory (--out), or restore the code and data that run used"
            )
