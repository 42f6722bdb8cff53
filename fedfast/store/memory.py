"""Rows in device or host memory (:class:`MemoryRows`), the store's default place."""

from __future__ import annotations

import torch
from torch import Tensor

from .place import RowPlace, physical_bytes


class MemoryRows(RowPlace):
    """A table in ``device`` memory that grows as it fills. Host memory: the first growth reserves all the rows the
    run can write (``max_rows``, up to ``memory_budget`` bytes), pages never written taking no memory, so no later
    copy; device memory (or past the reservation): doubling while small, then by a quarter (a growth copies: old
    and new are held at once), never past ``max_rows``. ``auto``: the store moves to a file past
    ``memory_budget``, so growth stops there."""

    def __init__(
        self,
        cols: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        max_rows: int,
        memory_budget: int | None = None,
        auto: bool = False,
    ):
        super().__init__(cols, dtype)
        self.device, self.max_rows, self.memory_budget, self.auto = device, int(max_rows), memory_budget, auto
        self.table = self._alloc(1)

    def _alloc(self, rows: int) -> Tensor:
        return torch.empty(rows, self.cols, dtype=self.dtype, device=self.device)

    def _reserves(self) -> bool:
        """Whether growth reserves the run's rows at once (host memory, whose untouched pages cost nothing)."""
        return self.device.type == "cpu"

    def grow(self, used: int, need: int) -> None:
        cap = self.table.shape[0]
        if need <= cap:
            return
        cap_rows = (
            self.max_rows if self.memory_budget is None else min(self.max_rows, self.memory_budget // self.row_bytes)
        )
        grown = None
        if self._reserves() and need <= cap_rows and cap_rows * self.row_bytes <= physical_bytes():
            try:
                grown = self._alloc(cap_rows)
            except RuntimeError:  # no room to reserve (a strict overcommit policy): grow as needed instead
                grown = None
        if grown is None:
            new = max(need, min(2 * cap if cap * self.row_bytes < 2**26 else cap + cap // 4, self.max_rows))
            if self.auto and self.memory_budget is not None:
                new = max(need, min(new, self.memory_budget // self.row_bytes))
            grown = self._alloc(new)
        grown[:used] = self.table[:used]
        self.table = grown

    def reset(self) -> None:
        self.table = self._alloc(1)

    def nbytes(self, used: int) -> int:
        """Host memory: the rows in use (a reservation's untouched pages take none); device memory: as allocated."""
        if self._reserves():
            return used * self.row_bytes
        return self.table.numel() * self.table.element_size()
