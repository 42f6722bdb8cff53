"""The papers' own client splits, draw for draw: ``split_stream = "authors"``.

fedfast's partitioners (:mod:`fedfast.data.partition`) implement each paper's *scheme* with numpy's
``default_rng(seed)``, seeded by the run. The authors' code draws from other streams: the legacy global
``np.random`` (a Mersenne Twister, ``np.random.RandomState``) and Python's ``random``, seeded once with a constant
before the split, and walks the classes and clients in its own order. So the same scheme gives other clients other
samples. The functions here repeat the authors' algorithms with those streams (a private ``RandomState`` /
``random.Random`` seeded as the global ones are, so nothing global is touched), and give every client the same
sample indices as the released code, in the same order:

* :func:`fedntd_shards`, :func:`fedntd_lda` - FedNTD (Lee et al., NeurIPS 2022; github.com/Lee-Gihun/FedNTD at
  be00ee5, ``train_tools/preprocessing/datasetter.py``: ``sharding_partition``, ``lda_partition``). ``main.py``
  seeds ``np.random`` and ``random`` with 19940817 right before ``data_distributer``, so every run seed of theirs
  trains on one split: the default ``seed`` here.
* :func:`fedgkd_dirichlet` - FedGKD's split (Yao et al.; github.com/CGCL-codes/FedGKD at 72e7bac,
  ``pcode/create_dataset.py`` and ``pcode/datasets/partition_data.py``): the first 90 % of the training set in
  order (the last 10 % is the validation split), FedDF's ``build_non_iid_by_dirichlet`` drawn from
  ``np.random.RandomState(1000 * manual_seed)`` (the master's seed, as main.py makes it under the README's
  ``--same_seed_process False``; :func:`default_seed`), and then the clients' lists concatenated and cut into
  equal windows of ``int(N_train / K)`` samples (``DataPartitioner.partition_indices``): client k trains on window
  k, not on the k-th Dirichlet list. On Tiny-ImageNet (``shuffled_val``) the set is first shuffled by the same stream
  before the validation split, in torchvision ``ImageFolder``'s order (fedfast's loader's). The text sets are refused:
  their validation split is set on a command line the released code does not include.
* :func:`feddyn_iid` - FedDyn's IID rule (``rule == 'iid'``; its CIFAR-100 "perfect IID" branch included).
* :func:`feddyn_dirichlet` - FedDyn's balanced Dirichlet (Acar et al., ICLR 2021; github.com/alpemreacar/FedDyn,
  ``utils_dataset.py``, ``rule == 'Dirichlet'``). ASD's split follows this algorithm, but ASD's released code (HEAD
  6cb4b68) reads every client's data from a pickle (``config.yml`` ``data_pkl``, ``utils_methods.py``) written by a
  script drawing from the unseeded global ``np.random`` (``src/tiny_imagenet.py``, ``dirichlet_partition``: FedDyn's
  loop without its data shuffle); the CIFAR pickles are not released, so ASD's exact split cannot be reproduced and
  its presets use FedDyn's code seeded with the run seed.

Written from reading the released code; the tests (tests/test_authors_splits.py) transcribe the authors' functions
with the global streams and compare every client's indices.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from .partition import Partition, _labels

FEDNTD_SPLIT_SEED = 19940817


def _from_lists(parts, y, scheme: str) -> Partition:
    """A Partition holding each client's index list in the given order."""
    rows = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.zeros(0, np.int64)
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    return Partition.from_csr(rows, offsets, int(y.max()) + 1, torch.from_numpy(y), scheme)


def _checked(labels, num_clients, alpha, seed):
    """(labels, K, N, the legacy numpy stream seeded as the code seeds the global one), the arguments checked."""
    y = _labels(labels)
    K = int(num_clients)
    if K < 1:
        raise ValueError(f"num_clients: must be >= 1, got {K}")
    if not alpha > 0:
        raise ValueError(f"alpha: must be > 0, got {alpha!r}")
    return y, K, len(y), np.random.RandomState(seed)


