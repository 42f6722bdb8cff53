"""The lowest layer's plumbing, shared by every layer above: atomic file writes, reading a JSON file fedfast wrote,
and a host-to-device copy without a host sync. (Re-exported where they were first defined: ``fedfast.checkpoint.
write_atomic``, ``fedfast.rundir.read_json``, ``fedfast.flat.host_to_device``.)"""
from __future__ import annotations

import json
import os

import torch


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
    except BaseException:  # a failed write (disk full, bad data, Ctrl-C) leaves no temporary file
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    try:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # some filesystems do not fsync directories
        pass


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
    return t.pin_memory().to(device, non_blocking=True)
