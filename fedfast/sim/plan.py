"""The round plan as pure functions of the seed, the round and the data's placement (issue 37, "the round plan"):
who trains (the cohort), in which order each client reads its data, and ``local_steps`` mode's table of rows per
step. Nothing here reads the engine; each function is tested alone (``tests/test_plan.py``) and the engine's
phase 1 calls them."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ..sampling import client_order, sample_clients, sample_clients_bernoulli, sample_clients_round_seeded


def max_cohort(clients_per_round: int, num_clients: int, sampling: str) -> int:
    """Clients per round to size the stack for: ``clients_per_round``, or for Bernoulli sampling its mean plus
    four standard deviations (a larger cohort trains in two chunks)."""
    if sampling != "bernoulli":
        return clients_per_round
    p = clients_per_round / num_clients
    return min(num_clients, int(np.ceil(num_clients * p + 4 * np.sqrt(num_clients * p * (1 - p)))))


def round_clients(seed: int, rnd: int, num_clients: int, clients_per_round: int, sampling: str,
                  schedule: Sequence | Callable | None = None) -> np.ndarray:
    """Round ``rnd``'s (0-based) participants as int64 ids: the seeded sampler named by ``sampling`` ("uniform",
    "bernoulli", "round_seeded"), or the user's ``schedule`` (a list of per-round id lists, or ``rnd -> ids``),
    checked: a non-empty 1-d list of distinct ids in [0, num_clients); errors name ``schedule`` and the round."""
    if schedule is None:
        if sampling == "bernoulli":
            return sample_clients_bernoulli(seed, rnd, num_clients, clients_per_round / num_clients)
        if sampling == "round_seeded":
            return sample_clients_round_seeded(rnd, num_clients, clients_per_round)
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
        raise ValueError(f"schedule: round {rnd + 1}: client ids must be distinct and in [0, {num_clients}), "
                         f"got {ids.tolist()}")
    return ids.astype(np.int64)


def data_order(seed: int, rnd: int, client: int, epoch: int, n: int, user_order: Callable | None = None) -> np.ndarray:
    """Client ``client``'s data order in local pass ``epoch`` of round ``rnd``: the user's ``data_order(rnd, client,
    epoch, n)`` if given (checked to be a permutation of range(n)), else seeded
    (:func:`fedfast.sampling.client_order`)."""
    if user_order is None:
        return client_order(seed, rnd, client, epoch, n)
    perm = np.asarray(user_order(rnd, client, epoch, n))
    if perm.shape != (n,) or not np.array_equal(np.sort(perm), np.arange(n)):
        raise ValueError(f"data_order: round {rnd + 1}, client {client}, epoch {epoch}: expected a "
                         f"permutation of range({n})")
    return perm


def steps_table(clients: np.ndarray, sizes: np.ndarray, data_batches: np.ndarray, steps: int, batch_size: int,
                client_rows: Sequence[np.ndarray], order: Callable[[int, int, int], np.ndarray]) -> np.ndarray:
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
                part = idx[b * B:(b + 1) * B]
                chunk[:len(part)] = part
                rows.append(chunk)
            e += 1
        out[j] = np.concatenate(rows[:steps])
    return out
