"""Where a store's rows live: one interface, :class:`RowPlace`, and one class per place - device or host memory
(:class:`fedfast.store.memory.MemoryRows`), pinned host memory (:class:`fedfast.store.pinned.PinnedRows`) and a
memory-mapped file (:class:`fedfast.store.file.FileRows`).

A place holds a table ``[capacity, cols]`` of the storage dtype and makes room for rows; which row holds which
client, copy-on-write and checkpoints are the store's (:class:`fedfast.store.state.ClientState`)."""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor


def physical_bytes() -> int:
    """The machine's memory (1 GiB when it cannot be read)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 30


class RowPlace:
    """The interface of a place. ``table``: ``[capacity, cols]`` (rows ``[0, used)`` hold data, row 0 the initial
    value); ``device``: the table's device (rows are copied from there to the store's device); ``cols``,
    ``dtype``, ``row_bytes``; ``on_disk``; ``stamps``: each row's write stamp (a file's; None in memory)."""

    on_disk = False
    stamps: np.ndarray | None = None
    table: Tensor
    device: torch.device

    def __init__(self, cols: int, dtype: torch.dtype):
        self.cols, self.dtype = int(cols), dtype
        self.row_bytes = self.cols * torch.empty((), dtype=dtype).element_size()

    def grow(self, used: int, need: int) -> None:
        """Make rows ``[0, need)`` addressable, keeping rows ``[0, used)``."""
        raise NotImplementedError

    def reset(self) -> None:
        """Empty: a table of one row (the initial value's, written by the store)."""
        raise NotImplementedError

    def nbytes(self, used: int) -> int:
        """Bytes of memory the table holds while ``used`` rows are in use."""
        raise NotImplementedError

    def stamp(self, slots: np.ndarray, seq: int) -> None:
        """Record that write ``seq`` filled rows ``slots`` (a file keeps it; memory has no use for it)."""

    def release(self) -> None:
        """After rows were read or written: a file lets the process drop its mapping of them (memory: nothing)."""
