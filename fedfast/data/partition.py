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
  over contiguous data chunks, redraw until min size >= 0.5 * chunk/10 (the scheme's clients; FedGKD's released
  code then trains each client on an equal window of the concatenated lists:
  :func:`fedfast.data.authors.fedgkd_dirichlet`).
* :func:`quantity_skew` - IID labels, client sizes ~ Dir(alpha) (at least ``min_size`` each).

Each returns a :class:`Partition` (compact: one index array and per-client offsets; ``indices[k]`` a view), the
[K, C] class histogram and sizes;
:func:`fedfast.plot.partition_heatmap` draws the class-by-client matrix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


class ClientIndices(Sequence):
    """The per-client index arrays of a compact partition, made on demand: ``[k]`` is client k's indices, a view
    of ``rows[offsets[k]:offsets[k+1]]`` (no copy; a tensor or a numpy array as ``rows`` is)."""

    __slots__ = ("rows", "offsets")

    def __init__(self, rows, offsets):
        self.rows, self.offsets = rows, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        n = len(self)
        k = int(k)
        if not -n <= k < n:
            raise IndexError(f"client {k} of {n}")
        k %= n
        return self.rows[int(self.offsets[k]) : int(self.offsets[k + 1])]

    def __iter__(self):
        for k in range(len(self)):
            yield self[k]


