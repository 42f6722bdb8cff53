"""SCAFFOLD (Karimireddy et al., ICML 2020), as run in FedNTD's code.

State: a server control variate ``c`` [P] and one per client, ``c_k`` [P] (zero at the start). Each local step
uses the corrected gradient ``g + c - c_k`` (a term of the fused client step). After a client's K local steps
with learning rate ``lr``::

    c_k' = c_k - c + (w_t - w_k) / (K_eff * lr)          (option II of the paper)
    c'   = c + (1/N) sum_{k in S_t} (c_k' - c_k)          (N: all clients)

and the global model is the participants' weighted average. ``K_eff`` is the number of local steps K; FedNTD's
code ("adaptive division", ``keff_momentum = true``) counts SGD momentum ``rho`` in it:
``K_eff = (K - rho (1 - rho^K) / (1 - rho)) / (1 - rho)``, the total distance a unit gradient moves the
weights under momentum. With ``momentum = 0`` both are K.

Private runs (``dp_clip``; DP-SCAFFOLD, Noble, Bellet, Dieuleveut, AISTATS 2022): each client uploads its update and
``c_k' - c_k = -c - (w_k - w_t) / (K_eff lr)``, clipped together (one norm over both), and the server's ``c`` takes
the noised sum of the clipped ``c_k' - c_k`` over N. ``c_k'`` stays the client's own, unclipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import StateSpec, UploadSpec
from .fedavg import FedAvg
from .options import opt
from .registry import register
from .round import Collected


@register("scaffold")
class Scaffold(FedAvg):
    """SCAFFOLD (Karimireddy et al. 2020; FedNTD's code): local steps use g + c - c_k; c_k' = c_k - c + (w_t - w_k) /
    (K_eff lr); c' = c + (1/N) sum (c_k' - c_k)."""

    uploads = "its control variates c_k' - c_k"
    sgd_only = (
        "its control-variate update c_k' = c_k - c + (x - y) / (K lr) estimates the gradient from "
        "K plain SGD steps (Karimireddy et al. 2020, option II)"
    )
    state = ("c",)
    paper = "Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, ICML 2020"

    @dataclass
    class Options:
        keff_momentum: bool = opt(True, "count local momentum in K_eff (FedNTD code, 'adaptive division')")

    def client_state_spec(self, engine):
        return StateSpec()  # c_k, zero before a client trains

    def setup(self):
        e = self.engine
        self.c = torch.zeros(e.num_params, device=e.device)

    def chunk_start(self, ctx, lo, hi):
        return ctx.rows[lo:hi]  # c_k of the chunk's clients

    def step_terms(self, ctx, n_act):
        # the correction c - c_k (after clipping, inside momentum): v = c, C_k = c_k with coefficient -1
        return dict(corr_vec=self.c, corr_rows=ctx.chunk[:n_act], corr_rows_coef=-1.0)

    def _coef(self, ctx, lo, hi):
        """a_k = -1 / (K_eff lr) for the chunk's clients: c_k' - c_k = -c + a_k (w_k - w_t)."""
        K = torch.tensor(ctx.steps[lo:hi] * ctx.epochs, dtype=torch.float64)
        rho = self.engine.momentum if self.opts.keff_momentum else 0.0
        k_eff = (K - rho * (1 - rho**K) / (1 - rho)) / (1 - rho) if rho > 0 else K
        return (-1.0 / (k_eff * ctx.lr)).float().to(self.engine.device)

    def chunk_aggregate(self, ctx, lo, hi):
        # c_k' = c_k - c + (w_t - w_k) / (K_eff lr): the fused update's state rows with shift -c and coefficient
        # a_k = -1 / (K_eff lr) on (w_k - w_t)
        return dict(state_rows=ctx.rows[lo:hi], state_shift=-self.c, state_coef=self._coef(ctx, lo, hi))

    def upload_spec(self):
        """Private runs: c's increment, the sum over N of the clients' c_k' - c_k, clipped with their updates."""
        e = self.engine
        return {"increment": UploadSpec(cols=e.num_params, scale=1.0 / e.num_clients)}

    def upload_rows(self, ctx, lo, hi):
        e = self.engine
        delta = e.client_params(hi - lo) - e.global_flat
        return {"increment": torch.addcmul(-self.c, self._coef(ctx, lo, hi)[:, None], delta)}

    def collect(self, ctx, out, lo, hi):
        # c' = c + sum_k (c_k' - c_k) / K, accumulated over the chunks as increments; c_k' the clients' new rows.
        # Written (c + y) - c rather than y: the chunk's change rounded onto c's fp32 grid (the subtraction is exact
        # where c + y and c are within a factor of 2, Sterbenz), which is what the fused kernel returned (c + y)
        # before issue 29 made its terms generic; kept so that SCAFFOLD's runs stayed bit-identical across that change
        return Collected(
            rows=out["state_rows"], increment=(self.c + out["state_change"] * (1.0 / self.engine.num_clients)) - self.c
        )

    def server(self, ctx, avg):
        self.c = self.c + ctx.increment
        return super().server(ctx, avg)
