"""DP-FTRL (Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, *Practical and Private (Deep) Learning without Sampling or
Shuffling*, ICML 2021): tree-aggregated noise with restarts, for rounds whose cohorts need not be sampled secretly.

The bound step is DP-FedAvg's: each participant's update ``X_k - g`` clipped to ``C = dp_clip``, summed in the
aggregation's pass and divided by ``E = clients_per_round``. The noise is not drawn afresh each round. The rounds
``1..R`` of a tree (``R = dp_ftrl_restart``, or the whole run) are the leaves of a binary tree; each node holds the
sum of its rounds' clipped sums plus its own noise ``N(0, (z C)^2 I)``, and the prefix sum ``S_t`` of the clipped
sums up to round ``t`` is released as the sum of the O(log t) nodes of t's binary decomposition (the tree
aggregation of Dwork et al. 2010 and Chan et al. 2011 as Kairouz et al. use it). The model is the anchor plus the
noised prefix sum over E, ``theta_t = theta_0 + S~_t / E``: the engine's round adds the increment

    avg = g + sum_k clip(X_k - g) / E + z C (n(t) - n(t - 1)) / E,     n(t) = the noise of t's decomposition

which FedAvg's server rule takes as the new model (any other rule is post-processing of the released prefix sums).
Going from ``t - 1`` to ``t`` (lowest set bit ``v`` of ``t``) adds the new node of level ``v`` and drops the ``v``
nodes below it, whose noise cancels: the noise of ``theta_t`` has variance ``(z C / E)^2 popcount(t)``, not
``t (z C / E)^2``. At a restart the new tree starts from the current model (the old tree's noise stays in it).
Every node's noise is drawn from the run's secret, stream ``(TREE, tree, level, start)``, so it is drawn again, the
same, when a later round subtracts it: the secret is the whole state.

**Accounting** (neighbouring: one client's contributions replaced by zero, as in Kairouz et al. and
dp-accounting's ``SingleEpochTreeAggregationDpEvent``, ``REPLACE_SPECIAL``). Every released node is a Gaussian
mechanism, and the prefix sums up to round r determine exactly the r nodes completed by then (one new node per round:
a bijection), so the release is one Gaussian mechanism on the vector of nodes. A client contributes at most ``C`` to
each round it joins, so it moves node ``j`` by at most ``m_j C``, ``m_j`` its rounds in the node's interval; the
sensitivity is ``C sqrt(max_k sum_j m_kj^2)`` over the nodes released so far, and the run is a single Gaussian
mechanism of multiplier ``z / sqrt(max_k sum_j m_kj^2)`` (the adaptively chosen updates do not change this for
Gaussian noise on linear releases: Denisov et al. 2022, Kairouz et al. Theorem D.1). ``m`` comes from the run's
actual cohorts, which do not depend on the data (the seed's draws, ``round_seeded``, or a given schedule), computed
for every planned round before the first: no assumption on how cohorts were chosen, and no amplification either.
One participation per tree gives ``sum m^2 <= ceil(log2(R + 1))`` per tree, dp-accounting's single-epoch bound.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable

import numpy as np
import torch

from . import accounting
from .fedavg import UNACCOUNTED, DPFedAvg
from .secret import Secret
from .settings import PrivacySettings

TREE = 3  # the stream of a tree node's noise


def tree_position(rnd: int, restart: int | None) -> tuple[int, int]:
    """``(tree, t)``: the tree of 0-based round ``rnd`` and its 1-based leaf in it."""
    if restart is None:
        return 0, rnd + 1
    return rnd // restart, rnd % restart + 1


def node_start(t: int, level: int) -> int:
    """The 0-based first leaf of the level-``level`` node that ends at leaf ``t`` (1-based)."""
    return t - (1 << level)


def increment_nodes(t: int) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """Going from leaf ``t - 1`` to ``t``: the node added, ``(level, start)``, and the nodes dropped (the levels
    below the lowest set bit of ``t``, each ``(level, start)``)."""
    v = (t & -t).bit_length() - 1
    return (v, node_start(t, v)), [(lev, t - (1 << (lev + 1))) for lev in range(v)]


def participation(cohorts: list[np.ndarray], restart: int | None) -> np.ndarray:
    """``s2[r]``: after round ``r + 1`` the largest ``sum_j m_kj^2`` over clients ``k`` and the nodes ``j`` released by
    then (module docstring), from the rounds' cohorts (0-based client ids)."""
    if not cohorts:
        return np.zeros(0)
    K = max((int(c.max()) + 1 for c in cohorts if len(c)), default=1)
    total = np.zeros(K, dtype=np.float64)
    best, out = 0.0, np.zeros(len(cohorts))
    for r in range(len(cohorts)):
        tree, t = tree_position(r, restart)
        (level, start), _ = increment_nodes(t)
        first = r - t + 1 + start  # the node's first round (0-based, in the run)
        ids = np.concatenate([np.asarray(c, dtype=np.int64) for c in cohorts[first : r + 1]])
        if ids.size:
            ids, m = np.unique(ids, return_counts=True)
            total[ids] += m.astype(np.float64) ** 2
            best = max(best, float(total[ids].max()))
        out[r] = best
    return out


