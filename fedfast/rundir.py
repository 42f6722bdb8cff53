"""Run directories that know what fedfast wrote, with one writer at a time.

* **Marker.** ``DIR/.fedfast-run.json`` makes a directory a run: it lists every file fedfast wrote there
  (``files``, paths relative to ``DIR``) and the folders it made (``dirs``: ``tb``). It is written (atomically)
  before anything else, and each new file is listed before it is first written. ``--force`` removes only what
  the marker lists (and the temporary ``.NAME.tmp-PID`` files a killed write of a listed file left), then folders
  it lists that are empty; a file the user put in a run directory, even ``tb/exp1/events...``, survives. A
  directory without a marker is never cleared: if it holds files with the names a run writes (``config.json``,
  ``tb``, ...) the run is refused, with or without ``--force``, saying they are not a fedfast run's files.
* **Lock.** ``DIR/.fedfast.lock`` is held with ``flock`` for the whole run, so a second ``run``, ``--resume``,
  ``--force`` or sweep worker on the same directory is refused at once with the holder's PID, host and start
  time. The OS releases the lock when its process ends, however it ends (a SIGKILLed run leaves no stale lock).
  On Linux ``flock`` on NFS (v4, and v3 with lockd) is carried out as a POSIX lock held by the server, so
  processes on several machines sharing the filesystem exclude each other too.
* **Clean-up.** A run that fails before its first round is saved (bad data, a model that does not fit, a
  refused option, a plug-in's hook failing in round 1) takes back everything it wrote and the directories it made;
  the marker, the lock file and the folder do not outlive it. A run that saved rounds keeps them (``--resume``
  continues it).
* **Replacing.** ``--force`` does not delete the old run at once: its files move into ``DIR/.fedfast-replaced/``
  (a rename in the same filesystem), listed under the marker's ``replaced``, and are deleted when the new run's
  first round is on disk. A new run that fails before then puts them back, and so does the next :meth:`RunDir.open`
  after a new run killed before then (SIGKILL, a power cut): the old run is never lost to a run that saved nothing.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import glob
import json
import math
import os
import shutil
import socket
import time

from . import __version__
from ._io import read_json, write_atomic
from .checkpoint import MAGIC

MARKER = ".fedfast-run.json"
LOCK = ".fedfast.lock"
REPLACED = ".fedfast-replaced"  # a replaced run's files until the new run's first round is saved
# names a run writes (a directory without a marker that holds one of them is not cleared, and not written into)
OUTPUTS = (
    "config.json",
    "metrics.jsonl",
    "metrics.csv",
    "summary.json",
    "checkpoint.pt",
    "model_final.pt",
    "model_best.pt",
    "tb",
    MARKER,
)


class RunLocked(OSError):
    """Another process holds the run directory's lock."""

    def __init__(self, path: str, holder: dict):
        who = (
            (
                f"pid {holder.get('pid')} on host {holder.get('host')}"
                + (f" (since {holder['since']})" if holder.get("since") else "")
            )
            if holder.get("pid")
            else "another process (it is starting)"
        )
        super().__init__(
            errno.EBUSY,
            f"{path}: in use by {who}: a run directory has one writer at a time; wait "
            f"for it to end or choose another --out",
        )
        self.holder = holder
        self.path = path

    def __str__(self) -> str:
        return self.strerror


def dumps(obj, **kw) -> str:
    """JSON with every non-finite float as ``null`` (``json.dumps`` would write bare ``NaN``/``Infinity``, which
    is not JSON: other readers refuse it)."""
    return json.dumps(finite(obj), allow_nan=False, **kw)


