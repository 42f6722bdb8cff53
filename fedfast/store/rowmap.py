"""Which row of a store's table holds which client (:class:`RowMap`), apart from the rows themselves (a
:class:`fedfast.store.place.RowPlace` holds those) and from the store that gathers, scatters and checkpoints over
both (:class:`fedfast.store.state.ClientState`)."""

from __future__ import annotations

from typing import Callable

import numpy as np

_NONE = np.empty(0, dtype=np.int64)


class RowMap:
    """The client -> row map of K clients and the bookkeeping of the rows: ``slot_of`` [K] (0: never written, the
    client reads the initial row 0), rows ``[0, used)`` in use, ``written`` the clients with a row of their own,
    ``seq`` the writes so far (a row's stamp is the write that filled it) and ``commit_seq`` the write count at the
    latest checkpoint. A copy-on-write table (``cow``: a file a checkpoint refers to) writes every client into a
    fresh row, never one the latest checkpoint holds: a superseded row goes to ``pending`` when that checkpoint
    may hold it (its stamp at or before ``commit_seq``), else to ``free``; :meth:`commit` (a checkpoint) frees
    the pending rows. Host int64 arrays: 8 bytes a client, no Python object per client."""

    def __init__(self, num_clients: int):
        self.slot_of = np.zeros(int(num_clients), dtype=np.int64)
        self.reset()

    @property
    def nbytes(self) -> int:
        return self.slot_of.nbytes + self.free.nbytes + self.pending.nbytes

    def reset(self) -> None:
        """No client written: every client reads row 0; one row in use."""
        self.slot_of[:] = 0
        self.used, self.seq, self.commit_seq, self.written = 1, 0, 0, 0
        self.free = self.pending = _NONE

    def new_rows(self, a: np.ndarray, cow: bool) -> int:
        """Rows that writing clients ``a`` adds (copy-on-write: one each; else the clients without one)."""
        return len(a) if cow else int(np.count_nonzero(self.slot_of[a] == 0))

    def allocate(self, a: np.ndarray, cow: bool, grow: Callable[[int, int], None]) -> np.ndarray:
        """Rows for clients ``a`` to be written: a new client's next free row; a client with a row keeps it, or,
        copy-on-write, gets a free or new one. ``grow(used, need)`` makes rows ``[0, need)`` addressable first."""
        slots = self.slot_of[a].copy()
        fresh = np.ones(len(a), dtype=bool) if cow else slots == 0
        n = int(fresh.sum())
        reuse = self.free[:n]
        self.free = self.free[n:]
        need = self.used + n - len(reuse)
        grow(self.used, need)
        slots[fresh] = np.concatenate([reuse, np.arange(self.used, need, dtype=np.int64)])
        self.used = need
        return slots

    def assign(self, a: np.ndarray, slots: np.ndarray, *, cow: bool, stamps=None, track: bool = True) -> None:
        """Clients ``a`` read rows ``slots`` from now on (one write more); ``track``: the superseded rows of a
        copy-on-write table go to the free or pending list by their ``stamps`` (a process that does not allocate
        keeps no lists)."""
        old = self.slot_of[a]
        self.slot_of[a] = slots
        self.seq += 1
        self.written += int(np.count_nonzero(old == 0))
        if len(slots):
            self.used = max(self.used, int(slots.max()) + 1)
        if track and cow:
            gone = old[(old != 0) & (old != slots)]
            held = stamps[gone] <= self.commit_seq  # filled before the latest checkpoint: it may hold it
            self.pending = np.concatenate([self.pending, gone[held]])
            self.free = np.concatenate([self.free, gone[~held]])

    def referenced(self) -> tuple[np.ndarray, np.ndarray]:
        """The written clients and their rows, in row order (a checkpoint restores the same table)."""
        ids = np.flatnonzero(self.slot_of)
        ids = ids[np.argsort(self.slot_of[ids], kind="stable")]
        return ids, self.slot_of[ids]

    def commit(self) -> None:
        """A checkpoint was taken: the rows superseded before it are free from now on."""
        self.free = np.concatenate([self.free, self.pending])
        self.pending = _NONE
        self.commit_seq = self.seq

    def uncommitted(self) -> None:
        """No checkpoint refers to the table (it just moved to a file): a superseded row is free at once."""
        self.commit_seq = -1

    def restore(self, ids: np.ndarray, slots: np.ndarray, used: int, seq: int) -> None:
        """A checkpoint's map: clients ``ids`` in rows ``slots`` of ``used``, after ``seq`` writes; every other row
        below ``used`` free."""
        self.slot_of[:] = 0
        self.slot_of[ids] = slots
        self.used, self.seq, self.written = int(used), int(seq), len(ids)
        self.commit_seq = self.seq
        taken = np.zeros(self.used, dtype=bool)
        taken[0] = True
        taken[slots] = True
        self.free, self.pending = np.flatnonzero(~taken).astype(np.int64), _NONE
