"""Rows in pinned host memory (:class:`PinnedRows`): per-client state larger than the GPU's memory, copied to the
device a round's rows at a time (``state_on_host``)."""

from __future__ import annotations

import torch
from torch import Tensor

from .memory import MemoryRows


class PinnedRows(MemoryRows):
    """A table in page-locked host memory (fast, asynchronous copies to the GPU). It grows as device memory does
    (page-locked memory is held as allocated: no reservation)."""

    def __init__(
        self, cols: int, dtype: torch.dtype, *, max_rows: int, memory_budget: int | None = None, auto: bool = False
    ):
        super().__init__(cols, dtype, torch.device("cpu"), max_rows=max_rows, memory_budget=memory_budget, auto=auto)

    def _alloc(self, rows: int) -> Tensor:
        return super()._alloc(rows).pin_memory()

    def _reserves(self) -> bool:
        return False
