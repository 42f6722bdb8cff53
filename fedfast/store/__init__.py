"""The per-client state store: rows of per-client state (FedDyn h_k, SCAFFOLD c_k, MOON's previous model, the
clients' BatchNorm statistics) for up to all K clients, held for the clients written only.

* :mod:`.state`: :class:`ClientState`, the store: gathers and scatters, copy-on-write and checkpoints, and the
  multi-process protocol (allocate / write / assign);
* :mod:`.rowmap`: :class:`~fedfast.store.rowmap.RowMap`, which row holds which client (free and pending rows,
  write stamps' counters);
* :mod:`.place`: where the rows live, one interface (:class:`~fedfast.store.place.RowPlace`) and one class per
  place: :mod:`.memory` (device or host memory), :mod:`.pinned` (pinned host memory, for GPU runs whose state
  outgrows the GPU), :mod:`.file` (a memory-mapped file, :mod:`fedfast.store.rowfile`, for state larger than memory);
* :mod:`.shared`: the round's rows into a store across the processes of a ``torch.distributed`` group.
"""

from .state import ClientState

__all__ = ["ClientState"]
