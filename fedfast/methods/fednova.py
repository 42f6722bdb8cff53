"""FedNova (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization",
NeurIPS 2020), as run in FedNTD's code (Lee-Gihun/FedNTD @be00ee5, ``algorithms/fednova``), whose Table 1 reports it.

Clients with more data take more local steps; plain averaging then weights them more than their data share
(objective inconsistency). FedNova normalises each client's update by its effective number of steps. With local
SGD momentum ``rho`` and ``tau_i = E * ceil(n_i / B)`` steps::

    a_i     = (tau_i - rho (1 - rho^tau_i) / (1 - rho)) / (1 - rho)      (a_i = tau_i without momentum)
    p_i     = n_i / sum_{j in S} n_j                                       (1/m with aggregate_weights = "uniform")
    tau_eff = sum_i p_i a_i
    w_{t+1} = w_t - tau_eff sum_i p_i (w_t - w_i) / a_i

fedfast runs this as the engine's weighted average with weights ``p_i / a_i`` and the server step
``w_{t+1} = w_t + tau_eff c2 (avg - w_t)``, ``c2 = sum_i p_i / a_i`` (the same formula).

Cross-client variance reduction (``ccvr``, the FedNTD code's config ``nova_ccvr: true``): each local gradient
becomes ``g + c - d_i`` (before weight decay and momentum, as SCAFFOLD's correction), with the client's
normalised update of its last participation ``d_i = (w_t - w_i) / (lr a_i)`` (0 before it) and a server
variate ``c``. The code defines ``c``'s update, ``c <- (1 - P) c + sum_{i in S} (n_i / N) d_i`` with
``P = sum_{i in S} n_i / N`` (N: all clients' data), but never calls it, so ``c`` stays 0 and the correction is
``-d_i``: fedfast's default (``ccvr_server = false``) runs the code; ``ccvr_server = true`` applies the update.
State: ``d_i`` for every client ([K, P] rows) and ``c`` [P], with ``ccvr``.

Private runs (``dp_clip``): what a client uploads is its normalised update ``(w_i - w_t) / a_i`` and its step
count ``a_i``, clipped together (one norm over ``(update / a_i, dp_tau_scale * a_i)``); the weights are uniform,
``p_i = 1 / E`` (E the expected cohort), so ``w_{t+1} = w_t + tau_eff sum_i (w_i - w_t) / (a_i E)`` with ``tau_eff``
the noised clipped sum of the ``a_i`` over E (its noise ``z C / (dp_tau_scale E)``: a larger ``dp_tau_scale`` gives
the count less noise and more of the clip). ``d_i`` stays the client's own; ``ccvr_server`` (a data-share-weighted
server variate) is refused there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._io import host_to_device
from .base import StateSpec, UploadSpec
from .fedavg import FedAvg
from .options import opt
from .registry import register
from .round import Collected

_CODE = "Lee-Gihun/FedNTD @be00ee5, config/fednova.json and algorithms/fednova"


def effective_steps(tau: np.ndarray, rho: float) -> np.ndarray:
    """a_i: the steps tau_i of SGD with momentum rho, counted by how far they move the weights (FedNova, Eq. 8)."""
    tau = np.asarray(tau, dtype=np.float64)
    return (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho) if rho > 0 else tau


@register("fednova")
class FedNova(FedAvg):
    """FedNova (Wang et al. 2020): w' = w - tau_eff sum_i p_i (w - w_i) / a_i, a_i the momentum-corrected local
    steps; optional variance reduction g + c - d_i (FedNTD's code)."""

    uploads = "its normalised update and local step count (the server weighs each client by it)"
    paper = (
        "Wang et al., Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization, "
        "NeurIPS 2020"
    )
    sgd_only = "its normalisation counts SGD (momentum) steps (Wang et al. 2020, Eq. 8)"
    accepts_asd = False
    state = ("c",)

    @dataclass
    class Options:
        ccvr: bool = opt(True, f"variance reduction g + c - d_i ({_CODE}: nova_ccvr true)")
        ccvr_server: bool = opt(
            False, "update the server variate c (defined but never called in FedNTD's code: c stays 0)"
        )
        dp_tau_scale: float = opt(
            0.01, "private runs: the step count a_i enters the joint clipping norm as dp_tau_scale * a_i", check=">0"
        )

    def client_state_spec(self, engine):
        return StateSpec() if self.opts.ccvr else None  # d_i

    def setup(self):
        e = self.engine
        self.c = torch.zeros(e.num_params, device=e.device) if self.opts.ccvr else None

    def aggregation_weights(self, ids, sizes, local_steps):
        e = self.engine
        p = sizes / sizes.sum() if e.aggregate_weights == "size" else np.full(len(ids), 1.0 / len(ids))
        a = effective_steps(local_steps, e.momentum)
        self.coef = float((p * a).sum() * (p / a).sum())  # tau_eff * c2
        self.share = float(sizes.sum() / self.engine.client_sizes.sum())  # P, the round's share of all data
        self.a = np.zeros(self.engine.num_clients)
        self.a[ids] = a
        return p / a

    def upload_spec(self):
        """Private runs: the normalised update (the update's factor 1 / a_i) and the step count, clipped together."""
        if self.opts.ccvr_server:
            raise ValueError(
                "fednova.ccvr_server: the server variate weighs each client's normalised update by its share of all "
                "clients' data, which a private run does not release; set ccvr_server = false under dp_clip"
            )
        return {"tau": UploadSpec(cols=1, scale=1.0 / self.opts.dp_tau_scale)}

    def round_start(self, ctx):
        if self.engine.private:  # private: the round's noised sum of the clients' step counts
            return {"tau": torch.zeros(1, device=self.engine.device)}
        return None

    def upload_rows(self, ctx, lo, hi):
        a = host_to_device(self.a[ctx.sampled[lo:hi]], self.engine.device, torch.float32)
        return {"tau": (a * self.opts.dp_tau_scale)[:, None], "update": 1.0 / a}

    def chunk_start(self, ctx, lo, hi):
        if self.opts.ccvr:
            return ctx.rows[lo:hi]  # d_i of the chunk's clients

    def step_terms(self, ctx, n_act):
        if not self.opts.ccvr:
            return {}
        # the correction c - d_k enters momentum: v = c, C_k = d_k with coefficient -1
        return dict(corr_vec=self.c, corr_rows=ctx.chunk[:n_act], corr_rows_coef=-1.0)

    def collect(self, ctx, out, lo, hi):
        if not self.opts.ccvr:
            return None
        e = self.engine
        inv = host_to_device(1.0 / (ctx.lr * self.a[ctx.sampled[lo:hi]]), e.device, torch.float32)[:, None]
        d = (e.global_flat - e.client_params(hi - lo)) * inv  # d_i = (w_t - w_i) / (lr a_i)
        inc = None
        if self.opts.ccvr_server:
            n = host_to_device(ctx.sizes[lo:hi] / e.client_sizes.sum(), e.device, torch.float32)
            inc = n @ d
        return Collected(rows=d, increment=inc)

    def server_terms(self, ctx):
        if self.engine.private:  # avg - w = sum_i s_i (w_i - w) / (a_i E); tau_eff = noised sum of a_i / E
            return dict(lr=float(ctx.sums["tau"][0]) / self.engine.clients_per_round)
        return dict(lr=self.coef)

    def server(self, ctx, avg):
        if self.opts.ccvr and self.opts.ccvr_server:
            self.c = (1.0 - self.share) * self.c + ctx.increment
        return super().server(ctx, avg)
