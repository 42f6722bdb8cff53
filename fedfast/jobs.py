"""Running runs: one run into its directory (:func:`run`, under ``torchrun`` too), several local worker processes
over ``torch.distributed`` (:func:`run_workers`), and the exit codes the command line and sweeps share. Below the
command line and the studies (``fedfast run`` and ``fedfast sweep`` both call these); :mod:`fedfast.assemble` builds
each run's Simulation.
"""

from __future__ import annotations

import datetime
import os
import signal as _signal
import socket
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import methods
from ._deprecation import FedfastDeprecationWarning, show_once
from .assemble import build_run
from .callbacks import summarize
from .methods import plugin_frame
from .methods.hooks import HookError
from .rundir import RunDir, RunLocked, attach
from .runner import Interrupted, RunDiverged, execute


def _init_distributed(cfg):
    """Under ``torchrun`` (WORLD_SIZE > 1): one process per GPU (nccl) or CPU process (gloo)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None, cfg["device"]
    dev = cfg["device"]
    if dev.startswith("cuda"):
        dev = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=float(os.environ.get("FEDFAST_DIST_TIMEOUT", "300")))
        dist.init_process_group("nccl" if dev.startswith("cuda") else "gloo", timeout=timeout)
    return "default", dev


class WorkerDied(RuntimeError):
    """A worker process of ``fedfast run --workers N`` ended abnormally; the others were stopped."""


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def _worker_main(rank: int, world: int, port: int, cfg, out_dir: str, kw: dict):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank)
    )
    # a spawned process starts with Python's default filters: the command line's notices, once, from rank 0 (every
    # rank runs the same hooks)
    if rank == 0:
        show_once()
    else:
        warnings.filterwarnings("ignore", category=FedfastDeprecationWarning)
    for p in cfg.plugins:
        methods.load_plugin(p)
    try:
        run(
            cfg,
            out_dir,
            quiet=kw["quiet"] or rank > 0,
            mode=kw["action"],
            label=kw["label"],
            attached=True,
            cell=kw.get("cell"),
        )
        dist.destroy_process_group()
        code = 0
    except Interrupted as e:
        if rank == 0:
            print(f"fedfast: {e}", file=sys.stderr, flush=True)
        code = 128 + e.signum
    except RunDiverged as e:
        if rank == 0:
            print(f"fedfast: {e}", file=sys.stderr, flush=True)
        code = EXIT_DIVERGED
    except Exception as e:  # noqa: BLE001 - a user's error, or one inside a plug-in's code; a bug re-raises
        code = report_failure(f"worker {rank}", e)
    exit_now(code)


EXIT_ERROR, EXIT_WORKER_DIED, EXIT_DIVERGED = 2, 3, 4


def run_workers(
    cfg, out_dir: str, workers: int, *, mode: str = "new", quiet: bool = False, label: str = "", cell: str | None = None
):
    """``workers`` local processes over ``torch.distributed`` (gloo on loopback), each with ``cores / workers``
    intra-op threads (or ``threads``), each training its share of every round's clients (the same global model as
    one process). This process holds the run directory's lock; rank 0 writes. A worker that dies stops the others
    within a second and raises :class:`WorkerDied` naming it; the run can then continue from its last checkpoint
    with ``--resume``. ``mode``: as :meth:`fedfast.rundir.RunDir.open`; returns None for a skipped run."""
    if cfg["threads"] == 0:
        cfg = cfg.replace(threads=max(1, (os.cpu_count() or workers) // workers))
    rd = RunDir(out_dir)
    action = rd.open(mode)
    if action == "skip":
        rd.close()
        return None
    ctx = mp.get_context("spawn")
    port = _free_port()
    kw = dict(quiet=quiet, action=action, label=label, cell=cell)
    procs = [
        ctx.Process(target=_worker_main, args=(r, workers, port, cfg, out_dir, kw), daemon=False)
        for r in range(workers)
    ]
    try:
        for p in procs:
            p.start()
        while True:  # until every worker ended well, or one did not (checked after the last one ended, too)
            bad = [(r, p) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if not bad and all(p.exitcode == 0 for p in procs):
                break
            if bad:
                r, p = bad[0]
                time.sleep(0.5)  # let the others reach the same signal (Ctrl-C goes to the whole group)
                if p.exitcode == EXIT_DIVERGED:  # every rank sees the same non-finite model: they all stop
                    for q in procs:
                        q.join(30)
                codes = [q.exitcode for q in procs]
                for q in procs:
                    if q.exitcode is None:
                        q.terminate()
                for q in procs:
                    q.join(10)
                    if q.exitcode is None:
                        q.kill()
                if p.exitcode in (128 + _signal.SIGINT, 128 + _signal.SIGTERM) and all(
                    c in (None, 0, p.exitcode) for c in codes
                ):
                    raise Interrupted(p.exitcode - 128, -1, out_dir)
                if p.exitcode == EXIT_DIVERGED:
                    raise RunDiverged(
                        None,
                        out_dir,
                        message=f"the run in {out_dir} diverged (worker 0's message above); summary.json records it",
                    )
                if p.exitcode == EXIT_ERROR:
                    raise ValueError(f"worker {r} stopped with an error (above)")
                how = f"signal {_signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else f"exit code {p.exitcode}"
                raise WorkerDied(
                    f"worker {r} (pid {p.pid}) died with {how}; the other workers were stopped. "
                    f"Continue from the last checkpoint with `fedfast run --resume {out_dir} --workers "
                    f"{workers}`"
                )
            time.sleep(0.1)
    except BaseException:
        rd.refresh()
        rd.close(failed=True)
        raise
    finally:
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                p.kill()
    rd.refresh()
    rd.close()
    return True


def _set_threads(cfg):
    """Intra-op threads: the config's ``threads`` or torch's default. Returns the config with the number used
    (config.json records it, so a resume uses it again and stays bit-exact)."""
    n = cfg["threads"] or torch.get_num_threads()
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    return cfg.replace(threads=n)


def run(
    cfg,
    out_dir: str,
    *,
    mode: str = "new",
    quiet: bool = False,
    label: str = "",
    attached: bool = False,
    cell: str | None = None,
):
    """One run into ``out_dir`` (see :mod:`fedfast.runner`); under torchrun rank 0 holds the directory, writes and
    prints. ``mode``: ``new``, ``force``, ``resume`` or ``auto`` (:meth:`fedfast.rundir.RunDir.open`);
    ``attached``: a worker of :func:`run_workers`, whose launcher holds the directory; ``cell``: a sweep's cell
    directory, whose other runs must share this run's fingerprint. Returns the history, or None for a run ``auto``
    skipped (finished already)."""
    threads = torch.get_num_threads()
    try:
        return _run(cfg, out_dir, mode, quiet, label, attached, cell)
    finally:  # the run's thread count was the run's: the caller's process gets its own back
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _run(cfg, out_dir: str, mode: str, quiet: bool, label: str, attached: bool, cell: str | None):
    group, device = _init_distributed(cfg)
    lead = group is None or torch.distributed.get_rank() == 0
    cfg = _set_threads(cfg)
    rd, action, err = None, ("resume" if mode == "resume" else "new"), None
    if lead:
        try:
            rd = attach(out_dir) if attached else RunDir(out_dir)
            if not attached:
                action = rd.open(mode)
        except Exception as e:  # noqa: BLE001 - raised below, after the other ranks have heard of it
            err = e
    if group is not None:  # rank 0's verdict on the directory, to every rank
        code = torch.tensor(
            [0 if err is None else 2 if isinstance(err, RunLocked) else 1, ("new", "resume", "skip").index(action)]
        )
        torch.distributed.broadcast(code, 0)
        if int(code[0]) == 2 and err is None:  # held by another process: every rank skips it (a sweep goes on)
            raise RunLocked(out_dir, {})
        if int(code[0]) and err is None:
            raise ValueError(f"{out_dir}: rank 0 could not open the run directory (its message is above)")
        action = ("new", "resume", "skip")[int(code[1])]
    if err is not None:
        raise err
    if action == "skip":
        if rd is not None:
            rd.close()
        return None
    own = rd is not None and not attached
    try:
        cfg, sim = build_run(cfg, device, group, state_dir=out_dir)
        hist = execute(sim, cfg, rd, resume=action == "resume", quiet=quiet, label=label, out_dir=out_dir, cell=cell)
    except BaseException:
        if own:
            rd.close(failed=True)
        raise
    if own:
        rd.close()
    if lead and hist and not quiet:
        s = summarize(hist, cfg.to_json(), str(sim.device), True)
        acc = s["final_test_accuracy"]
        print(
            f"{label + '  ' if label else ''}final test_acc "
            + (
                f"{100 * acc:.2f}%  best {100 * s['best_test_accuracy']:.2f}% (round {s['best_round']})"
                if acc is not None
                else "-"
            )
            + (f"  forgetting {s['final_forgetting']:.4f}" if s["final_forgetting"] is not None else "")
            + (f"  {s['wall_seconds']:.1f}s" if s["wall_seconds"] is not None else "")
            + f"  -> {out_dir}",
            flush=True,
        )
    return hist


def plugin_where(e: BaseException) -> str:
    """``"in plug-in FILE, line N, in FUNC: "`` when the exception was raised inside a loaded plug-in's code."""
    hit = plugin_frame(e.__traceback__)
    return f"in plug-in {hit[0]}, line {hit[1]}, in {hit[2]}: " if hit else ""


def report_failure(who: str, e: BaseException, expected=(ValueError, OSError, MemoryError)) -> int:
    """A process's end by an error: print it (naming the plug-in file and line it came from) and return
    EXIT_ERROR; an unexpected exception outside any plug-in's code is a bug and is raised again. A hook's wrong
    return (:class:`fedfast.methods.hooks.HookError`, which names the hook's file and line) is always expected."""
    if isinstance(e, (*expected, HookError)):
        print(f"fedfast: {who}: {plugin_where(e)}{e}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    if not plugin_where(e):
        raise e
    print(f"fedfast: {who}: {plugin_where(e)}{type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return EXIT_ERROR


def exit_now(code: int) -> None:
    """Flush and leave the process: everything is written, and no interpreter teardown (where gloo's threads
    abort the process)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
