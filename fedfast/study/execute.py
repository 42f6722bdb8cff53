"""Running a study's planned runs: one after another or several at once (processes, threads per job), signals
passed on, the study's lock, and the lines that say how each run ended."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import time

import torch

from .. import methods
from .._deprecation import show_once
from .._io import read_json
from ..jobs import EXIT_DIVERGED, EXIT_ERROR, EXIT_WORKER_DIED, WorkerDied, exit_now, report_failure, run, run_workers
from ..rundir import RunLocked, status
from ..runner import Interrupted, RunDiverged
from .plan import _Run
from .report import load_run


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _assign_threads(plan: list[_Run], jobs: int, workers: int) -> None:
    """Each run's intra-op threads: the user's; an interrupted run's recorded number (so it resumes bit-exact);
    else the cores divided between the runs at once (and their worker processes)."""
    # the cores this process may use (a scheduler's allocation, not the machine's), divided between the runs
    default = (
        max(1, _cores() // (jobs * workers))
        if jobs > 1
        else (0 if workers > 1 else min(torch.get_num_threads(), _cores()))
    )
    for r in plan:
        if r.threads_given:
            continue
        n = default
        if status(r.dir) == "incomplete" and os.path.isfile(os.path.join(r.dir, "config.json")):
            try:
                n = int(read_json(os.path.join(r.dir, "config.json"), "config").get("threads") or n)
            except (ValueError, TypeError, AttributeError):
                pass
        r.cfg = r.cfg.replace(threads=n)


def _run_serial(plan: list[_Run], workers: int, quiet: bool) -> list[str]:
    dirs, held, diverged = [], [], []
    for r in plan:
        try:
            if workers > 1:
                done = run_workers(
                    r.cfg, r.dir, workers, mode="auto", quiet=quiet, label=r.label, cell=os.path.dirname(r.dir)
                )
            else:
                done = run(r.cfg, r.dir, mode="auto", quiet=quiet, label=r.label, cell=os.path.dirname(r.dir))
            if done is None and not quiet:
                print(f"{r.label}: {status(r.dir)}, skipped", flush=True)
        except RunLocked as e:
            held.append(r.dir)
            if not quiet:
                print(f"{r.label}: skipped, {e}", flush=True)
        except RunDiverged as e:
            diverged.append(r.dir)
            print(f"{r.label}: {e}", file=sys.stderr, flush=True)
        except Interrupted as e:
            raise Interrupted(
                e.signum,
                -1,
                r.dir,
                message=f"{e}, or run the same `fedfast sweep` command (it resumes the run and goes on with the study)",
            ) from None
        dirs.append(r.dir)
    _tail(held, diverged, quiet)
    return dirs


def _tail(held: list, diverged: list, quiet: bool) -> None:
    if held and not quiet:
        print(
            f"{len(held)} run(s) were running in other processes; `fedfast sweep` again (or `fedfast report`) "
            f"once they end",
            flush=True,
        )
    if diverged and not quiet:
        print(f"{len(diverged)} run(s) diverged; the report marks them and leaves them out of the means", flush=True)


# exit codes of a --jobs process (besides the CLI's: 2 error, 3 worker died, 4 diverged, 128 + N signal N)
_RAN, _SKIPPED, _HELD = 0, 10, 11


def _job_main(r: _Run, workers: int) -> None:
    """One run of ``sweep --jobs`` in its own process; the exit code says how it ended."""
    # started with SIGINT/SIGTERM blocked (no KeyboardInterrupt while starting up): ignored until the run installs
    # its handler (it then stops after a round); the sweep passes the signal on again every second till then
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _pass_on if workers > 1 else signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    show_once()  # a spawned process starts with Python's default filters, which hide a plug-in's notices
    for p in r.cfg.plugins:
        methods.load_plugin(p)
    try:
        if workers > 1:
            done = run_workers(
                r.cfg, r.dir, workers, mode="auto", quiet=True, label=r.label, cell=os.path.dirname(r.dir)
            )
        else:
            done = run(r.cfg, r.dir, mode="auto", quiet=True, label=r.label, cell=os.path.dirname(r.dir))
        code = _RAN if done is not None else _SKIPPED
    except RunLocked as e:
        print(f"{r.label}: skipped, {e}", flush=True)
        code = _HELD
    except Interrupted as e:
        code = 128 + e.signum
    except RunDiverged as e:
        print(f"{r.label}: {e}", file=sys.stderr, flush=True)
        code = EXIT_DIVERGED
    except WorkerDied as e:
        print(f"fedfast: {r.label}: {e}", file=sys.stderr, flush=True)
        code = EXIT_WORKER_DIED
    except Exception as e:  # noqa: BLE001 - a user's error, or one inside a plug-in's code; a bug re-raises
        code = report_failure(r.label, e, (ValueError, OSError, TypeError, MemoryError))
    exit_now(code)


def _pass_on(signum, _frame):
    """A ``--jobs`` process with ``--workers``: the signal goes on to its worker processes."""
    for p in mp.active_children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signum)


def _run_jobs(plan: list[_Run], jobs: int, workers: int, quiet: bool, out: str) -> list[str]:
    """``jobs`` runs at once, each in a process of its own. SIGINT/SIGTERM: no new run starts, the running ones
    checkpoint after their round and stop, and the sweep raises :class:`fedfast.runner.Interrupted` (the same
    command continues it). A run that fails stops new starts too; the others finish."""
    ctx = mp.get_context("spawn")
    pending, running, dirs, held, diverged, failed = list(plan), {}, [], [], [], []
    stop: dict = {}

    def forward():  # a scheduler's SIGTERM may reach this process only; a run still starting ignores it: again
        for p in list(running):
            if p.exitcode is None and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, stop["sig"])
        stop["sent"] = time.monotonic()

    def handler(signum, _frame):
        stop.setdefault("sig", signum)
        forward()

    old = {}
    with contextlib.suppress(ValueError):  # not the main thread: no signal handling
        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while pending or running:
            while pending and len(running) < jobs and not stop and not failed:
                r = pending.pop(0)
                p = ctx.Process(target=_job_main, args=(r, workers), daemon=False)
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
                try:
                    p.start()  # the child starts with the signals blocked; this process gets them on unblocking
                    running[p] = r
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                if not quiet:
                    print(
                        f"{r.label}: started ({r.cfg['threads']} thread{'s' if r.cfg['threads'] != 1 else ''}) -> "
                        f"{r.dir}",
                        flush=True,
                    )
            for p in [p for p in running if p.exitcode is not None]:
                r = running.pop(p)
                p.join()
                dirs.append(r.dir)
                _ended(r, p.exitcode, stop, quiet, held, diverged, failed)
            if pending and stop:
                pending.clear()
            if stop and running and time.monotonic() - stop.get("sent", 0) > 1.0:
                forward()
            time.sleep(0.1)
    finally:
        for p in running:  # only on an error of this process: the runs checkpointed at their last round
            if p.exitcode is None:
                p.kill()
                p.join(10)
        for s, h in old.items():
            signal.signal(s, h)
    _tail(held, diverged, quiet)
    if stop:
        raise Interrupted(
            stop["sig"],
            -1,
            out,
            message=f"stopped by {signal.Signals(stop['sig']).name}: the running "
            f"runs checkpointed; the same `fedfast sweep` command continues the study in {out}",
        )
    if failed:
        r, code = failed[0]
        why = {EXIT_ERROR: "an error (its message is above)", EXIT_WORKER_DIED: "a worker process that died"}.get(
            code, f"exit code {code}" if code is not None and code >= 0 else f"signal {-code if code else '?'}"
        )
        raise ValueError(
            f"{r.label} ({r.dir}) failed with {why}; no further runs were started. Fix it and run the "
            f"same command again (finished runs are kept)"
        )
    return dirs


def _ended(r: _Run, code, stop: dict, quiet: bool, held: list, diverged: list, failed: list) -> None:
    """A run's process ended with ``code``: say so, or file it as held elsewhere, diverged or failed."""
    if code == _RAN:
        if not quiet:
            print(_finished_line(r), flush=True)
    elif code == _SKIPPED:
        if not quiet:
            print(f"{r.label}: {status(r.dir)}, skipped", flush=True)
    elif code == _HELD:
        held.append(r.dir)
    elif code == EXIT_DIVERGED:
        diverged.append(r.dir)
    elif code is not None and code > 128 and stop:
        pass  # stopped by the signal the sweep got: checkpointed
    else:
        failed.append((r, code))


def _finished_line(r: _Run) -> str:
    try:
        s = load_run(r.dir)
    except (ValueError, OSError):
        return f"{r.label}: done -> {r.dir}"
    acc = s.get("final_test_accuracy")
    return (
        f"{r.label}: final test_acc "
        + (f"{100 * acc:.2f}%" if acc is not None else "-")
        + (f"  val {100 * s['final_val_accuracy']:.2f}%" if s.get("final_val_accuracy") is not None else "")
        + (f"  {s['wall_seconds']:.1f}s" if s.get("wall_seconds") is not None else "")
        + f"  -> {r.dir}"
    )


@contextlib.contextmanager
def _study_lock(out: str):
    import fcntl

    fd = os.open(os.path.join(out, ".fedfast-study.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
