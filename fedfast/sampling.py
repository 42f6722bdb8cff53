"""Which clients train in a round and in which order each sees its data: seeded, so any chunking, number of
processes or reference loop draws the same (``SimConfig.client_sampling`` picks the round's rule)."""

from __future__ import annotations

import numpy as np


def client_order(seed: int, rnd: int, client: int, epoch: int, n: int) -> np.ndarray:
    """The seeded shuffle of a client's local indices for one epoch (shared with reference loops)."""
    return np.random.default_rng([seed, rnd, client, epoch]).permutation(n)


def sample_clients(seed: int, rnd: int, K: int, m: int) -> np.ndarray:
    """The default client sampling: ``m`` of ``K`` clients without replacement, seeded by ``(seed, round)``."""
    return np.sort(np.random.default_rng([seed, rnd, 10**6]).choice(K, size=m, replace=False))


def sample_clients_bernoulli(seed: int, rnd: int, K: int, p: float) -> np.ndarray:
    """Each of ``K`` clients independently with probability ``p``, as ASD's code samples (vcl-iisc/fed-adaptive-
    self-distillation @6cb4b68, ``src/utils_methods.py``: ``np.random.seed(round + seed + retry)``,
    ``uniform(size=K) <= p``, drawn again with the next retry while no client is chosen)."""
    retry = 0
    while True:
        u = np.random.RandomState((rnd + seed + retry) % 2**32).uniform(size=K)
        chosen = np.nonzero(u <= p)[0]
        retry += 1
        if len(chosen):
            return chosen


def sample_clients_poisson(seed: int, rnd: int, K: int, q: float) -> np.ndarray:
    """Poisson sampling: each of ``K`` clients independently with probability ``q``, seeded by ``(seed, round)``;
    the cohort may be empty (DP-FedAvg's analysis, :mod:`fedfast.privacy`, takes it as drawn)."""
    return np.nonzero(np.random.default_rng([seed, rnd, 10**6 + 1]).random(K) < q)[0].astype(np.int64)


def sample_clients_round_seeded(rnd: int, K: int, m: int) -> np.ndarray:
    """``m`` of ``K`` clients drawn by numpy's ``RandomState(round)`` whatever the run's seed, so every seed and
    every method sees the same cohorts, as FedNTD's code samples (Lee-Gihun/FedNTD @be00ee5,
    ``algorithms/BaseServer.py``: ``np.random.seed(round_idx)``, ``np.random.choice(K, m, replace=False)``)."""
    return np.sort(np.random.RandomState(rnd).choice(K, m, replace=False))


def sample_clients_shuffled(seed: int, rnd: int, K: int, m: int) -> np.ndarray:
    """Each client once per epoch: epoch ``e = rnd // (K // m)`` shuffles the ``K`` clients, seeded by ``(seed, e)``,
    and round ``rnd`` takes the next ``m`` of them (the ``K mod m`` left over sit that epoch out). The participation
    DP-FTRL assumes in federated training (Kairouz et al. 2021, each client at most once per epoch): with
    ``dp_ftrl_restart = K // m`` each client joins each tree once."""
    per_epoch = K // m
    e, i = divmod(rnd, per_epoch)
    perm = np.random.default_rng([seed, e, 10**6 + 2]).permutation(K)
    return np.sort(perm[i * m : (i + 1) * m])
