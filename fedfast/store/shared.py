"""The round's per-client state rows into a store (:class:`fedfast.store.state.ClientState`), once per round, in
one process or across the processes of a ``torch.distributed`` group: the store's multi-process protocol.

One process: a scatter. Several, with the table in memory: every process gathers every process's rows and keeps
its own copy of the table (as a dense all_gather would). Several, with the table in a file (``state_store =
"disk"``, or ``"auto"`` past its limit): the processes share one file in the run directory instead of a copy
each. Rank 0 allocates the rows (the free list and the checkpoints are its own) and broadcasts them; each process
writes its own clients' rows; a barrier; then every process maps the clients to the rows. Whether ``"auto"`` moves
the table to the file is rank 0's decision, made for all.

``comm``: the group (:class:`fedfast.collectives.Local` or :class:`~fedfast.collectives.Distributed`: ``rank``,
``world``, ``gather_ids``, ``gather_rows``, ``any_``, ``broadcast_`` and ``barrier``)."""

from __future__ import annotations

import torch

from .state import ClientState


def store_rows(comm, st: ClientState, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Write this process's clients' rows ``rows`` [m, cols] for client ids ``ids`` (device tensors) into ``st``
    (one process: every collective below is the identity, and this is ``st.scatter_``)."""
    all_ids, start = comm.gather_ids(ids)
    host_ids = all_ids.cpu().numpy()
    if not st.on_disk:
        # in memory: every process keeps the whole table
        if not comm.any_(comm.rank == 0 and st.spills(host_ids), ids.device):
            all_ids, all_rows = comm.gather_rows(ids, rows)
            st.scatter_(all_ids, all_rows, spill=False)
            return
        if st.directory is None and comm.world > 1:
            raise ValueError(
                "state_dir: several processes share the per-client state's file (state_store = "
                f"{st.store!r}) in a directory they all see; pass Simulation(..., state_dir=...)"
            )
        if comm.rank == 0:
            st.spill()
        comm.barrier()
        if comm.rank != 0:
            st.attach()
    slots = (
        torch.from_numpy(st.allocate(host_ids, spill=False))
        if comm.rank == 0
        else torch.empty(len(host_ids), dtype=torch.int64)
    )
    slots = slots.to(ids.device)
    comm.broadcast_(slots, 0)
    slots = slots.cpu().numpy()
    if comm.rank != 0:
        st.follow(slots)
    st.write(slots[start : start + len(ids)], rows)
    comm.barrier()
    st.assign(host_ids, slots, track=comm.rank == 0)