class Partition:
    """Which training samples each client holds, stored compactly (CSR): ``rows`` (every client's sample indices,
    client after client, int64 [N]) and ``offsets`` (int64 [K + 1]: client k holds ``rows[offsets[k]:offsets[k+1]]``),
    so memory and set-up grow with the samples, not with a Python object per client. ``indices[k]`` gives client
    k's indices as a view. Made from a per-client list (lists, numpy arrays or tensors; or a 2-d array, one row per
    client) or with :meth:`from_csr`. ``labels`` (the training set's labels) and ``num_classes`` are optional: the
    histogram and summary need the labels, the engine derives what it needs from the training set.

    A sample is held by one client, once: two clients holding the same sample (or one client holding it twice)
    is refused, naming the sample and the clients, unless ``overlapping=True`` says the clients share samples on
    purpose (a partition with replication, say). Every check is vectorised (no loop over clients).

    >>> Partition([np.arange(0, 600), np.arange(600, 1000)])       # e.g. another framework's client split
    >>> Partition.from_csr(np.arange(1000), [0, 600, 1000])        # the same, compact
    """

    def __init__(
        self, indices, num_classes: int | None = None, labels=None, method: str = "", overlapping: bool = False
    ):
        if isinstance(indices, (Tensor, np.ndarray)) and getattr(indices, "ndim", 1) == 2:
            a = indices.detach().cpu().numpy() if isinstance(indices, Tensor) else np.asarray(indices)
            indices = list(a)
        if isinstance(indices, ClientIndices):
            rows, offsets = indices.rows, indices.offsets
        else:
            if not isinstance(indices, (list, tuple)) or not len(indices):
                raise ValueError("indices: expected a non-empty list of per-client index arrays")
            parts = []
            for k, idx in enumerate(indices):
                a = idx.detach().cpu().numpy() if isinstance(idx, Tensor) else np.asarray(idx)
                if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
                    raise ValueError(
                        f"indices: client {k}: expected a 1-d array of integer sample indices, got "
                        f"shape {a.shape} and dtype {a.dtype}"
                    )
                parts.append(a.astype(np.int64, copy=False))
            rows, offsets = _csr(parts)
        self._set(rows, offsets, num_classes, labels, method, overlapping, "indices")

    @classmethod
    def from_csr(
        cls, rows, offsets, num_classes: int | None = None, labels=None, method: str = "", overlapping: bool = False
    ) -> "Partition":
        """A partition from its compact form: ``rows`` (int [N]: every client's sample indices, client after
        client) and ``offsets`` (int [K + 1], 0 first and N last, non-decreasing). O(N) to check and store."""
        part = cls.__new__(cls)
        part._set(rows, offsets, num_classes, labels, method, overlapping, "rows")
        return part

    def _set(self, rows, offsets, num_classes, labels, method, overlapping, key: str) -> None:
        r = rows.detach().cpu().numpy() if isinstance(rows, Tensor) else np.asarray(rows)
        o = offsets.detach().cpu().numpy() if isinstance(offsets, Tensor) else np.asarray(offsets)
        if r.ndim != 1 or (r.size and not np.issubdtype(r.dtype, np.integer)):
            raise ValueError(
                f"{key}: expected a 1-d array of integer sample indices, got shape {r.shape} and dtype {r.dtype}"
            )
        if (
            o.ndim != 1
            or len(o) < 2
            or not np.issubdtype(o.dtype, np.integer)
            or o[0] != 0
            or o[-1] != len(r)
            or (np.diff(o) < 0).any()
        ):
            raise ValueError(f"offsets: expected K + 1 >= 2 non-decreasing integers from 0 to len(rows) = {len(r)}")
        r, o = r.astype(np.int64, copy=False), o.astype(np.int64, copy=False)
        sizes = np.diff(o)
        if (sizes == 0).any():
            raise ValueError(f"indices: client {int(np.flatnonzero(sizes == 0)[0])} holds no samples")
        if r.min() < 0:
            at = int(np.argmin(r))
            raise ValueError(f"indices: client {_owner(o, at)}: negative sample index {int(r[at])}")
        self.rows, self.offsets = torch.from_numpy(r), torch.from_numpy(o)
        if not overlapping:
            _check_disjoint(r, o)
        self.method, self.overlapping, self.num_classes, self.labels = method, overlapping, num_classes, None
        if labels is not None:
            y = labels.detach().cpu() if isinstance(labels, Tensor) else torch.as_tensor(np.asarray(labels))
            if y.dim() != 1:
                raise ValueError(f"labels: expected a 1-d array of class ids, got shape {tuple(y.shape)}")
            self.labels = class_ids(y)
            top = int(r.max())
            if top >= len(y):
                raise ValueError(f"indices: sample index {top} beyond the {len(y)} labels")
            if self.num_classes is None:
                self.num_classes = int(y.max()) + 1
        if self.num_classes is not None and int(self.num_classes) < 1:
            raise ValueError(f"num_classes: must be >= 1, got {self.num_classes}")

    def __repr__(self) -> str:
        return (
            f"Partition(num_clients={self.num_clients}, num_samples={len(self.rows)}, "
            f"num_classes={self.num_classes}, method={self.method!r})"
        )

    @property
    def indices(self) -> ClientIndices:
        """Client k's sample indices as ``indices[k]`` (int64 tensor views of :attr:`rows`)."""
        return ClientIndices(self.rows, self.offsets)

    @property
    def num_clients(self) -> int:
        return len(self.offsets) - 1

    @property
    def sizes(self) -> Tensor:
        """[K] samples per client."""
        return self.offsets[1:] - self.offsets[:-1]

    def owners(self) -> Tensor:
        """[N] the client of each entry of :attr:`rows`."""
        return torch.repeat_interleave(torch.arange(self.num_clients), self.sizes)

    @property
    def histogram(self) -> Tensor:
        """[K, C] number of samples of each class held by each client (one bincount over all rows)."""
        if self.labels is None:
            raise ValueError("labels: this Partition was made without labels; pass labels=train.y for histograms")
        K, C = self.num_clients, self.num_classes
        return torch.bincount(self.owners() * C + self.labels[self.rows], minlength=K * C).reshape(K, C)

    def summary(self) -> dict:
        h = self.histogram
        sizes = h.sum(1)
        classes = (h > 0).sum(1).float()
        return {
            "method": self.method,
            "num_clients": self.num_clients,
            "num_samples": int(sizes.sum()),
            "size_min": int(sizes.min()),
            "size_max": int(sizes.max()),
            "size_mean": float(sizes.float().mean()),
            "classes_per_client_mean": float(classes.mean()),
            "classes_per_client_min": int(classes.min()),
            "classes_per_client_max": int(classes.max()),
        }


def _owner(offsets: np.ndarray, pos) -> int:
    """The client whose slice of ``rows`` holds position ``pos``."""
    return int(np.searchsorted(offsets, pos, side="right")) - 1


