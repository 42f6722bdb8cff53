"""FedADC and FedADC+ (Ozfatura, Ozfatura and Gündüz, "FedADC: Accelerated Federated Learning with Drift
Control"; extended version with FedADC+).

**FedADC** (Algorithm 3). The server keeps a momentum ``m_t`` [P] (``m_0 = 0``). Every local step of client i
adds the drift ``mbar = beta_local m_t / H_i``, ``H_i`` the client's own number of local steps this round
(``E * ceil(n_i / B)``; reading B7, so that each client adds exactly ``beta_local m_t`` over the round):

* ``order = "nesterov"`` (Alg. 3 lines 7-9, "red", consecutive): ``w <- w - lr mbar``, then the gradient at
  that point, ``w <- w - lr g``. fedfast runs it as the heavy-ball step on the sequence shifted by half a drift
  step (exact);
* ``order = "heavy_ball"`` (lines 10-11, "blue", simultaneous): ``w <- w - lr (g + mbar)``.

Server (lines 16-19), with the participants' *uniform* average ``avg`` (Alg. 1/3)::

    m_{t+1} = (w_t - avg) / lr + (beta_global - beta_local) m_t
    w_{t+1} = w_t - alpha lr m_{t+1}

With the paper's defaults ``beta_local = beta_global``, ``alpha = 1`` the server step is plain averaging and all
acceleration happens in the clients. FedADC uses no local momentum (set the engine's ``momentum = 0``, the
default); weight decay is part of ``g`` (B9).

**FedADC+** (§III, Eq. 6-9) replaces CE by ``(1 - lam) CE + lam tau^2 KL(phat || softmax(z/tau))`` with the
self-confidence target built from the client's label fractions ``gamma_c`` (``rho_c = gamma_c / max gamma``)::

    phat_c = (1 - rho_c) ptilde_c  (c != y),      phat_y = ptilde_y + sum_{c != y} rho_c ptilde_c

``ptilde = softmax(z_teacher / tau)``. Readings: the teacher is the frozen global model (``teacher =
"global"``, B1; ``"local"``: the student's own detached prediction, as in CS-KD); ``tau = 4`` and the ``tau^2``
factor follow CS-KD, whose KD loss the paper says it follows (B2, B3); ``lam = 0.35`` (§IV-C).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import nn as fnn
from .._io import host_to_device
from ..ops.client_step import drift_shift_
from .base import TeacherSpec
from .fedavg import FedAvg
from .options import opt
from .registry import register


@dataclass
class _Drift:
    """FedADC's per-chunk state: the drift beta_l m_t and each client's 1 / H_k."""

    drift: torch.Tensor
    inv_h: torch.Tensor


@register("fedadc")
class FedADC(FedAvg):
    """FedADC (Ozfatura et al., Alg. 3): each local step adds the drift beta_l m_t / H_i; server m' = D/lr +
    (beta_g - beta_l) m, w' = w - alpha lr m' (uniform average)."""

    sgd_only = "its drift term is a correction of the SGD (momentum) step (Ozfatura et al. 2021)"
    paper = (
        "Ozfatura, Ozfatura and Gündüz, FedADC: Accelerated Federated Learning with Drift Control, ISIT 2021 / extended"
    )
    aggregation = "uniform"
    accepts_asd = False
    state = ("m",)

    @dataclass
    class Options:
        beta: float = opt(
            0.9, "beta_local, the drift's momentum share (grid {0.6, 0.7, 0.8, 0.9}, §IV-B)", check="[0,1]"
        )
        beta_global: float | None = opt(None, "beta_global (None: = beta, the paper's default)", check="[0,1]")
        alpha: float = opt(1.0, "server step scale alpha (Alg. 3 line 19; 1 as in SlowMo)", check=">0")
        order: str = opt(
            "nesterov",
            "'nesterov' (red, Alg. 3 lines 7-9) or 'heavy_ball' (blue, lines 10-11)",
            choices=("nesterov", "heavy_ball"),
        )

    def resolve(self):
        if self.opts.beta_global is None:
            self.opts.beta_global = self.opts.beta

    def setup(self):
        self.m = torch.zeros(self.engine.num_params, device=self.engine.device)

    def chunk_start(self, ctx, lo, hi):
        e = self.engine
        drift = self.opts.beta * self.m
        inv_h = host_to_device(1.0 / (ctx.steps[lo:hi] * ctx.epochs), e.device, torch.float32)
        if self.opts.order == "nesterov":  # the heavy-ball step on the sequence shifted by one drift half-step
            drift_shift_(e.client_params(hi - lo), drift, ctx.lr * inv_h, sign=-1.0)
        return _Drift(drift, inv_h)

    def step_terms(self, ctx, n_act):
        # the drift beta_l m_t / H_k is a step offset outside the momentum buffer: u = beta_l m_t, o_k = 1 / H_k
        return dict(step_vec=ctx.chunk.drift, step_vec_scale=ctx.chunk.inv_h[:n_act])

    def chunk_end(self, ctx, lo, hi):
        if self.opts.order == "nesterov":
            drift_shift_(self.engine.client_params(hi - lo), ctx.chunk.drift, ctx.lr * ctx.chunk.inv_h, sign=+1.0)

    def server_terms(self, ctx):
        o = self.opts
        return dict(beta=o.beta_global - o.beta, scale=1.0 / ctx.lr, lr=o.alpha * ctx.lr, momentum=self.m)

    def after_server(self, ctx, out):
        self.m = out["momentum"]


@register("fedadc_plus")
class FedADCPlus(FedADC):
    """FedADC+ (Eq. 6-9): FedADC with (1 - lam) CE + lam tau^2 KL(phat || q), phat the self-confidence target
    built from the teacher (global model, or the student's own prediction) and the client's label histogram."""

    @dataclass
    class Options(FedADC.Options):
        lam: float = opt(0.35, "lambda of Eq. 7 (§IV-C)", check="[0,1]")
        tau: float = opt(4.0, "temperature (CS-KD's default, which the paper follows; reading B2)", check=">0")
        tau_squared: bool = opt(True, "multiply the KL by tau^2 (CS-KD; reading B3)")
        teacher: str = opt(
            "global",
            "ptilde from the frozen 'global' model (reading B1) or the student's own detached prediction ('local')",
            choices=("global", "local"),
        )

    def uses_teacher(self):
        return self.opts.teacher == "global"

    def setup(self):
        super().setup()
        o = self.opts
        self.kd = fnn.ADCLoss(tau=o.tau, lam=o.lam, tau_squared=o.tau_squared, backend=self.engine.backend)

    def teacher(self, ctx):
        return TeacherSpec.of(self.engine.global_flat) if self.opts.teacher == "global" else None

    def loss(self, ctx, b):
        t = b.teacher.logits if b.teacher is not None else b.logits.detach()
        return self.kd(b.logits, t, b.target, b.hist, segments=b.segments, num_segments=b.num_clients)