def _append_class(rs, batch: list, idx: np.ndarray, alpha: float, cap: float) -> list:
    """One class of the NIID-Bench / FedDF Dirichlet loop, as both codes write it: ``p ~ rs.dirichlet(alpha 1_k)``,
    zeroed for the clients already holding >= ``cap``, renormalised; the class's indices ``idx`` (in their order)
    cut at ``(cumsum(p) * len(idx)).astype(int)[:-1]`` and piece j appended to client j's list."""
    p = rs.dirichlet(np.repeat(alpha, len(batch)))
    p = np.array([pk * (len(b) < cap) for pk, b in zip(p, batch, strict=True)])
    p = p / p.sum()
    cut = (np.cumsum(p) * len(idx)).astype(int)[:-1]
    return [b + piece.tolist() for b, piece in zip(batch, np.split(idx, cut), strict=True)]


def fedntd_shards(labels, num_clients: int, shards_per_client: int = 2, seed: int = FEDNTD_SPLIT_SEED) -> Partition:
    """FedNTD's ``sharding_partition``: each class's indices in dataset order (classes in the order their first
    sample appears), cut into ``int(s*K/C)`` equal shards, the remainder's samples appended one to each of the first
    shards; the list ``[0..C-1] * shards_per_class`` shuffled by Python's ``random``; client k then takes, for each
    label of its row, the shard at ``np.random.choice(len(remaining), replace=False)`` of that label (popped).
    Client k's indices are its shards concatenated in that order."""
    y = _labels(labels)
    K, s = int(num_clients), int(shards_per_client)
    if K < 1 or s < 1:
        raise ValueError(f"num_clients, shards_per_client: must be >= 1, got {K}, {s}")
    rs, pr = np.random.RandomState(seed), random.Random(seed)
    order = list(dict.fromkeys(y.tolist()))  # labels in the order of their first sample (the code's dict keys)
    C = len(order)
    per_class = int(s * K / C)
    if per_class < 1 or per_class * C != s * K:
        raise ValueError(
            f"shards_per_client: s*K = {s * K} must be a multiple of the {C} classes (FedNTD's code "
            f"reshapes the shard labels into [K, s])"
        )
    shards = {}
    for c in order:
        x = np.flatnonzero(y == c)
        left = len(x) % per_class
        leftover = x[len(x) - left :] if left else x[:0]
        if len(x) < per_class:
            raise ValueError(f"shards_per_client: class {c} has {len(x)} samples, fewer than its {per_class} shards")
        body = list((x[: len(x) - left] if left else x).reshape(per_class, -1))
        for i, idx in enumerate(leftover):
            body[i] = np.concatenate([body[i], [idx]])
        shards[c] = body
    table = list(range(C)) * per_class
    pr.shuffle(table)
    table = np.array(table).reshape(K, -1)
    parts = []
    for k in range(K):
        got = []
        for c in table[k]:
            i = rs.choice(len(shards[int(c)]), replace=False)
            got.append(shards[int(c)].pop(i))
        parts.append(np.concatenate(got).astype(np.int64))
    return _from_lists(parts, y, f"shards(s={s}, authors: FedNTD, seed {seed})")


def fedntd_lda(
    labels, num_clients: int, alpha: float, seed: int = FEDNTD_SPLIT_SEED, min_size: int = 10, max_tries: int = 10000
) -> Partition:
    """FedNTD's ``lda_partition``: until every client holds >= 10 samples, for each class c = 0..C-1 in turn:
    ``np.random.shuffle`` its indices, ``p ~ np.random.dirichlet(alpha 1_K)``, zero p for clients holding >= N/K
    samples, renormalise, cut at ``(cumsum(p) * n_c).astype(int)[:-1]`` and append piece k to client k; then each
    client's list shuffled by ``np.random.shuffle`` in client order. (The code redraws without a limit;
    ``max_tries`` turns an impossible setting into a ValueError.)"""
    y, K, N, rs = _checked(labels, num_clients, alpha, seed)
    C = len(np.unique(y))
    for _ in range(max_tries):
        batch = [[] for _ in range(K)]
        smallest = 0
        for c in range(C):
            idx = np.where(y == c)[0]
            rs.shuffle(idx)
            batch = _append_class(rs, batch, idx, alpha, N / K)
            smallest = min(len(b) for b in batch)
        if smallest >= min_size:
            break
    else:
        raise ValueError(
            f"min_size: no LDA draw gave every one of {K} clients >= {min_size} samples in {max_tries} tries"
        )
    for b in batch:
        rs.shuffle(b)
    return _from_lists(batch, y, f"lda(alpha={alpha}, authors: FedNTD, seed {seed})")


