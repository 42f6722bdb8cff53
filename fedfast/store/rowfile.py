"""Rows in a memory-mapped file: the disk tier of the per-client state store (:class:`fedfast.store.ClientState`,
:mod:`fedfast.store.file`).

Two files side by side, ``<base>.rows`` and ``<base>.stamps``:

* ``.rows``: a 4 KiB header (``FEDFAST-ROWS 1``, then JSON: a random ``uuid``, ``cols``, ``dtype``) and then fixed
  rows of ``cols`` values (float32, or bfloat16 stored as its 16 bits), row ``i`` at byte ``4096 + i * row_bytes``;
* ``.stamps``: one int64 per row, the write (the store's round counter) that last filled it.

The files are sparse and grow by doubling (``ftruncate``); :attr:`rows` is a torch view of the mapping (an
``index_select`` reads rows from the page cache, an ``index_copy_`` writes them). A checkpoint names the file by
``uuid`` and keeps each referenced row's stamp, so a resume from a checkpoint whose rows were since overwritten,
or against another file, is refused instead of reading garbage. Several processes may map the same file (one
grows it, the others :meth:`follow` its size)."""

from __future__ import annotations

import errno
import json
import mmap
import os
import uuid as _uuid

import numpy as np
import torch

from .._io import WriteError

HEADER = 4096
MAGIC = b"FEDFAST-ROWS 1\n"
_NP = {torch.float32: np.float32, torch.bfloat16: np.uint16}
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def paths_of(base: str) -> tuple[str, str]:
    """The row file and the stamp file of the store at ``base``."""
    return base + ".rows", base + ".stamps"


class RowFile:
    """The row and stamp files at ``base`` (a path without suffix), mapped. Use :meth:`create` or :meth:`open`."""

    def __init__(self, base: str, cols: int, dtype: torch.dtype, uid: str):
        self.base, self.cols, self.dtype, self.uuid = base, int(cols), dtype, uid
        self.row_bytes = self.cols * torch.empty((), dtype=dtype).element_size()
        self.capacity = 0
        self.rows: torch.Tensor | None = None
        self.stamps: np.ndarray | None = None
        self._maps = None
        self._remap()

    @property
    def paths(self) -> tuple[str, str]:
        return paths_of(self.base)

    @classmethod
    def create(cls, base: str, cols: int, dtype: torch.dtype, rows: int) -> "RowFile":
        """New files (replacing any at ``base``) with room for ``rows`` rows and a new uuid."""
        if dtype not in _NP:
            raise TypeError(f"dtype: the state file holds float32 or bfloat16 rows, got {dtype}")
        uid = _uuid.uuid4().hex
        head = MAGIC + json.dumps({"uuid": uid, "cols": int(cols), "dtype": _NAMES[dtype]}).encode() + b"\n"
        rows_path, stamps_path = paths_of(base)
        try:
            with open(rows_path, "wb") as f:
                f.write(head.ljust(HEADER, b"\0"))
            with open(stamps_path, "wb"):
                pass
        except OSError as e:
            raise WriteError(getattr(e, "filename", None) or rows_path, e) from None
        f = cls(base, cols, dtype, uid)
        f.grow(rows)
        return f

    @classmethod
    def open(cls, base: str, cols: int, dtype: torch.dtype, uid: str | None) -> "RowFile":
        """The existing files at ``base``; ValueError if they are missing or not the store ``uid`` describes (None:
        any store of ``cols`` ``dtype`` values)."""
        path = paths_of(base)[0]
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER)
        except FileNotFoundError:
            raise ValueError(
                f"{path}: the per-client state file this checkpoint refers to is missing (it lives "
                f"beside the checkpoint, in the run directory)"
            ) from None
        if not head.startswith(MAGIC) or b"\n" not in head[len(MAGIC) :]:
            raise ValueError(f"{path}: not a fedfast per-client state file")
        try:
            meta = json.loads(head[len(MAGIC) :].split(b"\n", 1)[0])
        except ValueError:
            raise ValueError(f"{path}: not a fedfast per-client state file (unreadable header)") from None
        if uid is not None and meta.get("uuid") != uid:
            raise ValueError(
                f"{path}: another per-client state file than the checkpoint's (its id is "
                f"{meta.get('uuid')}, the checkpoint's {uid}): the file was replaced since"
            )
        if meta.get("cols") != cols or meta.get("dtype") != _NAMES.get(dtype):
            raise ValueError(
                f"{path}: rows of {meta.get('cols')} {meta.get('dtype')} values, the run keeps "
                f"{cols} {_NAMES.get(dtype)}"
            )
        return cls(base, cols, dtype, meta.get("uuid"))

    def _remap(self) -> None:
        rows_path, stamps_path = self.paths
        n = (os.path.getsize(rows_path) - HEADER) // self.row_bytes
        n = min(n, os.path.getsize(stamps_path) // 8)
        self.rows = self.stamps = self._maps = None  # the old mappings close once no array refers to them
        self.capacity = 0
        if n < 1:
            return
        maps = []
        for path, size in ((rows_path, HEADER + n * self.row_bytes), (stamps_path, n * 8)):
            with open(path, "r+b") as f:
                maps.append(mmap.mmap(f.fileno(), size))
        a = np.frombuffer(maps[0], dtype=_NP[self.dtype], count=n * self.cols, offset=HEADER).reshape(n, self.cols)
        t = torch.from_numpy(a)
        self.rows = t.view(torch.bfloat16) if self.dtype == torch.bfloat16 else t
        self.stamps = np.frombuffer(maps[1], dtype=np.int64, count=n)
        self._maps, self.capacity = maps, n

    def grow(self, rows: int) -> None:
        """Room for at least ``rows`` rows (the files at least double: amortised O(1) per row)."""
        if rows <= self.capacity:
            return
        n = max(int(rows), 2 * self.capacity)
        rows_path, stamps_path = self.paths
        os.truncate(rows_path, HEADER + n * self.row_bytes)  # sparse: pages never written take no disk
        os.truncate(stamps_path, n * 8)
        self._remap()

    def reserve(self, start: int, stop: int) -> None:
        """Disk blocks for rows ``[start, stop)`` and their stamps before they are written (``posix_fallocate``):
        a full disk or quota is then a :class:`fedfast._io.WriteError` naming the file here, not a SIGBUS when a
        write through the mapping finds no block. A file system that cannot reserve: nothing reserved."""
        if stop <= start:
            return
        for path, off, size in (
            (self.paths[0], HEADER + start * self.row_bytes, (stop - start) * self.row_bytes),
            (self.paths[1], start * 8, (stop - start) * 8),
        ):
            fd = os.open(path, os.O_RDWR)
            try:
                os.posix_fallocate(fd, off, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise WriteError(path, e) from None
            finally:
                os.close(fd)

    def follow(self, rows: int) -> None:
        """Map at least ``rows`` rows another process grew the files to."""
        if rows > self.capacity:
            self._remap()
            if rows > self.capacity:
                raise ValueError(f"{self.paths[0]}: holds {self.capacity} rows, row {rows - 1} was expected")

    def flush(self) -> None:
        """The mapped pages to the file (before a checkpoint refers to them)."""
        for m in self._maps or ():
            m.flush()

    def release(self) -> None:
        """Drop this process's mapping of the pages (the rows stay in the file and the page cache): the process's
        resident memory holds a round's rows, not every row the run wrote."""
        for m in self._maps or ():
            m.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self.flush()
        self.rows = self.stamps = self._maps = None
        self.capacity = 0