def _check_disjoint(rows: np.ndarray, offsets: np.ndarray) -> None:
    """Each sample in one client's indices, once; ValueError naming the first sample held twice and by whom. One
    bincount when the indices are dense enough (O(N)); the sort that names the culprits only when one is found."""
    if len(rows) and int(rows.max()) < 4 * len(rows) + 1024 and int(np.bincount(rows, minlength=0).max(initial=0)) <= 1:
        return
    order = np.argsort(rows, kind="stable")
    srt = rows[order]
    dup = np.flatnonzero(srt[1:] == srt[:-1])
    if dup.size:
        a, b = _owner(offsets, order[dup[0]]), _owner(offsets, order[dup[0] + 1])
        n = len(np.unique(srt[dup]))
        who = f"clients {a} and {b}" if a != b else f"client {a} twice"
        raise ValueError(
            f"indices: sample {int(srt[dup[0]])} is held by {who} ({n} sample(s) held more than once); "
            f"a partition gives each sample to one client - pass overlapping=True if the clients share "
            f"samples on purpose"
        )


def class_ids(y, key: str = "labels") -> Tensor:
    """``y`` as int64 class ids: integers, bools, or floats that hold whole numbers (a CSV read as floats); a
    fractional or non-finite float label is a ValueError naming ``key``, the first such sample and its value
    (``.long()`` would truncate 0.5 and 1.5 to the classes 0 and 1 without a word)."""
    t = y if isinstance(y, Tensor) else torch.as_tensor(np.asarray(y))
    if t.is_floating_point() or t.is_complex():
        bad = ~torch.isfinite(t) | (t != t.round()) if t.is_floating_point() else t.imag != 0
        if bool(bad.any()):
            i = int(bad.reshape(-1).nonzero()[0, 0])
            raise ValueError(
                f"{key}: class ids must be whole numbers, but sample {i} has the label "
                f"{t.reshape(-1)[i].item()!r} ({int(bad.sum())} such label(s)); labels are class "
                f"indices 0..C-1, not regression targets or soft labels"
            )
        t = t.real if t.is_complex() else t
    return t.long()


def _labels(labels) -> np.ndarray:
    y = labels.cpu().numpy() if isinstance(labels, Tensor) else np.asarray(labels)
    if y.ndim != 1 or y.size == 0:
        raise ValueError("labels: expected a non-empty 1-d array of class ids")
    return class_ids(y).numpy() if np.issubdtype(y.dtype, np.floating) else y.astype(np.int64)


def _check_K(K: int, n: int):
    if not 1 <= K <= n:
        raise ValueError(f"num_clients: must lie in [1, {n}] (number of samples), got {K}")


def _check_positive(name: str, v: float):
    if not v > 0:
        raise ValueError(f"{name}: must be > 0, got {v}")


def _csr(parts) -> tuple[np.ndarray, np.ndarray]:
    """Per-client index arrays (a partitioner's draws, made one client at a time) joined into ``rows`` and
    ``offsets``."""
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts)), out=offsets[1:])
    return np.concatenate(parts).astype(np.int64, copy=False), offsets


def _make(rows: np.ndarray, offsets: np.ndarray, y: np.ndarray, method: str) -> Partition:
    return Partition.from_csr(rows, offsets, int(y.max()) + 1, torch.from_numpy(y), method)


def _permute_each(rows: np.ndarray, offsets: np.ndarray, rng) -> np.ndarray:
    """Each client's slice of ``rows`` in a random order (``rng.permutation`` per client, in client order: the
    draws of a per-client loop)."""
    out = np.empty_like(rows)
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        out[a:b] = rng.permutation(rows[a:b])
    return out


