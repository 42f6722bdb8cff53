"""The lowest layer's plumbing, shared by every layer above: atomic file writes (a failure is a :class:`WriteError`
naming the path), reading a JSON file fedfast wrote,
and a host-to-device copy without a host sync. Their one address is here (``tests/test_layers.py`` keeps re-exports
out)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import site
import sys
import sysconfig

import torch


class WriteError(OSError):
    """Writing a file failed (a full disk, a quota, a size limit, a read-only or removed directory): the OS error
    with the path it was writing."""

    def __init__(self, path: str, err: OSError):
        super().__init__(err.errno, err.strerror or str(err))
        self.path = path

    def __str__(self) -> str:
        return (
            f"{self.path}: could not be written ({self.strerror}"
            + (f", errno {self.errno}" if self.errno else "")
            + ")"
        )


def write_atomic(path: str, data: bytes | str) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never a partial one."""
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data: expected bytes or str, got {type(data).__name__}")
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:  # a failed write (disk full, bad data, Ctrl-C) leaves no temporary file
        if os.path.exists(tmp):
            try:
                os.remove(tmp)
            except OSError:
                pass
        if isinstance(e, OSError) and not isinstance(e, WriteError):
            raise WriteError(path, e) from None
        raise
    try:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # some filesystems do not fsync directories
        pass


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes (read in 4 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def append_line(f, path: str, line: str) -> None:
    """Append ``line`` to the open text file ``f`` (``path``) and flush; an OSError becomes a :class:`WriteError`."""
    try:
        f.write(line)
        f.flush()
    except WriteError:
        raise
    except OSError as e:
        raise WriteError(path, e) from None


def read_json(path: str, what: str = "JSON"):
    """A JSON file fedfast wrote; ValueError naming the file and the position of the damage."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a {what} file (not UTF-8 text: {e.reason} at byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: damaged {what} file (line {e.lineno}, column {e.colno}: {e.msg})") from None


def host_to_device(a, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A numpy array / host tensor on ``device`` without a host sync: on a GPU a pageable copy waits for all
    queued work, so the data goes through pinned memory with ``non_blocking`` (the caching host allocator
    keeps the pinned block alive until the copy has run)."""
    t = torch.as_tensor(a, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    if torch.cuda.is_current_stream_capturing():  # a replay would read the pinned block after it was reused
        raise RuntimeError("host_to_device: a host-to-device copy inside a CUDA graph capture (fedfast.sim.step_graph)")
    return t.pin_memory().to(device, non_blocking=True)


# -- the files a run reads: its data, for the run's fingerprint (fedfast.fingerprint) --------------------------
_READS: list[set] = []  # the active recorders (innermost last)
_QUIET = [0]  # > 0: reads are not recorded (a loader's own cache of derived data)
_HOOKED = [False]
_SKIP_DIRS = ("/proc/", "/sys/", "/dev/")
_CODE = (".py", ".pyc", ".pyo", ".so", ".pyd", ".pth")


@functools.lru_cache(maxsize=1)
def installation_dirs() -> tuple[str, ...]:
    """The Python installation's directories (the standard library, site-packages, the environment's prefix):
    files there are not the user's code or data (fedfast's and other packages' versions say what they are)."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    dirs.update(v for k, v in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib"))
    try:
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site module
        pass
    return tuple(sorted({os.path.realpath(d) + os.sep for d in dirs if d}))


def is_installed(path: str) -> bool:
    """Whether ``path`` lies inside the Python installation (:func:`installation_dirs`)."""
    p = os.path.realpath(path)
    return any(p.startswith(d) for d in installation_dirs())


def _audit(event: str, args) -> None:
    if event != "open" or not _READS or _QUIET[0]:
        return
    path, mode, flags = (tuple(args) + (None, None, None))[:3]
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str):  # a file descriptor
        return
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return
    if isinstance(flags, int) and mode is None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
        return
    p = os.path.abspath(path)
    if p.endswith(_CODE) or p.startswith(_SKIP_DIRS) or is_installed(p) or not os.path.isfile(p):
        return  # code, the kernel's files, packages' own files (their versions say what they are)
    for s in _READS:
        s.add(p)


def depends_on(path: str) -> None:
    """Record ``path`` as data the run read, wherever it lies (a loader that serves it from a cache of its own, or
    a data file inside a package, says so here)."""
    if not _READS or _QUIET[0]:
        return
    p = os.path.abspath(path)
    if os.path.isfile(p):
        for s in _READS:
            s.add(p)


class record_reads:
    """``with record_reads() as files:`` - every regular file opened for reading inside the block (through
    ``open``, ``os.open``, numpy, torch, PIL, ...: Python's ``open`` audit event), and those named by
    :func:`depends_on`, into the set ``files`` (absolute paths). Python source and compiled modules, and
    /proc, /sys and /dev are left out; :func:`not_data` leaves out a loader's own caches."""

    def __enter__(self) -> set:
        if not _HOOKED[0]:
            sys.addaudithook(_audit)
            _HOOKED[0] = True
        self.files: set = set()
        _READS.append(self.files)
        return self.files

    def __exit__(self, *exc) -> None:
        _READS.remove(self.files)


class not_data:
    """``with not_data():`` - reads inside are not recorded (a cache derived from files already recorded)."""

    def __enter__(self):
        _QUIET[0] += 1

    def __exit__(self, *exc) -> None:
        _QUIET[0] -= 1
