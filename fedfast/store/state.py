"""The per-client state store (:class:`ClientState`): gathers, scatters, the mean, copy-on-write and checkpoints,
over a row map (:class:`fedfast.store.rowmap.RowMap`: which row holds which client) and a place
(:mod:`fedfast.store.place`: where the rows live)."""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor

from .file import FileRows
from .memory import MemoryRows
from .pinned import PinnedRows
from .place import RowPlace
from .rowfile import paths_of
from .rowmap import RowMap


class ClientState:
    """Per-client state of K clients (FedDyn h_k, SCAFFOLD c_k, MOON's previous model), ``cols`` values each,
    stored for the clients that were written only: a client never written reads as ``fill`` (its initial
    value), so memory grows with the clients a run trains (at most rounds x cohort), not with K.

    Rows live in one table ``[1 + written, cols]`` (row 0: the initial value) that grows as it fills; the
    client -> row map is a host int64 array [K] (8 bytes a client, no Python object per client); a gather and a
    scatter are one ``index_select`` / ``index_copy_`` each. ``dtype`` fp32 or bf16 (storage; gathered rows are
    fp32), ``pin_memory=True`` keeps the table in pinned host memory (rows copied to ``device``). Rows are
    addressed by client id (a tensor, array or list; a device tensor is read to the host once per call).

    ``store``: where the table lives. ``"memory"`` (the default): device or host memory. ``"disk"``: a
    memory-mapped file (:mod:`fedfast.store.rowfile`, ``<directory>/<name>.rows`` and ``.stamps``) from the first write
    on. ``"auto"``: memory while the table fits ``memory_budget`` bytes, then the file (the rows written so far
    are copied there once). Without ``directory`` the file is in a temporary directory removed with the store,
    and :meth:`state_dict` holds the rows (as in memory). With ``directory`` (a run's directory) the file outlives
    the process and a checkpoint refers to it instead of copying it: then rows are copy-on-write (a scatter writes
    new rows, never a row the latest checkpoint holds, so a process killed during a scatter loses nothing) and a
    row superseded since the latest :meth:`state_dict` is reused after the next one; the newest checkpoint is
    always resumable, an older one whose rows were reused is refused by :meth:`load_state_dict` (each row's
    stamp), never read as garbage. ``max_rows``: the most rows a run can write (``1 + min(K, rounds x cohort)``;
    a hint that caps growth, not a limit).

    The place is one of :class:`~fedfast.store.memory.MemoryRows`, :class:`~fedfast.store.pinned.PinnedRows` and
    :class:`~fedfast.store.file.FileRows` (``place``).

    **The multi-process protocol.** A scatter is three verbs, which one process runs in a row (:meth:`scatter_`)
    and the processes of a ``torch.distributed`` group sharing one file run apart
    (:func:`fedfast.store.shared.store_rows`): :meth:`allocate` (rows for the clients to be written: rank 0 alone,
    which owns the free and pending lists and the checkpoints' stamps, and broadcasts the rows), :meth:`write`
    (each process its own clients' rows into those rows; then a barrier) and :meth:`assign` (every process maps
    the clients to their rows, ``track`` on rank 0 only). Around them: :meth:`spills` (whether this write moves an
    ``"auto"`` table to the file: rank 0's decision, made for all), :meth:`spill` (rank 0 moves it; a barrier),
    :meth:`attach` (the other ranks map rank 0's file) and :meth:`follow` (map the file as far as the rows rank 0
    allocated). Any other order, or a verb on another rank than the one named, may lose rows."""

    def __init__(
        self,
        num_clients: int,
        P: int,
        *,
        device=None,
        dtype: torch.dtype = torch.float32,
        pin_memory: bool = False,
        fill=0.0,
        store: str = "memory",
        directory: str | None = None,
        memory_budget: int | None = None,
        name: str = "client-state",
        max_rows: int | None = None,
    ):
        if dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"dtype: per-client state is fp32 or bf16, got {dtype}")
        if int(num_clients) < 1 or int(P) < 1:
            raise ValueError(f"num_clients and P: must be >= 1, got {num_clients}, {P}")
        if store not in ("memory", "disk", "auto"):
            raise ValueError(f"store: 'memory', 'disk' or 'auto', got {store!r}")
        if memory_budget is not None and not memory_budget > 0:
            raise ValueError(f"memory_budget: bytes > 0 (or None: no limit), got {memory_budget!r}")
        if directory is not None and not os.path.isdir(directory):
            raise ValueError(f"directory: {directory!r} is not a directory")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.store, self.directory, self.memory_budget, self.name = store, directory, memory_budget, name
        self.max_rows = 1 + int(num_clients) if max_rows is None else max(1, int(max_rows))
        self.dtype, self.cols, self.num_clients = dtype, int(P), int(num_clients)
        init = torch.as_tensor(fill, dtype=torch.float32).reshape(-1)
        if init.numel() not in (1, self.cols):
            raise ValueError(f"fill: a number or {self.cols} values (a client's initial row), got {init.numel()}")
        grow = dict(max_rows=self.max_rows, memory_budget=memory_budget, auto=store == "auto")
        if pin_memory and torch.cuda.is_available() and store != "disk":  # until "auto" moves to the file
            self.place: RowPlace = PinnedRows(self.cols, dtype, **grow)
        else:
            host = pin_memory or store == "disk"
            self.place = MemoryRows(self.cols, dtype, torch.device("cpu") if host else self.device, **grow)
        self.row_bytes = self.place.row_bytes
        self.table[0] = init.expand(self.cols).to(self.place.device, dtype)
        self.map = RowMap(self.num_clients)  # which row holds which client, the rows in use, free and pending

    # -- what the store is -------------------------------------------------------------------------------------
    @property
    def table(self) -> Tensor:
        """The place's table ``[capacity, cols]`` (storage dtype)."""
        return self.place.table

    @property
    def file(self):
        """The :class:`fedfast.store.rowfile.RowFile` once the table moved to a file, else None."""
        return self.place.file if self.place.on_disk else None

    @property
    def pin(self) -> bool:
        """The table is in pinned host memory."""
        return isinstance(self.place, PinnedRows)

    @property
    def K(self) -> int:
        return self.num_clients

    @property
    def shape(self) -> tuple:
        """``(K, cols)``: the state as if every client's row were stored."""
        return (self.num_clients, self.cols)

    @property
    def written(self) -> int:
        """Clients with a row of their own."""
        return self.map.written

    @property
    def slot_of(self) -> np.ndarray:
        """[K] each client's row (0: never written); the map's (:class:`~fedfast.store.rowmap.RowMap`)."""
        return self.map.slot_of

    @property
    def used(self) -> int:
        """Rows ``[0, used)`` of the table are allocated."""
        return self.map.used

    @property
    def seq(self) -> int:
        """Writes so far (a row's stamp: the write that filled it)."""
        return self.map.seq

    @property
    def free(self) -> np.ndarray:
        """Rows to reuse (copy-on-write files)."""
        return self.map.free

    @property
    def pending(self) -> np.ndarray:
        """Superseded rows the latest checkpoint may hold (free after the next one)."""
        return self.map.pending

    @property
    def on_disk(self) -> bool:
        return self.place.on_disk

    @property
    def cow(self) -> bool:
        """Rows are copy-on-write: the table is a file a checkpoint refers to (``directory`` given)."""
        return self.place.on_disk and self.place.tmp is None

    @property
    def nbytes(self) -> int:
        """Bytes held in memory: the table's rows in use (a host table reserves the run's rows, and pages never
        written take no memory; a device or pinned table: as allocated; a file: none) and the client -> row map."""
        return self.place.nbytes(self.used) + self.map.nbytes

    @property
    def file_bytes(self) -> int:
        """Bytes of the file's rows written so far (0 in memory)."""
        return self.used * self.row_bytes if self.on_disk else 0

    def file_paths(self) -> tuple[str, str] | tuple:
        """The paths of the rows and stamps files in ``directory`` (whether made yet or not); () without one."""
        return () if self.directory is None else paths_of(os.path.join(self.directory, self.name))

    # -- reads and writes --------------------------------------------------------------------------------------
    def _ids(self, ids) -> np.ndarray:
        a = ids.detach().cpu().numpy() if isinstance(ids, Tensor) else np.asarray(ids)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise ValueError(f"ids: expected a 1-d list of client ids, got shape {a.shape}")
        if a.size and (a.min() < 0 or a.max() >= self.num_clients):
            raise ValueError(f"ids: client ids in [0, {self.num_clients}), got {int(a.min())}..{int(a.max())}")
        return a.astype(np.int64, copy=False)

    def _slots(self, slots: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots)).to(self.place.device, non_blocking=True)

    def gather(self, ids, out: Tensor | None = None) -> Tensor:
        """Rows of clients ``ids`` as fp32 ``[n, cols]`` on ``self.device`` (the initial row for a client never
        written)."""
        rows = self.table.index_select(0, self._slots(self.slot_of[self._ids(ids)]))
        self.place.release()  # a file: the rows are copied out, the process keeps no mapping of them
        rows = rows.to(self.device, non_blocking=True).float()
        if out is not None:
            out.copy_(rows)
            return out
        return rows

    def scatter_(self, ids, rows: Tensor, *, spill: bool = True) -> None:
        """Write fp32 rows ``[n, cols]`` for clients ``ids`` (rounded to the storage dtype); a client written for
        the first time gets a row of its own (the table grows when full; ``store="auto"`` moves it to the file
        beyond ``memory_budget``, unless ``spill=False``)."""
        a = self._ids(ids)
        if rows.shape != (len(a), self.cols):
            raise ValueError(f"rows: expected shape ({len(a)}, {self.cols}), got {tuple(rows.shape)}")
        if len(np.unique(a)) != len(a):
            raise ValueError("ids: a client written twice in one scatter")
        slots = self.allocate(a, spill=spill)
        self.write(slots, rows)
        self.assign(a, slots)

    def mean(self) -> Tensor:
        """Mean over all K clients in fp32 (FedDyn's server correction, FedDistill+'s logit sum): the written rows'
        sum, in client-id order and 64 MiB of rows at a time (the same sum whatever the table's layout: in memory,
        on disk, after a resume), and the initial row for every client never written."""
        slots = self.slot_of[np.flatnonzero(self.slot_of)]
        total = torch.zeros(self.cols, device=self.table.device)
        step = max(1, 2**26 // self.row_bytes)
        for s in range(0, len(slots), step):
            total += self.table.index_select(0, self._slots(slots[s : s + step])).float().sum(0)
        self.place.release()
        total = total + (self.num_clients - len(slots)) * self.table[0].float()
        return (total / self.num_clients).to(self.device)

    def dense(self) -> Tensor:
        """Every client's row, ``[K, cols]`` fp32 on the storage device (K rows: small populations and tests)."""
        return self.table.index_select(0, self._slots(self.slot_of)).float()

    # -- the multi-process protocol: a scatter's three verbs and the file's moves (see the class docstring) -----
    def spills(self, ids) -> bool:
        """Whether writing clients ``ids`` moves an ``"auto"`` table from memory to the file (or a ``"disk"`` one
        makes its file)."""
        if self.on_disk or self.store == "memory":
            return False
        if self.store == "disk":
            return True
        need = self.used + self.map.new_rows(self._ids(ids), self.cow)
        return self.memory_budget is not None and need * self.row_bytes > self.memory_budget

    def allocate(self, ids, *, spill: bool = True) -> np.ndarray:
        """Rows for clients ``ids`` to be written: a new client's next free row; a client with a row keeps it,
        or, copy-on-write, gets a free or new one. Grows the table (``spill=False``: never into the file)."""
        a = self._ids(ids)
        if spill and self.spills(a):
            self.spill()
        return self.map.allocate(a, self.cow, self.place.grow)

    def write(self, slots: np.ndarray, rows: Tensor) -> None:
        """Rows ``[n, cols]`` (fp32) into table rows ``slots``, stamped with this write's number."""
        self.table.index_copy_(0, self._slots(slots), rows.to(self.place.device, self.dtype))
        self.place.stamp(slots, self.seq + 1)
        self.place.release()

    def assign(self, ids, slots: np.ndarray, *, track: bool = True) -> None:
        """Clients ``ids`` read rows ``slots`` from now on (after :meth:`write`); ``track=False``: a process that
        does not allocate (another process's rows of a shared file) keeps no free list."""
        self.map.assign(self._ids(ids), slots, cow=self.cow, stamps=self.place.stamps, track=track)

    def spill(self) -> None:
        """Move the table to the file (``<directory>/<name>``, or a temporary directory): the rows written so far
        are copied once; later growth extends the file."""
        if self.on_disk:
            return
        self.place = FileRows.spill(self.directory, self.name, self.table, self.used, self.seq)
        self.map.uncommitted()  # no checkpoint refers to the file yet: a superseded row is free at once

    def attach(self, uid: str | None = None) -> None:
        """Map the file another process made (the table moves there; ``uid``: the file it must be)."""
        if not self.on_disk:
            if self.directory is None:
                raise ValueError(
                    "directory: a store shared by several processes keeps its file in a directory they "
                    "all see (a run directory)"
                )
            self.place = FileRows.open(self.directory, self.name, self.cols, self.dtype, uid)

    def follow(self, slots: np.ndarray) -> None:
        """Map the file as far as rows ``slots`` (grown by the process that allocated them)."""
        if len(slots):
            self.place.follow(int(slots.max()) + 1)

    # -- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain data for a checkpoint. In memory (or a temporary file): the written clients' ids and rows
        (storage dtype) and the initial row. A file in ``directory``: flushed, and referred to by name and id
        with each written client's row and stamp (the rows stay in the file; rows superseded before this call
        are reused from now on, so only the newest checkpoint is resumable)."""
        ids, slots = self.map.referenced()
        if not self.cow:
            rows = self.table.index_select(0, self._slots(slots)).cpu()
            return {
                "ids": torch.from_numpy(ids),
                "rows": rows,
                "init": self.table[0].cpu(),
                "num_clients": self.num_clients,
            }
        self.place.flush()
        out = {
            "file": self.name,
            "uuid": self.file.uuid,
            "ids": torch.from_numpy(ids),
            "slots": torch.from_numpy(slots.copy()),
            "stamps": torch.from_numpy(np.array(self.place.stamps[slots])),
            "used": self.used,
            "seq": self.seq,
            "num_clients": self.num_clients,
            "cols": self.cols,
            "dtype": str(self.dtype).replace("torch.", ""),
        }
        self.map.commit()
        return out

    def load_state_dict(self, state) -> None:
        """Back to :meth:`state_dict`'s state (or a dense ``[K, cols]`` tensor, as fedfast 0.1 checkpointed it:
        every client then has a row); ValueError naming what does not fit."""
        if torch.is_tensor(state):
            if tuple(state.shape) != self.shape:
                raise ValueError(f"state: client_state has shape {tuple(state.shape)}, expected {self.shape}")
            state = {
                "ids": torch.arange(self.num_clients),
                "rows": state,
                "init": self.table[0].cpu(),
                "num_clients": self.num_clients,
            }
        if "file" in state:
            return self._load_file(state)
        ids, rows = state["ids"], state["rows"]
        if (
            state.get("num_clients") != self.num_clients
            or rows.dim() != 2
            or rows.shape[1] != self.cols
            or tuple(ids.shape) != (rows.shape[0],)
        ):
            raise ValueError(
                f"state: client_state of {state.get('num_clients')} clients x {tuple(rows.shape[1:])} "
                f"values, expected {self.num_clients} x ({self.cols},)"
            )
        a = self._ids(ids)
        self._reset(state["init"])
        for s in range(0, len(a), 4096):  # through the store's own growth, in memory as it was checkpointed (a
            part = a[s : s + 4096]  # move to the file is the next scatter's: all processes of a group decide it)
            slots = self.allocate(part, spill=False)
            self.write(slots, rows[s : s + 4096].float())
            self.assign(part, slots)
        self.map.commit()  # in memory: nothing pending

    def _reset(self, init: Tensor) -> None:
        self.place.reset()
        self.table[0] = init.to(self.place.device, self.dtype)
        self.map.reset()

    def _load_file(self, state: dict) -> None:
        if (
            state.get("num_clients") != self.num_clients
            or state.get("cols") != self.cols
            or state.get("dtype") != str(self.dtype).replace("torch.", "")
        ):
            raise ValueError(
                f"state: client_state of {state.get('num_clients')} clients x {state.get('cols')} "
                f"{state.get('dtype')} values, expected {self.num_clients} x {self.cols} "
                f"{str(self.dtype).replace('torch.', '')}"
            )
        if self.directory is None:
            raise ValueError(
                f"state: the checkpoint's per-client state is in the file {state['file']}.rows of its "
                f"run directory: restore it with that directory as the store's directory "
                f"(Simulation(..., state_dir=...))"
            )
        self.name = state["file"]
        place = FileRows.open(self.directory, self.name, self.cols, self.dtype, state["uuid"])
        f = place.file
        ids, slots = self._ids(state["ids"]), state["slots"].numpy().astype(np.int64)
        used = int(state["used"])
        if len(slots) and (slots.min() < 1 or slots.max() >= used or used > f.capacity):
            raise ValueError(f"{f.paths[0]}: holds {f.capacity} rows, the checkpoint refers to rows up to {used - 1}")
        stale = np.flatnonzero(np.asarray(f.stamps[slots]) != state["stamps"].numpy())
        if len(stale):
            raise ValueError(
                f"{f.paths[0]}: the rows of {len(stale)} client(s) (e.g. client {int(ids[stale[0]])}) "
                f"were overwritten after this checkpoint was taken: only the run's newest checkpoint "
                f"can be resumed"
            )
        self.place = place
        self.map.restore(ids, slots, used, int(state["seq"]))
