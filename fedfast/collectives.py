"""How the processes of a run talk: :class:`Local` (one process: every collective is the identity, a null object)
or :class:`Distributed` (``torch.distributed``: each rank trains its share of the round's clients; sums are
all-reduced and updated client state rows all-gathered, so every rank holds the same global model and state).
The engine calls these and never asks how many processes there are to decide whether to communicate."""

from __future__ import annotations

import torch
import torch.distributed as dist


class Local:
    """One process."""

    rank, world = 0, 1

    def sum_(self, *tensors: torch.Tensor) -> None:
        """Sum each tensor over the processes, in place (here: nothing to add)."""

    def max_(self, t: torch.Tensor) -> None:
        """Element-wise maximum over the processes, in place."""

    def gather_rows(self, ids: torch.Tensor, rows: torch.Tensor):
        """Every process's (client id, state row) pairs."""
        return ids, rows

    def gather_ids(self, ids: torch.Tensor):
        """Every process's ids in rank order, and where this process's begin."""
        return ids, 0

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> None:
        """``t`` of process ``src`` into every process's ``t``."""

    def barrier(self) -> None:
        """Wait for every process."""

    def any_(self, flag: bool, device=None) -> bool:
        """Whether ``flag`` holds in any process."""
        return bool(flag)


class Distributed:
    """A ``torch.distributed`` process group (``None``: the default group)."""

    def __init__(self, group=None):
        if not dist.is_initialized():
            raise ValueError("process_group: torch.distributed is not initialised")
        self.dist, self.group = dist, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def sum_(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.dist.all_reduce(t, group=self.group)

    def max_(self, t: torch.Tensor) -> None:
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)

    def gather_rows(self, ids: torch.Tensor, rows: torch.Tensor):
        """All ranks' (client id, state row) pairs (blocks padded to equal length for all_gather)."""
        dev = rows.device
        m = torch.tensor([len(ids)], device=dev)
        self.max_(m)
        m_max = int(m)
        pad_ids = torch.full((m_max,), -1, dtype=torch.long, device=dev)
        pad_ids[: len(ids)] = ids
        pad_rows = torch.zeros(m_max, rows.shape[1], device=dev)
        pad_rows[: len(ids)] = rows
        all_ids = [torch.empty_like(pad_ids) for _ in range(self.world)]
        all_rows = [torch.empty_like(pad_rows) for _ in range(self.world)]
        self.dist.all_gather(all_ids, pad_ids, group=self.group)
        self.dist.all_gather(all_rows, pad_rows, group=self.group)
        ids, rows = torch.cat(all_ids), torch.cat(all_rows)
        keep = ids >= 0
        return ids[keep], rows[keep]

    def gather_ids(self, ids: torch.Tensor):
        """All ranks' ids (rank order, on the host) and the offset of this rank's."""
        n = torch.tensor([len(ids)], device=ids.device)
        counts = [torch.zeros_like(n) for _ in range(self.world)]
        self.dist.all_gather(counts, n, group=self.group)
        counts = [int(c) for c in counts]
        pad = torch.full((max(counts),), -1, dtype=torch.long, device=ids.device)
        pad[: len(ids)] = ids
        got = [torch.empty_like(pad) for _ in range(self.world)]
        self.dist.all_gather(got, pad, group=self.group)
        return torch.cat([g[:c] for g, c in zip(got, counts, strict=True)]), sum(counts[: self.rank])

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> None:
        self.dist.broadcast(t, src, group=self.group)

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)

    def any_(self, flag: bool, device=None) -> bool:
        t = torch.tensor([int(bool(flag))], device=device)
        self.max_(t)
        return bool(t.item())


def collectives(process_group):
    """:class:`Local` for ``None``, else :class:`Distributed` over the group (``"default"``: the default group)."""
    if process_group is None:
        return Local()
    return Distributed(None if process_group == "default" else process_group)