def iid(labels, num_clients: int, seed: int = 0) -> Partition:
    y = _labels(labels)
    _check_K(num_clients, len(y))
    perm = np.random.default_rng(seed).permutation(len(y))
    n, K = len(y), num_clients  # np.array_split's sizes: the first n % K clients one more; contiguous in perm
    sizes = np.full(K, n // K, dtype=np.int64)
    sizes[: n % K] += 1
    return Partition.from_csr(
        perm, np.concatenate([[0], np.cumsum(sizes)]), int(y.max()) + 1, torch.from_numpy(y), "iid"
    )


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
        extra = idx[per_class * size :]  # leftovers: one each to the first shards
        class_shards.append([np.append(idx[i * size : (i + 1) * size], extra[i : i + 1]) for i in range(per_class)])
    shard_labels = np.array(list(range(C)) * per_class)
    rng.shuffle(shard_labels)
    shard_labels = shard_labels.reshape(K, s)
    parts = []
    for k in range(K):  # each client's s shards drawn in turn, then shuffled (FedNTD's code: one RNG stream)
        got = np.concatenate([class_shards[c].pop(rng.integers(len(class_shards[c]))) for c in shard_labels[k]])
        parts.append(rng.permutation(got))
    return _make(*_csr(parts), y, f"shards(s={s})")


def _class_cut(n: int, sizes: np.ndarray, alpha: float, cap: float, rng) -> np.ndarray:
    """One class's Dirichlet draw (FedNTD LDA / FedDF): ``p ~ Dir(alpha 1_K)``, the clients already holding >= ``cap``
    samples zeroed, renormalised; returns where the class's ``n`` samples are cut (at cumsum(p)) and adds the pieces
    to the clients' ``sizes`` [K] in place."""
    p = rng.dirichlet(alpha * np.ones(len(sizes))) * (sizes < cap)
    p = p / p.sum()
    cut = (np.cumsum(p) * n).astype(int)[:-1]
    sizes += np.diff(cut, prepend=0, append=n)
    return cut


def _split_at(class_idx: list, cuts: list, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Each class's sample indices cut at its cut points, the k-th pieces joined (in class order) as client k's
    samples: ``(rows, offsets)``, by one stable sort on the client of each sample (no loop over clients)."""
    owner = np.concatenate(
        [
            np.repeat(np.arange(K), np.diff(cut, prepend=0, append=len(idx)))
            for idx, cut in zip(class_idx, cuts, strict=True)
        ]
    )
    order = np.argsort(owner, kind="stable")
    offsets = np.zeros(K + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner, minlength=K), out=offsets[1:])
    return np.concatenate(class_idx).astype(np.int64, copy=False)[order], offsets


def dirichlet_lda(
    labels, num_clients: int, alpha: float, seed: int = 0, min_size: int = 10, max_tries: int = 1000
) -> Partition:
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
            rows, offsets = _split_at(class_idx, cuts, K)
            return _make(_permute_each(rows, offsets, rng), offsets, y, f"lda(alpha={alpha})")
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
    return _make(
        *_csr([rng.permutation(np.array(b, dtype=np.int64)) for b in parts]), y, f"balanced_dirichlet(delta={delta})"
    )


def dirichlet_fedgkd(
    labels, num_clients: int, alpha: float, seed: int = 0, group: int = 10, max_tries: int = 1_000_000
) -> Partition:
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
    rows, offsets = [], [np.zeros(1, dtype=np.int64)]
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
            raise ValueError(
                f"alpha: no draw met FedGKD's size floor (every client >= half the mean size) in "
                f"{max_tries} tries; use more samples per client or a larger alpha"
            )
        r, o = _split_at(by_class, cuts, kg)
        rows.append(_permute_each(r, o, rng))
        offsets.append(o[1:] + offsets[-1][-1])
    return _make(np.concatenate(rows), np.concatenate(offsets), y, f"fedgkd_dirichlet(alpha={alpha})")


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
    return _make(perm, np.concatenate([[0], np.cumsum(sizes)]), y, f"quantity_skew(alpha={alpha})")


def by_writer(
    writers, num_clients: int | None = None, seed: int = 0, labels=None, num_classes: int | None = None
) -> Partition:
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
        K, n = int(num_clients), len(ids)
        sizes = np.full(K, n // K, dtype=np.int64)  # np.array_split's groups of the shuffled writers
        sizes[: n % K] += 1
        groups = np.empty(n, dtype=np.int64)
        groups[perm] = np.repeat(np.arange(K), sizes)
    client = groups[inv]
    order = np.argsort(client, kind="stable")
    bounds = np.searchsorted(client[order], np.arange(int(client.max()) + 2))
    y = torch.from_numpy(_labels(labels)) if labels is not None else None
    C = num_classes if num_classes is not None else (int(y.max()) + 1 if y is not None else None)
    return Partition.from_csr(order.astype(np.int64), bounds, C, y, "by_writer")


def per_class_sample(labels, per_class: int, seed: int = 0) -> torch.Tensor:
    """``per_class`` random indices of each class (all of a class if it has fewer), sorted by class, drawn once
    with ``seed``: FedCAD's server-held auxiliary set (32 per class; He et al., reading C5 in docs/methods.md)."""
    if int(per_class) < 1:
        raise ValueError(f"per_class: must be >= 1, got {per_class}")
    y = torch.as_tensor(_labels(labels))
    g = torch.Generator().manual_seed(int(seed))
    picks = [torch.nonzero(y == c).flatten() for c in range(int(y.max()) + 1)]
    return torch.cat([p[torch.randperm(len(p), generator=g)[: int(per_class)]] for p in picks])
