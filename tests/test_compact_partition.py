"""fedfast.data.Partition stored compactly (issue 38, step 1): one index array and per-client offsets, per-client
views on demand, every check and the histogram vectorised, the engine's plan reading the compact form."""

import copy
import time

import numpy as np
import pytest
import torch
from sequential_loop import setup_data

import fedfast
from fedfast.data.partition import Partition
from fedfast.sim.plan import PlanSettings, RoundPlan


def test_a_list_and_its_csr_are_the_same_partition():
    lists = [np.array([4, 0, 2]), torch.tensor([1]), [5, 3]]
    a = Partition(lists, labels=torch.tensor([0, 1, 1, 2, 0, 2]))
    b = Partition.from_csr(np.array([4, 0, 2, 1, 5, 3]), [0, 3, 4, 6], labels=[0, 1, 1, 2, 0, 2])
    for p in (a, b):
        assert p.rows.tolist() == [4, 0, 2, 1, 5, 3] and p.offsets.tolist() == [0, 3, 4, 6]
        assert p.num_clients == 3 and p.sizes.tolist() == [3, 1, 2] and p.num_classes == 3
        assert [i.tolist() for i in p.indices] == [[4, 0, 2], [1], [5, 3]] and p.indices[-1].tolist() == [5, 3]
        assert [i.tolist() for i in p.indices[1:]] == [[1], [5, 3]] and len(p.indices) == 3
        v = p.indices[2]
        assert v.data_ptr() == p.rows.data_ptr() + 4 * 8  # a view of rows, not a copy
        assert p.owners().tolist() == [0, 0, 0, 1, 2, 2]
    assert torch.equal(a.histogram, b.histogram)
    assert Partition(a.indices).rows.tolist() == a.rows.tolist()  # a partition's own indices are accepted back
    assert Partition(np.arange(6).reshape(3, 2)).offsets.tolist() == [0, 2, 4, 6]  # one row per client


def test_histogram_and_summary_equal_a_loop_over_clients():
    train, _, part, _ = setup_data()
    p = Partition(part.indices, labels=train.y)
    want = torch.stack([torch.bincount(train.y[i], minlength=5) for i in part.indices])
    assert torch.equal(p.histogram, want)
    s = p.summary()
    assert s["num_samples"] == len(train) and s["size_min"] == int(want.sum(1).min())


@pytest.mark.parametrize(
    "rows,offsets,msg",
    [
        ([0, 1, 2], [0, 2, 2, 3], "indices: client 1 holds no samples"),
        ([0, -4, 2], [0, 2, 3], "indices: client 0: negative sample index -4"),
        (
            [0, 1, 2, 1],
            [0, 1, 3, 4],
            r"indices: sample 1 is held by clients 1 and 2 \(1 sample\(s\) held more than once\)",
        ),
        ([0, 1, 1], [0, 3], "indices: sample 1 is held by client 0 twice"),
        ([0, 1, 2], [0, 2], r"offsets: expected K \+ 1 >= 2 non-decreasing integers from 0 to len\(rows\) = 3"),
        ([0, 1, 2], [0, 2, 1, 3], "offsets: expected"),
        ([0.5, 1], [0, 2], "rows: expected a 1-d array of integer sample indices"),
    ],
)
def test_bad_compact_input_is_named(rows, offsets, msg):
    with pytest.raises(ValueError, match=msg):
        Partition.from_csr(np.array(rows), np.array(offsets))


def test_overlapping_and_labels_are_checked():
    assert Partition.from_csr([0, 1, 1], [0, 2, 3], overlapping=True).num_clients == 2
    with pytest.raises(ValueError, match="indices: sample index 3 beyond the 3 labels"):
        Partition.from_csr([0, 3], [0, 1, 2], labels=[0, 1, 1])


def test_a_million_clients_cost_their_samples_not_an_object_each():
    K = 1_000_000
    rows = np.random.default_rng(0).permutation(2 * K)
    t0 = time.perf_counter()
    p = Partition.from_csr(rows, np.arange(0, 2 * K + 1, 2), labels=np.arange(2 * K) % 10)
    hist = p.histogram
    took = time.perf_counter() - t0
    assert p.num_clients == K and p.indices[K - 1].tolist() == rows[-2:].tolist() and hist.shape == (K, 10)
    assert int(hist.sum()) == 2 * K
    assert took < 5.0, took  # 2-core VM: about 0.4 s (the duplicate check's sort and one bincount)


def test_the_round_plan_reads_the_compact_form():
    train, test, part, model = setup_data()
    csr = Partition.from_csr(part.rows, part.offsets)
    cfg = fedfast.SimConfig(clients_per_round=4, batch_size=16, lr=0.05, seed=1)
    plan = RoundPlan(PlanSettings.of(cfg), train, csr, cfg.method(), device=torch.device("cpu"))
    assert np.array_equal(plan.client_sizes, part.sizes.numpy())
    want = torch.stack([torch.bincount(train.y[i], minlength=5) for i in part.indices]).float()
    assert torch.equal(plan.label_hist, want)
    a = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    b = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, csr)
    a.round()
    b.round()
    assert torch.equal(a.global_flat, b.global_flat)