def feddyn_dirichlet(
    labels, num_clients: int, alpha: float, seed: int, shuffle_data: bool = True, max_redraws: int = 10**7
) -> Partition:
    """FedDyn's balanced Dirichlet (``rule = 'Dirichlet'``, ``unbalanced_sgm = 0``): the training set permuted
    (``np.random.permutation``, FedDyn's "Shuffle Data"), class priors ``np.random.dirichlet([alpha] * C, size=K)``,
    every client ``int(N / K)`` samples; until all are full: a client ``np.random.randint(K)`` (a full one
    redrawn), a class ``argmax(np.random.uniform() <= cumsum(prior_k))`` (an exhausted one redrawn), and that
    class's last remaining sample (in the permuted order) fills the client's last free slot. Indices are into the
    dataset as given (the permutation undone); each client's in slot order. Near the end a client may need many
    redraws (its prior's mass on the classes left can be tiny: the code prints its progress for this reason);
    ``max_redraws`` per sample bounds what the code would not."""
    y, K, N, rs = _checked(labels, num_clients, alpha, seed)
    perm = rs.permutation(N) if shuffle_data else np.arange(N)
    ty = y[perm]
    C = int(y.max()) + 1
    per = int(N / K)
    left = np.full(K, per, dtype=np.int64)
    priors = rs.dirichlet(alpha=[alpha] * C, size=K)
    cum = np.cumsum(priors, axis=1)
    idx_list = [np.where(ty == c)[0] for c in range(C)]
    amount = [len(i) for i in idx_list]
    if per * K > N:
        raise ValueError(f"num_clients: {K} clients of {per} samples exceed the {N} samples")
    slots = [np.empty(per, dtype=np.int64) for _ in range(K)]
    remaining = int(left.sum())
    while remaining:
        k = rs.randint(K)
        if left[k] <= 0:
            continue
        left[k] -= 1
        remaining -= 1
        redraws = 0
        while True:
            c = int(np.argmax(rs.uniform() <= cum[k]))
            if amount[c] <= 0:
                redraws += 1
                if redraws > max_redraws:  # the code would loop on (for ever where the prior left no mass at all)
                    raise ValueError(
                        f"alpha: FedDyn's draw found no sample for client {k} in {max_redraws} draws: "
                        f"its class prior (alpha = {alpha:g}) puts (almost) no mass on the classes "
                        f"left; raise alpha"
                    )
                continue
            amount[c] -= 1
            slots[k][left[k]] = perm[idx_list[c][amount[c]]]
            break
    return _from_lists(slots, y, f"balanced_dirichlet(alpha={alpha}, authors: FedDyn, seed {seed})")


