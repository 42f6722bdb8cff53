"""Non-IID partitioners, all deterministic by seed (numpy ``default_rng(seed)``).

* :func:`iid` - shuffle and split into equal parts.
* :func:`shards` - FedNTD's sharding (Lee et al., App. B.5 and code): sort by label, cut each class into
  ``s*K/C`` shards, shuffle the list of shard labels, client k takes one unused shard of each label in
  its row; all clients equal size, at most ``s`` classes.
* :func:`dirichlet_lda` - FedNTD's / NIID-Bench LDA (per class ``p ~ Dir(alpha 1_K)``, clients above
  N/K stop receiving, redraw until every client has >= ``min_size`` samples).
* :func:`dirichlet_balanced` - the FedDyn/ASD scheme (a): client prior ``pi_k ~ Dir(delta 1_C)``, every
  client the same size, quotas filled one sample at a time from not-yet-exhausted classes.
* :func:`dirichlet_fedgkd` - FedDF's ``build_non_iid_by_dirichlet`` used by FedGKD: groups of 10 clients
  over contiguous data chunks, redraw until min size >= 0.5 * chunk/10.
* :func:`quantity_skew` - IID labels, client sizes ~ Dir(alpha) (at least ``min_size`` each).

Each returns a :class:`Partition`: per-client index tensors, the [K, C] class histogram and sizes;
:func:`fedfast.plot.partition_heatmap` draws the class-by-client matrix.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor


@dataclass
class Partition:
    """Which training samples each client holds: ``indices`` (one index array per client: lists, numpy arrays
    or tensors). ``labels`` (the training set's labels) and ``num_classes`` are optional: the histogram and
    summary need the labels, the engine derives what it needs from the training set.

    A sample is held by one client, once: two clients holding the same sample (or one client holding it twice)
    is refused, naming the sample and the clients, unless ``overlapping=True`` says the clients share samples on
    purpose (a partition with replication, say).

    >>> Partition([np.arange(0, 600), np.arange(600, 1000)])       # e.g. another framework's client split
    """
    indices: list
    num_classes: int | None = None
    labels: Tensor | None = field(default=None, repr=False)
    method: str = ""
    overlapping: bool = False

    def __post_init__(self):
        if isinstance(self.indices, (Tensor, np.ndarray)) and getattr(self.indices, "ndim", 1) == 2:
            self.indices = list(self.indices)
        if not isinstance(self.indices, (list, tuple)) or not len(self.indices):
            raise ValueError("indices: expected a non-empty list of per-client index arrays")
        out = []
        for k, idx in enumerate(self.indices):
            a = idx.detach().cpu().numpy() if isinstance(idx, Tensor) else np.asarray(idx)
            if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
                raise ValueError(f"indices: client {k}: expected a 1-d array of integer sample indices, got "
                                 f"shape {a.shape} and dtype {a.dtype}")
            if a.size and a.min() < 0:
                raise ValueError(f"indices: client {k}: negative sample index {int(a.min())}")
            if a.size == 0:
                raise ValueError(f"indices: client {k} holds no samples")
            out.append(torch.from_numpy(a.astype(np.int64, copy=False)))
        self.indices = out
        if not self.overlapping:
            _check_disjoint(out)
        if self.labels is not None:
            y = self.labels.detach().cpu() if isinstance(self.labels, Tensor) else torch.as_tensor(np.asarray(self.labels))
            if y.dim() != 1:
                raise ValueError(f"labels: expected a 1-d array of class ids, got shape {tuple(y.shape)}")
            self.labels = y.long()
            top = max(int(i.max()) for i in out)
            if top >= len(y):
                raise ValueError(f"indices: sample index {top} beyond the {len(y)} labels")
            if self.num_classes is None:
                self.num_classes = int(y.max()) + 1
        if self.num_classes is not None and int(self.num_classes) < 1:
            raise ValueError(f"num_classes: must be >= 1, got {self.num_classes}")

    @property
    def num_clients(self) -> int:
        return len(self.indices)

    @property
    def sizes(self) -> Tensor:
        return torch.tensor([len(i) for i in self.indices])

    @property
    def histogram(self) -> Tensor:
        """[K, C] number of samples of each class held by each client."""
        if self.labels is None:
            raise ValueError("labels: this Partition was made without labels; pass labels=train.y for histograms")
        h = torch.zeros(self.num_clients, self.num_classes, dtype=torch.long)
        for k, idx in enumerate(self.indices):
            h[k] = torch.bincount(self.labels[idx], minlength=self.num_classes)
        return h

    def summary(self) -> dict:
        h = self.histogram
        sizes = h.sum(1)
        classes = (h > 0).sum(1).float()
        return {"method": self.method, "num_clients": self.num_clients, "num_samples": int(sizes.sum()),
                "size_min": int(sizes.min()), "size_max": int(sizes.max()), "size_mean": float(sizes.float().mean()),
                "classes_per_client_mean": float(classes.mean()), "classes_per_client_min": int(classes.min()),
                "classes_per_client_max": int(classes.max())}

def _check_disjoint(indices: list) -> None:
    """Each sample in one client's indices, once; ValueError naming the first sample held twice and by whom."""
    cat = torch.cat(indices).numpy()
    order = np.argsort(cat, kind="stable")
    srt = cat[order]
    dup = np.flatnonzero(srt[1:] == srt[:-1])
    if dup.size:
        owner = np.repeat(np.arange(len(indices)), [len(i) for i in indices])
        a, b = int(owner[order[dup[0]]]), int(owner[order[dup[0] + 1]])
        n = len(np.unique(srt[dup]))
        who = f"clients {a} and {b}" if a != b else f"client {a} twice"
        raise ValueError(f"indices: sample {int(srt[dup[0]])} is held by {who} ({n} sample(s) held more than once); "
                         f"a partition gives each sample to one client - pass overlapping=True if the clients share "
                         f"samples on purpose")


def _labels(labels) -> np.ndarray:
    y = labels.cpu().numpy() if isinstance(labels, Tensor) else np.asarray(labels)
    if y.ndim != 1 or y.size == 0:
        raise ValueError("labels: expected a non-empty 1-d array of class ids")
    return y.astype(np.int64)


def _check_K(K: int, n: int):
    if not 1 <= K <= n:
        raise ValueError(f"num_clients: must lie in [1, {n}] (number of samples), got {K}")


def _check_positive(name: str, v: float):
    if not v > 0:
        raise ValueError(f"{name}: must be > 0, got {v}")


def _make(parts, y, method) -> Partition:
    C = int(y.max()) + 1
    return Partition([torch.from_numpy(np.asarray(p, dtype=np.int64)) for p in parts], C, torch.from_numpy(y), method)


def iid(labels, num_clients: int, seed: int = 0) -> Partition:
    y = _labels(labels)
    _check_K(num_clients, len(y))
    perm = np.random.default_rng(seed).permutation(len(y))
    return _make(np.array_split(perm, num_clients), y, "iid")


def shards(labels, num_clients: int, shards_per_client: int = 2, seed: int = 0) -> Partition:
    """FedNTD's sharding (Lee et al. 2022, App. B.5)."""
    y = _labels(labels)
    K, s = num_clients, shards_per_client
    _check_K(K, len(y))
    C = int(y.max()) + 1
    if (s * K) % C:
        raise ValueError(f"shards_per_client: s*K = {s * K} must be a multiple of the number of classes {C}")
    rng = np.random.default_rng(seed)
    per_class = s * K // C
    class_shards = []
    for c in range(C):
        idx = np.flatnonzero(y == c)
        idx = idx[rng.permutation(len(idx))]
        size = len(idx) // per_class
        if size == 0:
            raise ValueError(f"shards_per_client: class {c} has {len(idx)} samples, fewer than its {per_class} shards")
        pieces = [list(idx[i * size:(i + 1) * size]) for i in range(per_class)]
        for j, extra in enumerate(idx[per_class * size:]):  # leftovers: one each to the first shards
            pieces[j].append(extra)
        class_shards.append(pieces)
    shard_labels = np.array(list(range(C)) * per_class)
    rng.shuffle(shard_labels)
    shard_labels = shard_labels.reshape(K, s)
    parts = []
    for k in range(K):
        got = []
        for c in shard_labels[k]:
            got.extend(class_shards[c].pop(rng.integers(len(class_shards[c]))))
        parts.append(rng.permutation(np.array(got, dtype=np.int64)))
    return _make(parts, y, f"shards(s={s})")


def _class_cut(n: int, sizes: np.ndarray, alpha: float, cap: float, rng) -> np.ndarray:
    """One class's Dirichlet draw (FedNTD LDA / FedDF): ``p ~ Dir(alpha 1_K)``, the clients already holding >= ``cap``
    samples zeroed, renormalised; returns where the class's ``n`` samples are cut (at cumsum(p)) and adds the pieces
    to the clients' ``sizes`` [K] in place."""
    p = rng.dirichlet(alpha * np.ones(len(sizes))) * (sizes < cap)
    p = p / p.sum()
    cut = (np.cumsum(p) * n).astype(int)[:-1]
    sizes += np.diff(cut, prepend=0, append=n)
    return cut


def _split_at(class_idx: list, cuts: list, K: int) -> list:
    """Each class's sample indices cut at its cut points, the k-th pieces joined as client k's samples."""
    parts = [[] for _ in range(K)]
    for idx, cut in zip(class_idx, cuts):
        for k, piece in enumerate(np.split(idx, cut)):
            parts[k].extend(piece.tolist())
    return parts


def dirichlet_lda(labels, num_clients: int, alpha: float, seed: int = 0, min_size: int = 10,
                  max_tries: int = 1000) -> Partition:
    """FedNTD's LDA / NIID-Bench per-class Dirichlet with the N/K size cap and the min-size redraw (each draw
    reshuffles every class; only the accepted draw is split into indices)."""
    y = _labels(labels)
    K, N = num_clients, len(y)
    _check_K(K, N)
    _check_positive("alpha", alpha)
    C = int(y.max()) + 1
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(y == c) for c in range(C)]
    for _ in range(max_tries):
        sizes, class_idx, cuts = np.zeros(K, dtype=np.int64), [], []
        for idx in by_class:
            idx = idx[rng.permutation(len(idx))]
            class_idx.append(idx)
            cuts.append(_class_cut(len(idx), sizes, alpha, N / K, rng))
        if sizes.min() >= min_size:
            parts = _split_at(class_idx, cuts, K)
            return _make([rng.permutation(np.array(b, dtype=np.int64)) for b in parts], y, f"lda(alpha={alpha})")
    raise ValueError(f"min_size: no LDA draw gave every one of {K} clients >= {min_size} samples in {max_tries} tries")