def test_cohort_rows_and_histograms_gather_the_cohorts_rows_only():
    train, test, part, model = setup_data()
    cfg = fedfast.SimConfig(clients_per_round=4, batch_size=16, lr=0.05, seed=1)
    plan = RoundPlan(PlanSettings.of(cfg), train, part, cfg.method(), device=torch.device("cpu"))
    clients = np.array([6, 1, 3])
    rows, owner = plan.cohort_rows(clients)
    assert rows.tolist() == np.concatenate([part.indices[k].numpy() for k in clients]).tolist()
    assert owner.tolist() == np.repeat([0, 1, 2], [len(part.indices[k]) for k in clients]).tolist()
    want = torch.stack([torch.bincount(train.y[part.indices[k]], minlength=5) for k in clients]).float()
    assert torch.equal(plan.histograms(clients), want)
    assert plan._label_hist is None  # [K, C] only when asked for


def test_every_clients_histogram_is_made_only_for_a_method_that_reads_it():
    train, test, part, model = setup_data()
    runs = {}
    for algorithm in ("fedavg", "feddisco"):
        cfg = fedfast.SimConfig(algorithm=algorithm, clients_per_round=3, batch_size=16, lr=0.05)
        sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
        sim.round()
        runs[algorithm] = sim.plan._label_hist
    assert runs["fedavg"] is None and runs["feddisco"].shape == (8, 5)


# -- the partitioners produce the compact form, with the draws of their per-client loops -------------------------
def _split_at_loop(class_idx, cuts, K):
    """The per-client loop the vectorised split replaced: piece k of each class, in class order, to client k."""
    parts = [[] for _ in range(K)]
    for idx, cut in zip(class_idx, cuts, strict=True):
        for k, piece in enumerate(np.split(idx, cut)):
            parts[k].extend(piece.tolist())
    return parts


@pytest.mark.parametrize("seed", range(4))
def test_the_dirichlet_split_equals_the_per_client_loop(seed):
    from fedfast.data.partition import _split_at

    rng = np.random.default_rng(seed)
    K, C = 7, 4
    class_idx = [rng.permutation(rng.integers(0, 10**6, rng.integers(0, 40))) for _ in range(C)]
    cuts = [np.sort(rng.integers(0, len(i) + 1, K - 1)) for i in class_idx]  # empty pieces and classes included
    rows, offsets = _split_at(class_idx, cuts, K)
    want = _split_at_loop(class_idx, cuts, K)
    assert [rows[offsets[k] : offsets[k + 1]].tolist() for k in range(K)] == want


def test_partitioners_build_the_compact_form_with_their_loops_draws():
    """Each partitioner against its per-client loop written out (the same RNG stream): equal partitions."""
    from fedfast.data import partition as P

    rng = np.random.default_rng(0)
    y, w = rng.integers(0, 10, 3000), rng.integers(0, 200, 3000)
    # quantity skew: Dir sizes, consecutive pieces of one permutation
    got = P.quantity_skew(y, 40, 0.5, seed=1, min_size=5)
    r = np.random.default_rng(1)
    p = r.dirichlet(0.5 * np.ones(40))
    sizes = 5 + np.floor(p * (3000 - 200)).astype(int)
    sizes[: 3000 - sizes.sum()] += 1
    want = np.split(r.permutation(3000), np.cumsum(sizes)[:-1])
    assert [i.tolist() for i in got.indices] == [a.tolist() for a in want]
    # writers into 13 groups: array_split of a permutation of the writers
    got = P.by_writer(w, 13, seed=3, labels=y)
    ids, inv = np.unique(w, return_inverse=True)
    groups = np.empty(len(ids), dtype=np.int64)
    for g, chunk in enumerate(np.array_split(np.random.default_rng(3).permutation(len(ids)), 13)):
        groups[chunk] = g
    assert [i.tolist() for i in got.indices] == [np.flatnonzero(groups[inv] == k).tolist() for k in range(13)]
    # LDA: each accepted draw's pieces, each client's samples shuffled in client order
    got = P.dirichlet_lda(y, 20, 0.5, seed=2, min_size=5)
    r = np.random.default_rng(2)
    by_class = [np.flatnonzero(y == c) for c in range(10)]
    while True:
        sizes, class_idx, cuts = np.zeros(20, dtype=np.int64), [], []
        for idx in by_class:
            idx = idx[r.permutation(len(idx))]
            class_idx.append(idx)
            cuts.append(P._class_cut(len(idx), sizes, 0.5, 3000 / 20, r))
        if sizes.min() >= 5:
            break
    want = [r.permutation(np.array(b, dtype=np.int64)) for b in _split_at_loop(class_idx, cuts, 20)]
    assert [i.tolist() for i in got.indices] == [a.tolist() for a in want]


def test_a_million_writers_partition_without_a_loop_over_clients():
    w = np.random.default_rng(0).integers(0, 10**6, 5 * 10**6)
    t = time.perf_counter()
    part = fedfast.data.by_writer(w)
    took = time.perf_counter() - t
    assert part.num_clients == len(np.unique(w)) and int(part.sizes.sum()) == 5 * 10**6
    assert took < 10, f"by_writer of 1M writers took {took:.1f} s"
    t = time.perf_counter()
    fedfast.data.quantity_skew(np.zeros(5 * 10**6, dtype=np.int64), 10**6, 1.0, min_size=2)
    assert time.perf_counter() - t < 10
