"""Rows in a memory-mapped file (:class:`FileRows`, over :class:`fedfast.store.rowfile.RowFile`): per-client state
larger than memory (``state_store = "disk"``, or ``"auto"`` past ``state_memory``)."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import numpy as np
import torch
from torch import Tensor

from .place import RowPlace
from .rowfile import RowFile


class FileRows(RowPlace):
    """The table is the file's rows (a mapping, in host memory's page cache; the process holds none of them after
    :meth:`release`). ``tmp``: the temporary directory of a file without a run directory (removed with this
    object); a file in a run directory (``tmp`` None) outlives the process and checkpoints refer to it."""

    on_disk = True

    def __init__(self, f: RowFile, tmp: str | None = None):
        super().__init__(f.cols, f.dtype)
        self.file, self.tmp, self.device = f, tmp, torch.device("cpu")
        self.table = f.rows
        if tmp is not None:
            weakref.finalize(self, shutil.rmtree, tmp, True)

    @classmethod
    def spill(cls, directory: str | None, name: str, table: Tensor, used: int, seq: int) -> "FileRows":
        """A new file (``<directory>/<name>``, or in a temporary directory) holding rows ``[0, used)`` of
        ``table``, copied once in blocks (no second full-size table), each stamped ``seq``."""
        tmp = None
        if directory is None:
            tmp = directory = tempfile.mkdtemp(prefix="fedfast-state-")
        f = RowFile.create(os.path.join(directory, name), table.shape[1], table.dtype, max(used, 1))
        f.reserve(0, used)
        for s in range(0, used, 4096):
            e = min(used, s + 4096)
            f.rows[s:e] = table[s:e].cpu()
        f.stamps[:used] = seq
        return cls(f, tmp)

    @classmethod
    def open(cls, directory: str, name: str, cols: int, dtype: torch.dtype, uid: str | None) -> "FileRows":
        """The file another process made, or a checkpoint refers to (``uid``: the file it must be)."""
        return cls(RowFile.open(os.path.join(directory, name), cols, dtype, uid))

    @property
    def stamps(self) -> np.ndarray:
        return self.file.stamps

    def grow(self, used: int, need: int) -> None:
        self.file.grow(need)
        self.file.reserve(used, need)
        self.table = self.file.rows

    def follow(self, rows: int) -> None:
        """Map the file as far as ``rows`` rows (grown by another process)."""
        self.file.follow(rows)
        self.table = self.file.rows

    def reset(self) -> None:
        """Empty: a run directory's file is replaced by a new one (a new id: checkpoints of the old are refused);
        a temporary one is reused."""
        if self.tmp is None:
            self.file = RowFile.create(self.file.base, self.cols, self.dtype, 1)
        self.file.stamps[0] = 0
        self.table = self.file.rows

    def nbytes(self, used: int) -> int:
        return 0

    def stamp(self, slots: np.ndarray, seq: int) -> None:
        self.file.stamps[slots] = seq

    def release(self) -> None:
        self.file.release()

    def flush(self) -> None:
        self.file.flush()
