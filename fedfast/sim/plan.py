"""The round plan as pure functions of the seed, the round and the data's placement (issue 37, "the round plan"):
who trains (the cohort), in which order each client reads its data, ``local_steps`` mode's table of rows per step,
and :class:`RoundPlan`, which holds the placement and gives each round's context, weights, batch tables and
augmented minibatches. Nothing here reads the engine; each part is tested alone (``tests/test_plan.py``)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
import torch

from .._io import host_to_device
from .._settings import Settings
from ..data.augment import augmented_batch
from ..data.datasets import ArrayDataset
from ..data.partition import ClientIndices, Partition
from ..methods.base import Method
from ..methods.hooks import hook_site
from ..methods.round import Round
from ..sampling import (
    client_order,
    sample_clients,
    sample_clients_bernoulli,
    sample_clients_poisson,
    sample_clients_round_seeded,
    sample_clients_shuffled,
)


def max_cohort(clients_per_round: int, num_clients: int, sampling: str) -> int:
    """Clients per round to size the stack for: ``clients_per_round``, or for Bernoulli and Poisson sampling its mean
    plus four standard deviations (a larger cohort trains in two chunks)."""
    if sampling not in ("bernoulli", "poisson"):
        return clients_per_round
    p = clients_per_round / num_clients
    return min(num_clients, int(np.ceil(num_clients * p + 4 * np.sqrt(num_clients * p * (1 - p)))))


def round_clients(
    seed: int,
    rnd: int,
    num_clients: int,
    clients_per_round: int,
    sampling: str,
    schedule: Sequence | Callable | None = None,
) -> np.ndarray:
    """Round ``rnd``'s (0-based) participants as int64 ids: the seeded sampler named by ``sampling`` ("uniform",
    "bernoulli", "round_seeded", "poisson", "shuffled"), or the user's ``schedule`` (a list of per-round id lists,
    or ``rnd -> ids``), checked: a non-empty 1-d list of distinct ids in [0, num_clients); errors name ``schedule``
    and the round."""
    if schedule is None:
        if sampling == "bernoulli":
            return sample_clients_bernoulli(seed, rnd, num_clients, clients_per_round / num_clients)
        if sampling == "poisson":
            return sample_clients_poisson(seed, rnd, num_clients, clients_per_round / num_clients)
        if sampling == "round_seeded":
            return sample_clients_round_seeded(rnd, num_clients, clients_per_round)
        if sampling == "shuffled":
            return sample_clients_shuffled(seed, rnd, num_clients, clients_per_round)
        return sample_clients(seed, rnd, num_clients, clients_per_round)
    if callable(schedule):
        ids = schedule(rnd)
    else:
        if rnd >= len(schedule):
            raise ValueError(f"schedule: has {len(schedule)} rounds, round {rnd + 1} was asked for")
        ids = schedule[rnd]
    ids = np.asarray(ids.cpu() if torch.is_tensor(ids) else ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"schedule: round {rnd + 1}: expected a non-empty 1-d list of client ids, got {ids!r}")
    if ids.min() < 0 or ids.max() >= num_clients or len(np.unique(ids)) != len(ids):
        raise ValueError(
            f"schedule: round {rnd + 1}: client ids must be distinct and in [0, {num_clients}), got {ids.tolist()}"
        )
    return ids.astype(np.int64)


def data_order(seed: int, rnd: int, client: int, epoch: int, n: int, user_order: Callable | None = None) -> np.ndarray:
    """Client ``client``'s data order in local pass ``epoch`` of round ``rnd``: the user's ``data_order(rnd, client,
    epoch, n)`` if given (checked to be a permutation of range(n)), else seeded
    (:func:`fedfast.sampling.client_order`)."""
    if user_order is None:
        return client_order(seed, rnd, client, epoch, n)
    perm = np.asarray(user_order(rnd, client, epoch, n))
    if perm.shape != (n,) or not np.array_equal(np.sort(perm), np.arange(n)):
        raise ValueError(
            f"data_order: round {rnd + 1}, client {client}, epoch {epoch}: expected a permutation of range({n})"
        )
    return perm


def steps_table(
    clients: np.ndarray,
    sizes: np.ndarray,
    data_batches: np.ndarray,
    steps: int,
    batch_size: int,
    client_rows: Sequence[np.ndarray],
    order: Callable[[int, int, int], np.ndarray],
) -> np.ndarray:
    """``local_steps`` mode: rows ``[len(clients), steps * batch_size]`` of ``steps`` minibatches per client, taken
    from successive passes over its data (pass e in the order ``order(client, e, n)``; ``client_rows[client]``: its
    rows of the training set), each pass's ``data_batches`` batches, the last partial one padded with -1 (a smaller
    step, as a DataLoader without drop_last gives it)."""
    B = batch_size
    out = np.full((len(clients), steps * B), -1, dtype=np.int64)
    for j in range(len(clients)):
        k, nk, nb = int(clients[j]), int(sizes[j]), int(data_batches[j])
        rows, e = [], 0
        while len(rows) < steps:
            idx = client_rows[k][order(k, e, nk)]
            for b in range(nb):
                chunk = np.full(B, -1, dtype=np.int64)
                part = idx[b * B : (b + 1) * B]
                chunk[: len(part)] = part
                rows.append(chunk)
            e += 1
        out[j] = np.concatenate(rows[:steps])
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSettings(Settings):
    """What the round plan reads of a run's config: the cohort's size and sampling, the seed, the batch size and
    passes (epochs or steps, ``drop_last``), the learning-rate schedule, the augmentation and the weights."""

    clients_per_round: int
    client_sampling: str
    seed: int
    batch_size: int
    local_epochs: int
    local_steps: int | None
    drop_last: bool
    lr: float
    lr_decay: float
    augment: str
    aggregate_weights: str | None


class RoundPlan:
    """The round plan of a run: its data's placement (each client's rows of the training set, sizes, label
    histograms, this process's share of a cohort) and, from it, round by round, a pure function of the seed and the
    round: the cohort in stack order (:meth:`sample`), the aggregation weights, each client's data order and batch
    tables, and each step's minibatch with its augmentation (:meth:`minibatch`). ``method`` is asked for its
    aggregation weights only (``Method.aggregation_weights``)."""

    def __init__(
        self,
        settings: PlanSettings,
        train: ArrayDataset,
        partition: Partition,
        method: Method,
        *,
        device: torch.device,
        rank: int = 0,
        world: int = 1,
        schedule: Sequence | Callable | None = None,
        data_order: Callable | None = None,
        cohort_secret=None,
    ):
        self.settings = settings = PlanSettings.given(settings)
        # a private run's secret (fedfast.privacy.Secret): its cohorts are drawn from it, not from the run seed (the
        # sampling amplification assumes them secret); read at each draw, so a restored secret takes effect
        self.cohort_secret = cohort_secret
        self.train, self.method, self.device = train, method, device
        self.rank, self.world, self.schedule, self.user_order = rank, world, schedule, data_order
        self.num_clients = K = partition.num_clients
        self.rows, self.offsets = rows, offsets = partition.rows.numpy(), partition.offsets.numpy()
        self.client_rows = ClientIndices(rows, offsets)  # client k's rows of the training set: a view, on demand
        self.client_sizes = np.diff(offsets)
        if int(rows.max()) >= len(train):
            raise ValueError(f"partition: holds sample indices beyond the training set ({len(train)} samples)")
        if partition.num_classes is not None and partition.num_classes != train.num_classes:
            raise ValueError(
                f"partition: made for {partition.num_classes} classes, the training set has {train.num_classes}"
            )
        if schedule is None and settings.clients_per_round > K:
            raise ValueError(f"clients_per_round: {settings.clients_per_round} > {K} clients")
        self.num_classes = train.num_classes
        self.labels = train.y.cpu().numpy()
        self._label_hist = None
        self._arange_b = torch.arange(settings.batch_size, device=device)

    def cohort_rows(self, clients: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, owner)``: every row of the training set the clients hold, client after client, and the position
        in ``clients`` of each row's client (vectorised gathers over the compact partition: O(their samples))."""
        lens = self.client_sizes[clients]
        owner = np.repeat(np.arange(len(clients), dtype=np.int64), lens)
        pos = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(lens) - lens - self.offsets[clients], lens
        )
        return self.rows[pos], owner

    def histograms(self, clients: np.ndarray) -> torch.Tensor:
        """[len(clients), C] float label counts of the clients (one bincount over their rows), on the device."""
        rows, owner = self.cohort_rows(clients)
        C = self.num_classes
        counts = np.bincount(owner * C + self.labels[rows], minlength=len(clients) * C)
        return torch.from_numpy(counts.reshape(len(clients), C)).float().to(self.device)

    @property
    def label_hist(self) -> torch.Tensor:
        """[K, C] every client's label counts (the Engine's ``label_hist``), made on first use: a run whose method
        does not read it never holds a row per client."""
        if self._label_hist is None:
            self._label_hist = self.histograms(np.arange(self.num_clients))
        return self._label_hist

    def max_cohort(self) -> int:
        """The most clients a round of this run can have (:func:`max_cohort`; a schedule: every client)."""
        c = self.settings
        return (
            max_cohort(c.clients_per_round, self.num_clients, c.client_sampling)
            if self.schedule is None
            else self.num_clients
        )

    def clients(self, rnd: int) -> np.ndarray:
        """Round ``rnd``'s participants (:func:`round_clients`; a private run's from its secret)."""
        c = self.settings
        seed = c.seed if self.cohort_secret is None else self.cohort_secret.cohort_seed()
        return round_clients(seed, rnd, self.num_clients, c.clients_per_round, c.client_sampling, self.schedule)

    def order(self, rnd: int, k: int, epoch: int, nk: int) -> np.ndarray:
        """Client ``k``'s data order in local pass ``epoch`` of round ``rnd`` (:func:`data_order`)."""
        return data_order(self.settings.seed, rnd, k, epoch, nk, self.user_order)

    def sample(self, rnd: int):
        """Round ``rnd``'s plan: ``(ctx, totals, step_rows)``, the round's context with its clients in stack order
        (this process's share: every world-th, most local steps first, so the clients still training at any step
        are a prefix), the totals over all processes (weight, steps, every client's id) and ``local_steps``
        mode's row table (None otherwise)."""
        c = self.settings
        sampled = self.clients(rnd)
        sizes = self.client_sizes[sampled]
        batches = (sizes // c.batch_size if c.drop_last else np.ceil(sizes / c.batch_size)).astype(int)  # per pass
        if c.drop_last and (batches == 0).any():
            small = sampled[batches == 0].tolist()
            raise ValueError(
                f"drop_last: client(s) {small[:5]} hold fewer than batch_size = {c.batch_size} samples, "
                f"so drop_last leaves them no batch; use a smaller batch_size or drop_last = false"
            )
        order = np.argsort(-batches, kind="stable")  # most steps first: active clients are a prefix
        sampled, sizes, batches = sampled[order], sizes[order], batches[order]
        epochs = 1 if c.local_steps else c.local_epochs
        steps = np.full(len(sampled), c.local_steps, dtype=int) if c.local_steps else batches  # per "epoch"
        weights = self.aggregation_weights(sampled, sizes, steps * epochs) if len(sampled) else np.zeros(0)
        totals = dict(weight=float(weights.sum()), steps=int(steps.sum()) * epochs, clients=sampled.tolist())
        everyone = sampled
        positions = np.arange(len(sampled))
        num_total = len(sampled)
        if self.world > 1:  # this rank's clients: every world-th of the sorted list (balanced, still sorted)
            sampled, sizes, steps, batches, weights = (
                a[self.rank :: self.world] for a in (sampled, sizes, steps, batches, weights)
            )
            positions = positions[self.rank :: self.world]
        sampled_t = torch.from_numpy(sampled).to(self.device)
        hist = self.histograms(sampled)
        state = self.method.client_state
        ctx = Round(
            index=rnd,
            sampled=sampled,
            sizes=sizes,
            steps=steps,
            epochs=epochs,
            lr=c.lr * c.lr_decay**rnd,
            sampled_t=sampled_t,
            hist=hist,
            positions=host_to_device(positions, self.device),
            num_total=num_total,
            weights=weights,
            clients=everyone,
            data_batches=batches,
            rows=None if state is None else state.gather(sampled),  # the method's state rows of the round's clients
        )
        step_rows = self.steps_table(ctx, 0, len(sampled), c.local_steps) if c.local_steps else None
        return dataclasses.replace(ctx, seen_hist=self.seen_histograms(ctx, step_rows)), totals, step_rows

    def seen_histograms(self, ctx: Round, step_rows: np.ndarray | None) -> torch.Tensor:
        """[m, C] the labels of the rows each of the round's clients trains on (``step_rows``: ``local_steps``
        mode's row table): ``epochs`` x its label histogram unless ``local_steps`` or ``drop_last`` leave rows out."""
        c = self.settings
        if not (c.local_steps or c.drop_last):
            return ctx.hist * ctx.epochs
        tables = (
            [step_rows]
            if c.local_steps
            else [
                self.batch_table(ctx, 0, len(ctx.sampled), e, int(ctx.steps[0]) * c.batch_size)
                for e in range(ctx.epochs)
            ]
        )
        seen = np.zeros((len(ctx.sampled), self.num_classes), dtype=np.int64)
        for t in tables:
            for j, r in enumerate(t):
                seen[j] += np.bincount(self.labels[r[r >= 0]], minlength=self.num_classes)
        return host_to_device(seen.astype(np.float32), self.device)

    def aggregation_weights(self, ids: np.ndarray, sizes: np.ndarray, local_steps: np.ndarray) -> np.ndarray:
        """The round's participants' weights in the average: the method's (FedDisco, FedNova) or the engine's."""
        w = self.method.aggregation_weights(ids, sizes, local_steps)
        if w is None:
            return sizes.astype(np.float64) if self.settings.aggregate_weights == "size" else np.ones(len(ids))
        w = np.asarray(w, dtype=np.float64)
        if w.shape != ids.shape or not np.isfinite(w).all() or (w < 0).any() or not w.sum() > 0:
            raise ValueError(
                f"{hook_site(self.method, 'aggregation_weights')}: expected {len(ids)} finite "
                f"non-negative weights with a positive sum, got {w.tolist()}"
            )
        return w

    def steps_table(self, ctx: Round, lo: int, hi: int, T: int) -> np.ndarray:
        """``local_steps`` mode's rows for the round's clients ``lo:hi`` (:func:`steps_table`)."""
        return steps_table(
            ctx.sampled[lo:hi],
            ctx.sizes[lo:hi],
            ctx.data_batches[lo:hi],
            T,
            self.settings.batch_size,
            self.client_rows,
            lambda k, e, n: self.order(ctx.index, k, e, n),
        )

    def batch_table(self, ctx: Round, lo: int, hi: int, epoch: int, width: int) -> np.ndarray:
        """The round's clients ``lo:hi``: their rows in local pass ``epoch``, each in its own data order, padded
        with -1 to ``width`` (host index math, once per pass)."""
        c = self.settings
        table = np.full((hi - lo, width), -1, dtype=np.int64)
        for j in range(hi - lo):
            k, nk = int(ctx.sampled[lo + j]), int(ctx.sizes[lo + j])
            perm = self.order(ctx.index, k, epoch, nk)
            take = min(nk if not c.drop_last else (nk // c.batch_size) * c.batch_size, width)
            table[j, :take] = self.client_rows[k][perm[:take]]
        return table

    def minibatch(self, ctx: Round, table: torch.Tensor, lo: int, n_act: int, e: int, s: int, gen: torch.Generator):
        """Step ``s`` of pass ``e`` for the chunk starting at ``lo``: the active clients' inputs [n_act, B, ...]
        (augmented with ``gen`` re-seeded from (seed, round, epoch, step) and each row's position in the whole
        cohort: the same for any chunking or number of processes), labels (-100 on padding rows), the valid-row
        mask and the row indices."""
        c, B = self.settings, self.settings.batch_size
        rows = table[:n_act, s * B : (s + 1) * B]
        valid = rows >= 0
        ridx = rows.clamp_min(0)
        if c.augment != "none":
            gen.manual_seed(
                int(np.random.SeedSequence([c.seed, 104729, ctx.index, e, s]).generate_state(1, np.uint64)[0])
                & (2**63 - 1)
            )
            pos = (ctx.positions[lo : lo + n_act, None] * B + self._arange_b[None, :B]).reshape(-1)
            x, y = augmented_batch(self.train, ridx, gen, pipeline=c.augment, select=(ctx.num_total * B, pos))
        else:
            x, y = self.train.batch(ridx)
        return x, torch.where(valid, y, torch.full_like(y, -100)), valid, ridx