def cohort_digest(cohorts: list[np.ndarray]) -> str:
    """A digest of the rounds' cohorts (a resume checks that the rounds it accounts ran the cohorts it recomputes)."""
    h = hashlib.sha256()
    for c in cohorts:
        h.update(np.asarray(c, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


class DPFTRL(DPFedAvg):
    """DP-FTRL's noise step and accounting (module docstring) on DP-FedAvg's bound step. ``cohorts``: round ->
    the round's client ids (the run's round plan), read for every planned round up front."""

    name = "dp_ftrl"

    def __init__(
        self,
        settings: PrivacySettings,
        *,
        num_clients: int,
        device: torch.device | str,
        cohorts: Callable[[int], np.ndarray],
        secret: Secret | None = None,
        method_name: str = "the method",
        uploads: dict | None = None,
    ):
        self.settings = s = PrivacySettings.given(settings)
        self.method_name = method_name
        self._uploads(uploads)
        self.secret = secret if secret is not None else Secret()
        self.device = torch.device(device)
        self.num_clients = int(num_clients)
        self.clip = self._round_clip = float(s.dp_clip)
        self.expected = float(s.clients_per_round)
        self.sampling = s.client_sampling
        self.restart = s.dp_ftrl_restart
        self.adaptive, self.poisson, self._count = False, None, None
        accounting.check_delta(s.dp_delta, self.num_clients)
        if s.dp_accountant not in accounting.ACCOUNTANTS:
            raise ValueError(f"dp_accountant: must be one of {accounting.ACCOUNTANTS}, got {s.dp_accountant!r}")
        self.cohorts = cohorts
        self._s2 = participation([cohorts(r) for r in range(int(s.rounds))], self.restart)
        if s.dp_noise_multiplier is not None:
            self.z = float(s.dp_noise_multiplier)
        else:
            self.z = self.calibrate(float(s.dp_epsilon), int(s.rounds))
        self.z_update = self.z
        self.check_plan(int(s.rounds))

    # -- accounting ---------------------------------------------------------------------------------------------
    def _sensitivity2(self, rounds: int) -> float:
        """max_k sum_j m_kj^2 after ``rounds`` rounds (cohorts read up to there when a resume planned more)."""
        if rounds > len(self._s2):
            self._s2 = participation([self.cohorts(r) for r in range(rounds)], self.restart)
        return float(self._s2[rounds - 1]) if rounds else 0.0

    def _gaussian_epsilon(self, multiplier: float) -> float:
        s = self.settings
        if multiplier == math.inf:
            return 0.0
        if multiplier == 0:
            return math.inf
        return tree_epsilon(multiplier, float(s.dp_delta), s.dp_accountant)

    def epsilon(self, rounds: int) -> float | None:
        """Epsilon after ``rounds`` rounds: one Gaussian mechanism of multiplier z / sqrt(max_k sum_j m_kj^2)."""
        s2 = self._sensitivity2(rounds)
        eps = self._gaussian_epsilon(self.z / math.sqrt(s2) if s2 > 0 else math.inf)
        return eps if math.isfinite(eps) else None

    def _set_multiplier(self, z: float) -> None:
        self.z = self.z_update = z

    def check_plan(self, rounds: int) -> float:
        eps = self.epsilon(rounds)
        eps = math.inf if eps is None else eps
        cap = self.settings.dp_epsilon
        if cap is not None and eps > cap * (1 + 1e-9):
            raise ValueError(
                f"rounds: {rounds} private rounds spend epsilon = {eps:.4g} at delta = {self.settings.dp_delta:g}, "
                f"past the run's budget dp_epsilon = {cap:g}"
            )
        return eps

    def calibrate(self, target: float, rounds: int) -> float:
        """The smallest z (to 0.1 %) whose ``rounds`` rounds spend at most ``target``."""
        s2 = self._sensitivity2(rounds)
        if s2 == 0:
            return 0.0
        unit = accounting.bisect_multiplier(lambda m: self._gaussian_epsilon(m), target)
        return unit * math.sqrt(s2)

    # -- the noise step -------------------------------------------------------------------------------------------
    def _node(self, tree: int, level: int, start: int, stream: int, shape, dtype) -> torch.Tensor:
        ids = (tree, level, start) + ((stream,) if stream else ())  # the update's nodes: stream 0
        gen = self.secret.generator(self.device, TREE, *ids)
        return torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32).to(dtype)

    def _noise(self, shape, dtype, ctx, stream: int) -> torch.Tensor:
        """The round's noise increment ``n(t) - n(t - 1)`` of ``stream`` (0: the update; j: the j-th upload, each a
        tree of its own), unit std per node: the new node's noise in, the dropped nodes' out."""
        tree, t = tree_position(int(ctx.index), self.restart)
        (level, start), dropped = increment_nodes(t)
        noise = self._node(tree, level, start, stream, shape, dtype)
        for lev, st in dropped:
            noise = noise - self._node(tree, lev, st, stream, shape, dtype)
        return noise

    def average(self, g: torch.Tensor, total: torch.Tensor, total_weight: float, ctx) -> torch.Tensor:
        """``g + total + z C (n(t) - n(t - 1)) / E``; with uploads, each upload's sum plus its own tree's increment
        (the server rule reads the increments of the noised prefix sums: post-processing)."""
        avg = g + total
        if self.z > 0:
            avg = avg + self._noise(g.shape, g.dtype, ctx, 0) * (self.z * self.clip / self.expected)
        if self.specs:
            self._release_uploads((avg - g) * self.expected, ctx)
        return avg

    def record(self, rec: dict, rounds: int) -> None:
        rec["dp_epsilon"] = self.epsilon(rounds)

    def _hidden(self) -> set:
        """The cohorts do not depend on the data (they are public): kept; the other unaccounted values left out."""
        return set(UNACCOUNTED) - {"clients"}

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def _accounting(self) -> dict:
        return {**super()._accounting(), "dp_ftrl_restart": self.restart}

    def checkpoint(self, rounds: int) -> dict:
        """DP-FedAvg's part, and the digest of the ``rounds`` done's cohorts."""
        ck = super().checkpoint(rounds)
        ck["privacy"]["cohorts"] = cohort_digest([self.cohorts(r) for r in range(rounds)])
        return ck

    def restore(self, ck: dict, rounds: int) -> None:
        """As DP-FedAvg's, and the rounds done must have run the cohorts this run's plan gives them (a changed
        schedule would account past rounds with other cohorts): checked against the checkpoint's digest."""
        super().restore(ck, rounds)
        done = int(ck.get("round", 0))
        want = ck["privacy"].get("cohorts")
        if want is not None and cohort_digest([self.cohorts(r) for r in range(done)]) != want:
            raise ValueError(
                f"schedule: the checkpoint's {done} rounds ran other cohorts than this run's plan gives them; "
                f"their accounting depends on them (resume with the same schedule and sampling)"
            )


def tree_epsilon(multiplier: float, delta: float, accountant: str) -> float:
    """Epsilon at ``delta`` of one Gaussian mechanism of noise multiplier ``multiplier`` (dp-accounting's RDP or PLD
    accountant; the relation does not matter for a single Gaussian)."""
    dpa = accounting._dpa()
    acc = dpa.rdp.RdpAccountant() if accountant == "rdp" else dpa.pld.PLDAccountant()
    with accounting._quiet():
        acc.compose(dpa.GaussianDpEvent(multiplier))
        return float(acc.get_epsilon(delta))