def finite(obj):
    """``obj`` with non-finite floats (NaN, inf) replaced by ``None``, recursively through dicts, lists, tuples."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def read_jsonl(path: str) -> list[dict]:
    """A ``metrics.jsonl``; ValueError naming the file and the line of a damaged record."""
    out = []
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (a run directory has one)") from None
    with f:
        for i, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {i} is damaged (column {e.colno}: {e.msg})") from None
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: line {i} is not UTF-8 text ({e.reason})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("round"), int):
                raise ValueError(f"{path}: line {i} is not a round's record (a JSON object with an integer 'round')")
            out.append(rec)
    return out


def _holder(lock_path: str) -> dict:
    for _ in range(10):  # the holder writes its name right after taking the lock
        try:
            with open(lock_path) as f:
                text = f.read()
            if text.strip():
                return json.loads(text)
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    return {}


class RunDir:
    """A run directory: :meth:`open` makes or checks it, takes its lock and writes the marker; :meth:`write` and
    :meth:`add` list each file before it is written; :meth:`close` releases the lock (and on a failure before the
    first saved round takes back what this run wrote)."""

    def __init__(self, path: str):
        self.path = str(path)
        self._fd: int | None = None
        self._made: list[str] = []  # directories this process created (deepest last)
        self._new: set[str] = set()  # files this process listed
        self.files: list[str] = []
        self.dirs: list[str] = []
        self._replaced: dict | None = None  # the old run's {"files", "dirs"} kept in REPLACED (--force)
        self.saved = False  # a round's results are on disk (a checkpoint or a finished run)
        self._wrote = False  # this process wrote the marker
        self._lock_created = False  # this process created the lock file

    @property
    def saved(self) -> bool:
        """A round's results are on disk (a checkpoint or a finished run); set True, it drops a replaced run."""
        return self._saved

    @saved.setter
    def saved(self, value: bool) -> None:
        self._saved = bool(value)
        if value and self._replaced is not None and self._fd is not None:
            self._replaced = None
            self._write_marker()  # first: a marker without `replaced` never points to a half-deleted folder
            shutil.rmtree(self._p(REPLACED), ignore_errors=True)

    # -- the marker --------------------------------------------------------------------------------------------
    def _p(self, name: str) -> str:
        return os.path.join(self.path, name)

    def read_marker(self) -> dict | None:
        p = self._p(MARKER)
        if not os.path.exists(p):
            return None
        m = read_json(p, "fedfast run marker")
        if not (
            isinstance(m, dict)
            and isinstance(m.get("files"), list)
            and all(isinstance(x, str) for x in m["files"] + m.get("dirs", []))
        ):
            raise ValueError(f"{p}: damaged fedfast run marker (expected an object with a list of files)")
        rep = m.get("replaced")
        if rep is not None and not (
            isinstance(rep, dict)
            and isinstance(rep.get("files"), list)
            and all(isinstance(x, str) for x in rep["files"] + rep.get("dirs", []))
        ):
            raise ValueError(f"{p}: damaged fedfast run marker ('replaced' must list the replaced run's files)")
        named = m["files"] + m.get("dirs", []) + (rep["files"] + rep.get("dirs", []) if rep else [])
        for x in named:  # a marker names files inside the run directory only
            if os.path.isabs(x) or ".." in x.replace("\\", "/").split("/"):
                raise ValueError(f"{p}: lists {x!r}, a path outside the run directory; refusing to use it")
        return m

    def _write_marker(self) -> None:
        self._wrote = True
        m = {"fedfast": __version__, "files": self.files, "dirs": self.dirs, "updated": _now()}
        if self._replaced is not None:
            m["replaced"] = self._replaced
        write_atomic(self._p(MARKER), dumps(m, indent=1))

    def add(self, *names: str, dirs: tuple = ()) -> None:
        """List files (and folders) in the marker before they are written."""
        new = [n for n in names if n not in self.files]
        newd = [d for d in dirs if d not in self.dirs]
        if new or newd:
            self.files += new
            self.dirs += newd
            self._new.update(new)
            self._write_marker()

    def refresh(self) -> None:
        """Re-read the marker another process of this run (``--workers``' rank 0) added to; what it listed since
        :meth:`open` counts as this run's, and rounds on disk make the run saved."""
        m = self.read_marker()
        if m is None:
            return
        new = [f for f in m["files"] if f not in self.files]
        self.files, self.dirs = list(m["files"]), list(m.get("dirs", []))
        self._new.update(new)
        p = self._p("metrics.jsonl")
        if os.path.isfile(self._p("checkpoint.pt")) or (os.path.isfile(p) and os.path.getsize(p) > 0):
            self.saved = True

    def write(self, name: str, data: bytes | str) -> None:
        self.add(name)
        write_atomic(self._p(name), data)

    # -- the lock ----------------------------------------------------------------------------------------------
    def _lock(self) -> None:
        lp = self._p(LOCK)
        while True:
            self._lock_created = not os.path.exists(lp)
            fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise RunLocked(self.path, _holder(lp)) from None
                raise
            try:  # the file we locked is still the lock file (a clean-up may have unlinked it meanwhile)
                same = os.fstat(fd).st_ino == os.stat(lp).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": _now()}).encode(), 0)
        self._fd = fd

    # -- open / close ------------------------------------------------------------------------------------------
    def open(self, mode: str) -> str:
        """Make the directory a run for ``mode`` and hold its lock. Modes: ``new`` (refuse a run already there),
        ``force`` (replace a run: remove what its marker lists), ``resume`` (continue it), ``auto`` (a sweep's:
        resume a checkpointed run, skip a finished one, else start afresh). Returns what it will do: ``new``,
        ``resume`` or ``skip``."""
        if mode not in ("new", "force", "resume", "auto"):
            raise ValueError(f"mode: one of new, force, resume, auto; got {mode!r}")
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ValueError(f"{self.path}: is a file, not a directory (--out names the run directory)")
        if mode == "resume" and not os.path.isdir(self.path):
            raise ValueError(f"--resume: {self.path}: no such run directory")
        self._makedirs()
        try:
            self._lock()
            return self._check(mode)
        except BaseException:
            self.close(failed=True)
            raise

    def _makedirs(self) -> None:
        missing, p = [], os.path.abspath(self.path)
        while not os.path.isdir(p):
            missing.append(p)
            p = os.path.dirname(p)
        os.makedirs(self.path, exist_ok=True)
        self._made = list(reversed(missing))

    def _legacy(self) -> dict | None:
        """A run directory written before markers existed (its checkpoint.pt has fedfast's header): adopted, with
        the outputs it holds listed."""
        try:
            with open(self._p("checkpoint.pt"), "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    return None
        except OSError:
            return None
        files = [n for n in OUTPUTS if n not in ("tb", MARKER) and os.path.isfile(self._p(n))]
        tb = self._p("tb")
        dirs = ["tb"] if os.path.isdir(tb) else []
        if dirs:
            files += [f"tb/{n}" for n in sorted(os.listdir(tb)) if n.startswith("events.out.tfevents.")]
        return {"files": files, "dirs": dirs}

    def _check(self, mode: str) -> str:
        m = self._restore_replaced(self.read_marker())
        legacy = m is None and (m := self._legacy()) is not None
        if m is None:
            theirs = sorted(n for n in OUTPUTS if os.path.lexists(self._p(n)))
            if mode == "resume":
                raise ValueError(
                    f"--resume: {self.path} is not a fedfast run directory (no {MARKER}: fedfast "
                    f"writes it first in every run directory)"
                )
            if theirs:
                raise ValueError(
                    f"{self.path}: holds {', '.join(theirs)} but is not a fedfast run directory (no "
                    f"{MARKER}); these files are not a run's, and --force removes only what a fedfast "
                    f"run wrote. Choose another --out, or move them away"
                )
            self._write_marker()
            self._new.add(MARKER)
            return "new"
        self.files, self.dirs = list(m["files"]), list(m.get("dirs", []))
        self.saved = True  # a run's results are here: a failure from now on never takes them back
        if legacy:
            self._write_marker()
        state = status(self.path)
        has_ck = os.path.isfile(self._p("checkpoint.pt"))
        if mode == "resume":
            if state == "diverged":
                s = read_json(self._p("summary.json"), "summary")
                raise ValueError(
                    f"--resume: the run in {self.path} diverged at round {s.get('diverged_round')}; "
                    f"resumed from its last checkpoint it would take the same steps and diverge again. "
                    f"Start it afresh with other settings (--force, or another --out)"
                )
            if not has_ck:
                raise ValueError(
                    f"--resume: {self.path} holds no checkpoint.pt (the run saved no round); start it "
                    f"again with --force"
                )
            return "resume"
        if mode == "auto":
            if state in ("complete", "diverged"):
                return "skip"
            if has_ck:
                return "resume"
        elif mode == "new":
            listed = [f for f in self.files if f != MARKER and os.path.lexists(self._p(f))]
            if listed:
                what = f"a {state} run" if state else "a fedfast run"
                raise ValueError(
                    f"{self.path}: holds {what} ({', '.join(listed[:6])}"
                    f"{', ...' if len(listed) > 6 else ''}); continue it with --resume {self.path} or "
                    f"replace it with --force (which removes only the files its {MARKER} lists)"
                )
        self._clear()
        return "new"

    def _clear(self) -> None:
        """Move what the marker lists into REPLACED (deleted once this run saves its first round, put back if it
        fails before; the lock and the marker stay: this process holds them); stale temporary files go."""
        self._replaced = None
        old = [n for n in self.files if n not in (MARKER, LOCK) and os.path.lexists(self._p(n))]
        for name in self.files:
            if name not in (MARKER, LOCK):
                self._remove(name, keep=True)
        self.saved = False  # the old run is set aside: a failure before this run's first round puts it back
        if old:
            os.makedirs(self._p(REPLACED), exist_ok=True)
            shutil.copy2(self._p(MARKER), os.path.join(self._p(REPLACED), MARKER))  # put back as it was
            self._replaced = {"files": old, "dirs": list(self.dirs)}
            self._write_marker()  # listed before anything moves: a kill in between is put right at the next open
            for name in old:
                dst = os.path.join(self._p(REPLACED), name)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.replace(self._p(name), dst)
        self._rmdir_empty()
        self.files = [MARKER]
        self.dirs = []
        self._write_marker()

    def _restore_replaced(self, m: dict | None) -> dict | None:
        """A run replaced by ``--force`` whose replacement saved no round (it was killed: its ``close`` never ran):
        the replacement's files removed, the old run's moved back; returns the marker as it is then. A REPLACED
        folder no marker points to (a kill while it was being deleted) is removed."""
        rep = (m or {}).get("replaced")
        if rep is None:
            if m is not None and os.path.isdir(self._p(REPLACED)):
                shutil.rmtree(self._p(REPLACED), ignore_errors=True)
            return m
        old = set(rep["files"])
        for name in m["files"]:
            if name not in old and name not in (MARKER, LOCK):
                self._remove(name)
        self.dirs = [d for d in m.get("dirs", []) if d not in rep.get("dirs", [])]
        self._rmdir_empty()  # folders only the replacement made, where it left nothing
        for name in rep["files"]:
            src = os.path.join(self._p(REPLACED), name)
            if os.path.lexists(src):
                os.makedirs(os.path.dirname(self._p(name)), exist_ok=True)
                os.replace(src, self._p(name))
        self._replaced = None
        kept = os.path.join(self._p(REPLACED), MARKER)
        if os.path.isfile(kept):  # the old run's marker itself
            os.replace(kept, self._p(MARKER))
        else:
            self.files, self.dirs = [MARKER, *rep["files"]], list(rep.get("dirs", []))
            self._write_marker()
        shutil.rmtree(self._p(REPLACED), ignore_errors=True)
        m = self.read_marker()
        self.files, self.dirs = list(m["files"]), list(m.get("dirs", []))
        return m

    def close(self, failed: bool = False) -> None:
        """Release the lock. ``failed`` before any round was saved: remove what this process wrote (and the
        marker and lock file where nothing else of a run is left) and the directories it made where empty."""
        try:
            if failed and not self.saved and self._fd is not None and self._wrote:
                for name in sorted(self._new - {MARKER}, key=len, reverse=True):
                    self._remove(name)
                self._rmdir_empty()
                left = [f for f in self.files if f != MARKER and os.path.lexists(self._p(f))]
                if self._replaced is not None:  # --force: the old run back in place, its marker as it was
                    self._restore_replaced({"files": self.files, "dirs": self.dirs, "replaced": self._replaced})
                elif left:
                    self.files = [MARKER, *left]
                    self._write_marker()
                else:  # unlinked while still locked (a process that opened the old file sees the inode change)
                    for name in (MARKER, LOCK):
                        if os.path.exists(self._p(name)):
                            os.remove(self._p(name))
            elif failed and self._fd is not None and self._lock_created and not self._wrote:
                os.remove(self._p(LOCK))  # refused before it became a run: leave the directory as it was
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if failed and not self.saved:
                for d in reversed(self._made):  # the folders this run made, if nothing is left in them
                    try:
                        os.rmdir(d)
                    except OSError:
                        break

    def _rmdir_empty(self) -> None:
        """The folders the marker lists, deepest first, where nothing is left in them."""
        for d in sorted(self.dirs, key=len, reverse=True):
            p = self._p(d)
            if os.path.isdir(p) and not os.path.islink(p) and not os.listdir(p):
                os.rmdir(p)

    def _remove(self, name: str, keep: bool = False) -> None:
        """A listed file and the temporary files a killed atomic write of it left (``keep``: the temporary files
        only)."""
        p = self._p(name)
        tmps = glob.glob(os.path.join(glob.escape(os.path.dirname(p)), f".{glob.escape(os.path.basename(p))}.tmp-*"))
        for q in tmps if keep else [p, *tmps]:
            if os.path.isfile(q) or os.path.islink(q):
                os.remove(q)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(failed=exc_type is not None)
        return False


def attach(path: str) -> RunDir:
    """The run directory another process of this run holds the lock of (``--workers``: the launcher holds it,
    rank 0 writes): files are listed in its marker without taking the lock."""
    rd = RunDir(path)
    m = rd.read_marker()
    if m is None:
        raise ValueError(f"{path}: no {MARKER} (the launcher writes it before starting the workers)")
    rd.files, rd.dirs = list(m["files"]), list(m.get("dirs", []))
    rd._replaced = m.get("replaced")  # kept in the markers rank 0 writes (the launcher drops or restores it)
    return rd


def status(path: str) -> str | None:
    """``complete``, ``diverged``, ``incomplete`` (checkpointed or stopped) or None (no readable summary)."""
    try:
        with open(os.path.join(path, "summary.json")) as f:
            s = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(s, dict):
        return None
    return s.get("status") or ("complete" if s.get("complete") else "incomplete")


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def recover(path: str) -> None:
    """A run directory whose ``--force`` replacement was killed before it saved a round: its old run put back
    (what the next :meth:`RunDir.open` does), so that ``--resume`` and ``report`` see the run and not the folder
    it was set aside in. Nothing happens where there is no such run, or while a live run holds the lock."""
    try:
        m = read_json(os.path.join(str(path), MARKER), "fedfast run marker")
    except (OSError, ValueError):
        return
    if not (isinstance(m, dict) and m.get("replaced") is not None):
        return
    rd = RunDir(path)
    try:
        rd._lock()
    except RunLocked:
        return  # the replacement is alive: its files are its own
    try:
        rd._restore_replaced(rd.read_marker())
    finally:
        rd.close()
