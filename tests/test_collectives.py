"""fedfast.collectives alone: one process's identities, and two gloo processes summing, taking maxima and
gathering client state rows of unequal counts (the padding dropped) (issue 37)."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from fedfast.collectives import Distributed, Local, collectives


def test_one_process_is_the_identity():
    c = collectives(None)
    assert isinstance(c, Local) and (c.rank, c.world) == (0, 1)
    t = torch.tensor([1.0, 2.0])
    c.sum_(t)
    c.max_(t)
    ids, rows = torch.tensor([3, 1]), torch.ones(2, 4)
    assert c.gather_rows(ids, rows) == (ids, rows) and t.tolist() == [1.0, 2.0]


def test_distributed_needs_an_initialised_group():
    with pytest.raises(ValueError, match="process_group: torch.distributed is not initialised"):
        collectives("default")


def _rank(rank, world, store, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    c = Distributed()
    s = torch.tensor([float(rank + 1), 10.0 * rank])
    c.sum_(s)
    m = torch.tensor([float(rank), 5.0 - rank])
    c.max_(m)
    ids = torch.tensor([10 + rank, 20 + rank, 30 + rank][: 1 + 2 * rank])  # rank 0: one row, rank 1: three
    rows = ids[:, None].float().expand(-1, 3).clone()
    g_ids, g_rows = c.gather_rows(ids, rows)
    torch.save(
        {"sum": s, "max": m, "ids": g_ids, "rows": g_rows, "rank": c.rank, "world": c.world},
        os.path.join(out, f"{rank}.pt"),
    )
    os._exit(0)  # saved: skip interpreter teardown, where gloo's threads occasionally abort (test_distributed.py)


def test_two_processes_sum_max_and_gather_rows(tmp_path):
    mp.get_context("spawn")
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        got = torch.load(tmp_path / f"{r}.pt")
        assert (got["rank"], got["world"]) == (r, 2)
        assert got["sum"].tolist() == [3.0, 10.0] and got["max"].tolist() == [1.0, 5.0]
        assert got["ids"].tolist() == [10, 11, 21, 31]  # rank order, padding (-1) dropped
        assert torch.equal(got["rows"], got["ids"][:, None].float().expand(-1, 3))