def dirichlet_balanced(labels, num_clients: int, delta: float, seed: int = 0) -> Partition:
    """FedDyn/ASD scheme (a): equal client sizes, client class mix ~ Dir(delta)."""
    y = _labels(labels)
    K, N = num_clients, len(y)
    _check_K(K, N)
    _check_positive("delta", delta)
    C = int(y.max()) + 1
    rng = np.random.default_rng(seed)
    priors = rng.dirichlet(delta * np.ones(C), size=K)
    cum = np.cumsum(priors, axis=1)
    quota = np.full(K, N // K)  # every client exactly N // K (FedDyn code); N mod K samples stay unassigned
    pools = [list(np.flatnonzero(y == c)[rng.permutation(int((y == c).sum()))]) for c in range(C)]
    left = np.array([len(p) for p in pools])
    parts = [[] for _ in range(K)]
    open_clients = list(range(K))
    while open_clients:
        j = rng.integers(len(open_clients))
        k = open_clients[j]
        # first class with U <= cumsum(pi_k), among classes not yet exhausted (renormalised rejection)
        while True:
            c = int(np.searchsorted(cum[k], rng.random() * cum[k][-1], side="left"))
            c = min(c, C - 1)
            if left[c] > 0:
                break
            if left.sum() == 0:
                raise ValueError("labels: ran out of samples while filling quotas")
            pk = priors[k] * (left > 0)
            if pk.sum() <= 0:  # the client's prior has no mass on remaining classes: fall back to them
                pk = (left > 0).astype(float)
            cum[k] = np.cumsum(pk)
        left[c] -= 1
        parts[k].append(pools[c][left[c]])
        quota[k] -= 1
        if quota[k] == 0:
            open_clients.pop(j)
    return _make([rng.permutation(np.array(b, dtype=np.int64)) for b in parts], y, f"balanced_dirichlet(delta={delta})")


def dirichlet_fedgkd(labels, num_clients: int, alpha: float, seed: int = 0, group: int = 10,
                     max_tries: int = 1_000_000) -> Partition:
    """FedDF's build_non_iid_by_dirichlet (FedGKD): groups of ``group`` clients over contiguous chunks; within a
    group, per-class ``Dir(alpha)`` draws (clients holding ``chunk/group`` samples get no more) are redrawn until
    every client holds at least half the group's mean size. The official code redraws without limit: few classes
    at a small alpha need many draws (AG News, 4 classes, 20 clients, alpha 0.1: tens of thousands), so a draw is
    first made on the class counts alone (~30 us) and only the accepted one is split into indices."""
    y = _labels(labels)
    K, N = num_clients, len(y)
    _check_K(K, N)
    _check_positive("alpha", alpha)
    rng = np.random.default_rng(seed)
    order = rng.permutation(N)
    n_groups = int(np.ceil(K / group))
    chunks = np.array_split(order, n_groups)
    C = int(y.max()) + 1
    parts = []
    for gi, chunk in enumerate(chunks):
        kg = min(group, K - gi * group)
        target = len(chunk) / kg
        by_class = [chunk[y[chunk] == c] for c in range(C)]  # chunk is shuffled
        for _ in range(max_tries):  # the draws on sizes only (~30 us each); the accepted one is split below
            sizes = np.zeros(kg, dtype=np.int64)
            cuts = [_class_cut(len(idx), sizes, alpha, target, rng) for idx in by_class]
            if sizes.min() >= 0.5 * target:
                break
        else:
            raise ValueError(f"alpha: no draw met FedGKD's size floor (every client >= half the mean size) in "
                             f"{max_tries} tries; use more samples per client or a larger alpha")
        batch = _split_at(by_class, cuts, kg)
        parts.extend(rng.permutation(np.array(b, dtype=np.int64)) for b in batch)
    return _make(parts, y, f"fedgkd_dirichlet(alpha={alpha})")


def quantity_skew(labels, num_clients: int, alpha: float, seed: int = 0, min_size: int = 10) -> Partition:
    """IID labels, client sizes proportional to Dir(alpha) (each at least ``min_size``)."""
    y = _labels(labels)
    K, N = num_clients, len(y)
    _check_K(K, N)
    _check_positive("alpha", alpha)
    if K * min_size > N:
        raise ValueError(f"min_size: {K} clients x {min_size} exceeds the {N} samples")
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(alpha * np.ones(K))
    sizes = min_size + np.floor(p * (N - K * min_size)).astype(int)
    sizes[: N - sizes.sum()] += 1
    perm = rng.permutation(N)
    return _make(np.split(perm, np.cumsum(sizes)[:-1]), y, f"quantity_skew(alpha={alpha})")


def by_writer(writers, num_clients: int | None = None, seed: int = 0, labels=None,
              num_classes: int | None = None) -> Partition:
    """The natural partition of a dataset with writers (FEMNIST): one client per writer, or, with ``num_clients``,
    the writers randomly assigned to ``num_clients`` groups of (almost) equal numbers of writers, each group one
    client (FedCAD: ~2000 writers into 10 clients). ``writers``: each sample's writer id (e.g. FEMNIST's
    ``train.groups``); ``labels`` / ``num_classes``: for the partition's histogram (classes default to max + 1)."""
    w = writers.cpu().numpy() if isinstance(writers, Tensor) else np.asarray(writers)
    if w.ndim != 1 or w.size == 0:
        raise ValueError("writers: expected one writer id per sample")
    ids, inv = np.unique(w, return_inverse=True)
    if num_clients is None:
        groups = np.arange(len(ids))
    else:
        if not 1 <= int(num_clients) <= len(ids):
            raise ValueError(f"num_clients: must be in 1..{len(ids)} (the number of writers), got {num_clients}")
        perm = np.random.default_rng(seed).permutation(len(ids))
        groups = np.empty(len(ids), dtype=np.int64)
        for g, chunk in enumerate(np.array_split(perm, int(num_clients))):
            groups[chunk] = g
    client = groups[inv]
    order = np.argsort(client, kind="stable")
    bounds = np.searchsorted(client[order], np.arange(int(client.max()) + 2))
    parts = [order[bounds[k]:bounds[k + 1]] for k in range(int(client.max()) + 1)]
    y = torch.from_numpy(_labels(labels)) if labels is not None else None
    C = num_classes if num_classes is not None else (int(y.max()) + 1 if y is not None else None)
    return Partition([torch.from_numpy(p.astype(np.int64)) for p in parts], C, y, "by_writer")


def per_class_sample(labels, per_class: int, seed: int = 0) -> torch.Tensor:
    """``per_class`` random indices of each class (all of a class if it has fewer), sorted by class, drawn once
    with ``seed``: FedCAD's server-held auxiliary set (32 per class; He et al., reading C5 in docs/methods.md)."""
    if int(per_class) < 1:
        raise ValueError(f"per_class: must be >= 1, got {per_class}")
    y = torch.as_tensor(_labels(labels))
    g = torch.Generator().manual_seed(int(seed))
    picks = [torch.nonzero(y == c).flatten() for c in range(int(y.max()) + 1)]
    return torch.cat([p[torch.randperm(len(p), generator=g)[:int(per_class)]] for p in picks])