def feddyn_iid(labels, num_clients: int, seed: int, dataset: str | None = None) -> Partition:
    """FedDyn's IID split (``rule = 'iid'``, ``unbalanced_sgm = 0``): the training set permuted
    (``np.random.permutation``, its "Shuffle Data"), then client k takes the k-th run of ``int(N / K)`` samples of
    the permuted set. CIFAR-100 takes the code's "perfect IID" branch instead: the permuted set sorted by label
    (``np.argsort``, numpy's default quicksort: equal labels keep the order numpy's sort leaves them in, as in the
    code on the same numpy), and client i takes, of every class j, the samples ``500 j + m i .. 500 j + m (i + 1)``
    of the sorted set (``m = N / K / 100`` per class; the code asserts ``N / 100`` divisible by ``K``)."""
    y, K, N, rs = _checked(labels, num_clients, 1.0, seed)
    perm = rs.permutation(N)
    if dataset == "cifar100":
        C = int(y.max()) + 1
        if C != 100 or (N // 100) % K or np.bincount(y, minlength=100).tolist() != [N // 100] * 100:
            raise ValueError(
                f"num_clients: FedDyn's CIFAR-100 IID split needs 100 classes of N/100 samples with K "
                f"dividing N/100 (the code asserts it), got {C} classes, N = {N}, K = {K}"
            )
        order = perm[np.argsort(y[perm])]
        per_class, m = N // 100, (N // K) // 100
        parts = [
            np.concatenate([order[per_class * j + m * i : per_class * j + m * (i + 1)] for j in range(100)])
            for i in range(K)
        ]
    else:
        per = int(N / K)
        parts = [perm[k * per : (k + 1) * per] for k in range(K)]
    return _from_lists(parts, y, f"iid(authors: FedDyn, seed {seed})")


def fedgkd_dirichlet(
    labels,
    num_clients: int,
    alpha: float,
    seed: int,
    val_fraction: float = 0.1,
    group: int = 10,
    max_tries: int = 100000,
    shuffled_val: bool = False,
) -> Partition:
    """FedGKD's released split (CIFAR-10/100): ``n_train = int((1 - val_fraction) * N)`` leading samples ("origin"
    order); their ``(index, label)`` rows shuffled by ``RandomState(seed).shuffle``; cut into ``ceil(K / group)``
    chunks of ``int(group / K * n_train)`` rows (the last to the end); in each chunk, until every one of its
    ``min(group, K left)`` clients holds at least ``int(0.5 * chunk / clients)``: per class c = 0..C-1, ``p ~
    dirichlet(alpha)``, zeroed for clients holding >= chunk / clients, renormalised, the class's rows (in shuffled
    order) cut at ``(cumsum(p) * n_c).astype(int)[:-1]``. The lists of all chunks are concatenated and client k
    takes the k-th window of ``int(n_train / K)`` samples. The validation tail belongs to no client (FedGKD-VOTE's
    held-out split is the same tail).

    ``shuffled_val`` (Tiny-ImageNet: ``define_val_dataset``'s ``partition_type = "random"`` for a dataset named
    "tiny"): first ``RandomState(seed).shuffle`` of ``arange(N)``, whose first ``n_train`` entries are the training
    set and the next ``int(val_fraction * N)`` the validation set; the same stream then draws the split above over
    the training set's ``(index, label)`` rows in index order (the code enumerates the dataset's targets and keeps
    the training set's). The partition's ``sample_order`` is that shuffled order: a run reorders the training set
    by it, so that the validation set is its tail (FedGKD-VOTE's held-out split, as in the code)."""
    y, K, N, rs = _checked(labels, num_clients, alpha, seed)
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction: in [0, 1), got {val_fraction!r}")
    if K < group:
        raise ValueError(f"num_clients: FedGKD's code needs at least {group} clients (its n_auxi_workers), got {K}")
    n_train = int((1 - val_fraction) * 1.0 * N)
    C = len(np.unique(y))
    perm = None
    if shuffled_val:
        perm = np.arange(N)
        rs.shuffle(perm)
        kept = np.sort(perm[:n_train])
    else:
        kept = np.arange(n_train)
    pairs = np.stack([kept, y[kept]], axis=1).astype(np.int64)
    rs.shuffle(pairs)
    n_splits = int(np.ceil(K / group))
    chunks, start = [], 0
    for i in range(n_splits):
        stop = start + int(group / K * n_train)
        chunks.append(pairs[start : (n_train if i == n_splits - 1 else stop)])
        start = stop
    lists, left = [], K
    for chunk in chunks:
        size, k = len(chunk), min(group, left)
        left -= group
        smallest, tries = 0, 0
        while smallest < int(0.50 * size / k):
            tries += 1
            if tries > max_tries:
                raise ValueError(
                    f"alpha: FedGKD's draw found no split of a {size}-sample chunk over {k} clients with "
                    f"each >= half the mean in {max_tries} tries; raise alpha"
                )
            batch = [[] for _ in range(k)]
            for c in range(C):
                batch = _append_class(rs, batch, chunk[np.where(chunk[:, 1] == c)[0], 0], alpha, size / k)
                smallest = min(len(b) for b in batch)
        lists += batch
    flat = np.array([i for b in lists for i in b], dtype=np.int64)
    w = int(1.0 / K * n_train)
    part = _from_lists(
        [flat[k * w : (k + 1) * w] for k in range(K)],
        y,
        f"fedgkd_dirichlet(alpha={alpha}, authors: FedGKD, seed {seed})",
    )
    if perm is not None:
        part.sample_order = perm
    return part


# the partitions with an authors' version -> the seed their code fixes, or None where it seeds with the run seed
AUTHORS = {
    "shards": FEDNTD_SPLIT_SEED,
    "dirichlet": FEDNTD_SPLIT_SEED,  # FedNTD's main.py
    "dirichlet_balanced": None,
    "iid": None,  # FedDyn's (ASD's presets)
    "dirichlet_fedgkd": None,
}  # FedGKD's
# FedGKD's main.py (init_config), run as its README runs it (--same_seed_process False): each process seeds
# conf.random_state = RandomState(1000 * manual_seed + rank), and the split is drawn on rank 0, the master
# (DataPartitioner broadcasts rank 0's indices): --manual_seed 7 splits with RandomState(7000)
FEDGKD_SEED_SCALE = 1000
# FedGKD's splits as transcribed: CIFAR ("origin" order) and Tiny-ImageNet (shuffled before the validation split;
# torchvision's ImageFolder order, which fedfast's loader keeps). The text sets (AG News, SST-5) take their validation
# split from a command line the released code does not include: refused.
FEDGKD_DATASETS = ("cifar10", "cifar100", "tiny_imagenet")


def default_seed(partition: str, run_seed: int, dataset: str | None = None) -> int:
    """The split seed of the authors' code for ``partition`` with the run seed as their ``--manual_seed`` (refused by
    name where fedfast has no authors' version for it, or for ``dataset``): FedNTD's fixed 19940817; FedDyn's the run
    seed; FedGKD's ``1000 * run_seed``, the RandomState its master draws the split from (main.py's init_config
    under the README's ``--same_seed_process False``: run seed 7 is their ``--manual_seed 7``, RandomState(7000))."""
    if partition == "dirichlet_fedgkd" and dataset is not None and dataset not in FEDGKD_DATASETS:
        raise ValueError(
            f"split_stream: FedGKD's code splits {', '.join(FEDGKD_DATASETS)} as transcribed here; for "
            f"dataset {dataset!r} its validation split (val_data_ratio, val_dataset) is set on a command "
            f"line the released code does not include (its README runs CIFAR-10 only); use "
            f'split_stream = "fedfast"'
        )
    if partition not in AUTHORS:
        raise ValueError(
            f"split_stream: 'authors' reproduces the papers' own splits of {', '.join(AUTHORS)}; "
            f"partition {partition!r} has none here; "
            f'use split_stream = "fedfast"'
        )
    fixed = AUTHORS[partition]
    if partition == "dirichlet_fedgkd":
        return FEDGKD_SEED_SCALE * int(run_seed)  # the master's (rank 0's) seed, as main.py makes it
    return int(run_seed) if fixed is None else fixed


def split(partition: str, labels, spec: dict) -> Partition:
    """The authors' version of a built-in partition, with ``spec``'s keys (``num_clients``, ``shards_per_client``,
    ``alpha``, ``dataset``, ``seed``: the split's seed)."""
    default_seed(partition, spec["seed"], spec.get("dataset"))  # refuses what has no authors' version
    seed = int(spec["seed"])
    if partition == "shards":
        return fedntd_shards(labels, spec["num_clients"], spec["shards_per_client"], seed=seed)
    if partition == "dirichlet":
        return fedntd_lda(labels, spec["num_clients"], spec["alpha"], seed=seed)
    if partition == "dirichlet_fedgkd":
        return fedgkd_dirichlet(
            labels, spec["num_clients"], spec["alpha"], seed=seed, shuffled_val=spec.get("dataset") == "tiny_imagenet"
        )
    if partition == "iid":
        return feddyn_iid(labels, spec["num_clients"], seed=seed, dataset=spec.get("dataset"))
    return feddyn_dirichlet(labels, spec["num_clients"], spec["alpha"], seed=seed)
