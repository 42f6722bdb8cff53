"""Federated methods as four small parts (../shared/spec/architecture.md): the client loss, the terms the fused
client step adds, the server rule, and the state the method keeps. :class:`fedfast.engine.Simulation` calls
these hooks and never branches on a method's name; a new method is a subclass registered in ``METHODS``.

Every hook works on all of a round's clients at once (rows of the stack, in the round's sorted order):
``ctx`` (:class:`Round`) carries the round's sampled clients, their sizes and step counts, the learning rate,
their label histograms, and the method's per-client state rows. Formulas: ../shared/spec/methods-*.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from . import nn as fnn
from . import ops
from .flat import classifier_of, host_to_device
from .ops.client_step import drift_shift_


@dataclass
class Round:
    """One round's data in stack order (this rank's clients under torch.distributed)."""
    sampled: np.ndarray              # client ids
    sizes: np.ndarray                # local data sizes
    steps: np.ndarray                # local steps per epoch
    lr: float
    sampled_t: torch.Tensor
    hist: torch.Tensor               # [m, C] label histograms (ASD prior, FedADC+ confidence)
    rows: torch.Tensor | None = None  # [m, P] per-client state rows (SCAFFOLD c_k, FedDyn h_k, MOON previous models)
    new_rows: torch.Tensor | None = None  # their updated values, filled chunk by chunk
    incr: torch.Tensor | None = None  # server-state increment summed over the chunks (SCAFFOLD, FedDyn)
    chunk: dict = field(default_factory=dict)  # per-chunk values (FedDyn linear term, FedADC drift)


class Algorithm:
    """FedAvg (McMahan et al.): CE loss, SGD client step, size-weighted average. The base of every method.

    Hooks, in the order the engine calls them: ``setup`` (once), ``round_start`` (per round),
    ``chunk_start`` / ``step_terms`` (per local step) / ``chunk_end``, ``chunk_aggregate`` and ``collect``
    (per chunk, the fused server update of its rows), ``server`` (per round, on the participants' average).
    """
    kd_kind: str | None = None      # None: plain CE; "full" / "not_true": CE + KD of that kind
    teacher: str | None = None      # None, "global" (the received global model), "gkd" (FedGKD average), "vote"
    state_rows: bool = False        # keeps one [P] row per client (gathered each round)
    needs_features: bool = False    # the loss uses the representation (input of the classifier)

    def __init__(self, sim):
        self.sim, self.cfg = sim, sim.cfg

    @classmethod
    def teacher_for(cls, cfg) -> str | None:
        """Which teacher the method distils from under ``cfg`` (None: no teacher)."""
        return cls.teacher

    # -- state ---------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Allocate the method's server and client state (``sim.global_flat`` is set)."""

    def round_start(self, ctx: Round) -> None:
        """Per-round server-side values (class weights, per-client coefficients)."""

    # -- client loss ---------------------------------------------------------------------------------
    def kd_weight(self) -> float:
        return 0.0

    def loss(self, z, t, y, seg, n_act, hist):
        """The fused loss over all active clients' rows: sum of per-client minibatch means."""
        c = self.cfg
        if c.asd:  # ASD replaces the method's KD term: CE_mean + lam * sum_i alpha_i KL_i
            nt = c.asd_not_true if c.asd_not_true is not None else self.kd_kind == "not_true"
            loss = fnn.ASDLoss(tau=c.tau, lam=c.lam, not_true=nt, entropy_tau=c.asd_entropy_tau, backend=c.backend)
            return loss(z, t, y, hist / hist.sum(1, keepdim=True), segments=seg, num_segments=n_act)
        if t is None:
            t = torch.zeros_like(z.detach())
        return ops.distill(z, t, y, kind=self.kd_kind or "full", tau=c.tau, kd_weight=self.kd_weight(),
                           segments=seg, num_segments=n_act, reduction="mean", backend=c.backend)

    def extra_loss(self, ctx: Round, feat, x, valid, n_act):
        """A term added to the loss that needs more than logits (MOON); None if none."""
        return None

    # -- client step ----------------------------------------------------------------------------------
    def chunk_start(self, ctx: Round, lo: int, hi: int) -> None:
        """Before the local steps of the chunk's clients (stack rows 0..hi-lo hold the global model)."""

    def step_terms(self, ctx: Round, n_act: int) -> dict:
        """Extra keyword arguments of :func:`fedfast.ops.client_step` for the active prefix."""
        return {}

    def chunk_end(self, ctx: Round, lo: int, hi: int) -> None:
        """After the chunk's last local step."""

    # -- server ---------------------------------------------------------------------------------------
    def chunk_aggregate(self, ctx: Round, lo: int, hi: int) -> dict:
        """Extra arguments of :func:`fedfast.ops.aggregate` for the chunk's rows (per-client state)."""
        return {}

    def collect(self, ctx: Round, out: dict, lo: int, hi: int) -> None:
        """Keep the chunk's per-client results (new state rows, server-state increments)."""

    def server_terms(self, ctx: Round) -> dict:
        """Server-rule arguments of :func:`fedfast.ops.aggregate` (momentum, teacher buffer)."""
        return {}

    def server(self, ctx: Round, avg: torch.Tensor) -> None:
        """The new global model from the participants' average ``avg``: one fused call on a single row."""
        sim = self.sim
        out = ops.aggregate(avg[None], sim.global_flat, rows=1, backend=self.cfg.backend, **self.server_terms(ctx))
        sim.global_flat = sim.average_flat = sim.teacher_flat = out["global"]
        self.after_server(ctx, out)

    def after_server(self, ctx: Round, out: dict) -> None:
        """Read the updated server state from the fused call's outputs."""


class FedProx(Algorithm):
    """FedProx (Li et al.): + (mu/2)||w - w_t||^2; the term lives in the client step (``prox_mu``), which every
    method gets from ``mu``; this class exists for the name and its default mu = 0.1."""


class KD(Algorithm):
    """Hinton KD to the received global model: CE + kd_weight * tau^2 * KL(p_t || q_s)."""
    kd_kind, teacher = "full", "global"

    def kd_weight(self):
        return self.cfg.kd_weight * self._s()

    def _s(self):
        return self.cfg.tau ** 2 if self.cfg.tau_squared else 1.0


class FedNTD(KD):
    """FedNTD (Lee et al. 2022, Eq. 10-11): CE + beta * tau^2 * KL over the not-true classes."""
    kd_kind = "not_true"

    def kd_weight(self):
        return self.cfg.beta * self._s()


class FedGKD(KD):
    """FedGKD (Yao et al.): CE + gamma/2 * tau^2 * KL to the parameter average of the last M global models."""
    teacher = "gkd"

    def kd_weight(self):
        return self.cfg.gamma / 2 * self._s()

    def setup(self):
        sim, M = self.sim, self.cfg.gkd_buffer
        sim.gkd_count = 0
        if M > 1 or type(self) is not FedGKD:
            sim.gkd_buffer = torch.zeros(M, sim.stack.P, device=sim.device)
            sim.val_loss = torch.zeros(M, device=sim.device)

    def server_terms(self, ctx):
        sim, M = self.sim, self.cfg.gkd_buffer
        if not hasattr(sim, "gkd_buffer"):
            return {}
        sim.gkd_count = min(sim.gkd_count + 1, M)  # push the new global into the ring buffer
        return dict(teacher_buffer=sim.gkd_buffer, teacher_slot=sim.rnd % M, teacher_count=sim.gkd_count)

    def after_server(self, ctx, out):
        if "teacher_buffer" in out:
            self.sim.gkd_buffer = out["teacher_buffer"]
            self.sim.teacher_flat = out["teacher"]


class FedGKDVote(FedGKD):
    """FedGKD-VOTE (Yao et al., Eq. 5): CE + tau^2 * sum_m g_m KL(p_m || q), g = lambda * softmax(-L / beta) over
    the buffered globals' losses on the server's validation split; no KD in round 1 (empty buffer)."""
    teacher = "vote"

    def setup(self):
        if self.sim.val is None:
            raise ValueError("val: FedGKD-VOTE needs a server-held validation split (Simulation(..., val=...))")
        super().setup()

    def loss(self, z, t, y, seg, n_act, hist):
        c = self.cfg
        kw = dict(segments=seg, num_segments=n_act, reduction="mean", backend=c.backend)
        s = c.tau ** 2 if c.tau_squared else 1.0
        if t is None:
            return ops.distill(z, torch.zeros_like(z.detach()), y, kd_weight=0.0, **kw)
        if isinstance(t, tuple):  # cached mixture (weights normalised, lambda as the KD weight)
            return ops.distill(z, None, y, tau=c.tau, kd_weight=c.vote_lambda * s, mixture=t, **kw)
        return ops.distill(z, t, y, tau=c.tau, kd_weight=c.vote_lambda * s, teacher_weights=self.sim._vote_weights(),
                           **kw)

    def after_server(self, ctx, out):
        sim = self.sim
        sim.gkd_buffer = out["teacher_buffer"]  # the teacher is the buffer itself, weighted by validation loss
        sim.val_loss[sim.rnd % self.cfg.gkd_buffer] = sim._val_loss(sim.global_flat)


class FedCAD(KD):
    """FedCAD (He et al., Eq. 5-6): per row (1 - a_y) CE + a_y soft-CE at tau, a_y = beta + (gamma - beta) *
    mean over the server's auxiliary samples of class y of the global model's p_y (recomputed each round)."""

    def setup(self):  # server-held auxiliary data: given (sim.aux), or cad_aux_per_class per class of the training set
        from .data.partition import per_class_sample
        sim, c = self.sim, self.cfg
        if sim.aux is not None:
            sim.cad_aux_ds, sim.cad_aux = sim.aux, torch.arange(len(sim.aux), device=sim.device)
        else:
            sim.cad_aux_ds = sim.train
            sim.cad_aux = per_class_sample(sim.train.y.cpu(), c.cad_aux_per_class, c.seed + 7919).to(sim.device)

    def round_start(self, ctx):
        self._alpha = self.sim._cad_alpha()

    def loss(self, z, t, y, seg, n_act, hist):
        c = self.cfg
        return ops.distill(z, t, y, kind="full", tau=c.tau, soft_ce=True, class_alpha=self._alpha,
                           kd_weight=c.tau ** 2 if c.cad_tau_squared else 1.0, segments=seg, num_segments=n_act,
                           reduction="mean", backend=c.backend)


class FedAvgM(Algorithm):
    """FedAvgM (Hsu et al.): v <- beta v + (theta - avg); theta <- theta - server_lr * v."""

    def setup(self):
        self.sim.server_m = torch.zeros(self.sim.stack.P, device=self.sim.device)

    def server_terms(self, ctx):
        return dict(beta=self.cfg.server_momentum, lr=self.cfg.server_lr, momentum=self.sim.server_m)

    def after_server(self, ctx, out):
        self.sim.server_m = out["momentum"]


class _StateRows(Algorithm):
    state_rows = True

    def setup(self):
        self.sim.client_state = self.sim._client_state(self.sim.stack.P)
        self.sim.server_state = torch.zeros(self.sim.stack.P, device=self.sim.device)


class Scaffold(_StateRows):
    """SCAFFOLD (Karimireddy et al.; FedNTD code): local steps use g + c - c_k; c_k' = c_k - c + (w_t - w_k) /
    (K_eff lr) with K_eff counting local momentum; c' = c + (1/K) sum (c_k' - c_k)."""

    def step_terms(self, ctx, n_act):
        return dict(scaffold_c=self.sim.server_state, scaffold_ck=ctx.chunk["rows"][:n_act])

    def chunk_start(self, ctx, lo, hi):
        ctx.chunk["rows"] = ctx.rows[lo:hi]

    def chunk_aggregate(self, ctx, lo, hi):
        Kst = torch.tensor(ctx.steps[lo:hi] * self.cfg.local_epochs, dtype=torch.float64)
        rho = self.cfg.momentum
        k_eff = (Kst - rho * (1 - rho ** Kst) / (1 - rho)) / (1 - rho) if rho > 0 else Kst
        return dict(scaffold_c=self.sim.server_state, scaffold_ck=ctx.rows[lo:hi],
                    scaffold_coef=(1.0 / (k_eff * ctx.lr)).float().to(self.sim.device),
                    scaffold_num_clients=self.sim.K)

    def collect(self, ctx, out, lo, hi):
        ctx.incr += out["scaffold_c"] - self.sim.server_state
        ctx.new_rows[lo:hi] = out["scaffold_ck"]

    def server(self, ctx, avg):
        self.sim.server_state = self.sim.server_state + ctx.incr
        super().server(ctx, avg)


class FedDyn(_StateRows):
    """FedDyn (Acar et al.; the cloud form of the ASD/FedDyn code): loss + alpha_k <w, h_k - w_cld> with SGD
    weight decay alpha_k + wd, alpha_k = dyn_alpha / (n_k / mean n); h_k += w_k - w_cld; hbar += (1/K) sum
    (w_k - w_cld); w_cld' = mean_k w_k + hbar'. The evaluated model is the participants' average."""

    def round_start(self, ctx):
        mean_n = float(self.sim._hist.sum(1).mean())
        self._alpha = self.cfg.dyn_alpha / (torch.tensor(ctx.sizes, dtype=torch.float32, device=self.sim.device)
                                            / mean_n)

    def chunk_start(self, ctx, lo, hi):
        a = self._alpha[lo:hi]
        ctx.chunk.update(alpha=a, dyn=a[:, None] * (ctx.rows[lo:hi] - self.sim.global_flat))

    def step_terms(self, ctx, n_act):
        ch = ctx.chunk
        return dict(dyn_linear=ch["dyn"][:n_act], weight_decay=ch["alpha"][:n_act] + self.cfg.weight_decay)

    def chunk_aggregate(self, ctx, lo, hi):
        return dict(dyn_h=ctx.rows[lo:hi], dyn_hbar=self.sim.server_state, dyn_num_clients=self.sim.K)

    def collect(self, ctx, out, lo, hi):
        ctx.incr += out["dyn_hbar"] - self.sim.server_state
        ctx.new_rows[lo:hi] = out["dyn_h"]

    def server(self, ctx, avg):
        sim = self.sim
        sim.server_state = sim.server_state + ctx.incr
        sim.average_flat = avg
        sim.global_flat = sim.teacher_flat = avg + sim.server_state


class FedADC(FedAvgM):
    """FedADC (Ozfatura et al., Alg. 3): each local step adds the drift beta_l m_t / H_k (H_k: the client's steps
    in the round); "nesterov" applies it before the gradient, "heavy_ball" with it. Server: m' = D/eta +
    (beta_g - beta_l) m, theta' = theta - alpha eta m' (uniform average by default)."""

    def chunk_start(self, ctx, lo, hi):
        c = self.cfg
        drift = c.adc_beta * self.sim.server_m
        inv_h = host_to_device(1.0 / (ctx.steps[lo:hi] * c.local_epochs), self.sim.device, torch.float32)
        ctx.chunk.update(drift=drift, inv_h=inv_h)
        if c.adc_order == "nesterov":  # the heavy-ball step on the sequence shifted by one drift half-step
            drift_shift_(self.sim.stack.params[:hi - lo], drift, ctx.lr * inv_h, sign=-1.0)

    def step_terms(self, ctx, n_act):
        return dict(drift=ctx.chunk["drift"], drift_scale=ctx.chunk["inv_h"][:n_act])

    def chunk_end(self, ctx, lo, hi):
        if self.cfg.adc_order == "nesterov":
            drift_shift_(self.sim.stack.params[:hi - lo], ctx.chunk["drift"], ctx.lr * ctx.chunk["inv_h"], sign=+1.0)

    def server_terms(self, ctx):
        c = self.cfg
        return dict(beta=c.adc_beta_global - c.adc_beta, scale=1.0 / ctx.lr, lr=c.adc_alpha * ctx.lr,
                    momentum=self.sim.server_m)


class FedADCPlus(FedADC):
    """FedADC+ (Eq. 6-9): FedADC with (1 - lam) CE + lam tau^2 KL(phat || q), phat the self-confidence target
    built from the teacher (global model, or the student's own prediction) and the client's label histogram."""
    kd_kind, teacher = "full", "global"

    @classmethod
    def teacher_for(cls, cfg):
        return "global" if cfg.adc_teacher == "global" else None

    def loss(self, z, t, y, seg, n_act, hist):
        c = self.cfg
        return fnn.ADCLoss(tau=c.tau, lam=c.adc_lam, tau_squared=c.tau_squared, backend=c.backend)(
            z, t if t is not None else z.detach(), y, hist, segments=seg, num_segments=n_act)


class MOON(_StateRows):
    """MOON (Li et al. 2021): CE + mu * -log(e^{cos(z, z_g)/T} / (e^{cos(z, z_g)/T} + e^{cos(z, z_prev)/T})),
    z the input of the classifier; z_g from the global model, z_prev from the client's previous local model
    (the initial global model before its first round)."""
    needs_features = True

    def setup(self):
        sim = self.sim
        sim.client_state = sim._client_state(sim.stack.P)
        sim.client_state.data.copy_(sim.global_flat.expand(sim.K, sim.stack.P))
        sim.classifier = classifier_of(sim.model)

    def chunk_start(self, ctx, lo, hi):
        ctx.chunk["rows"] = ctx.rows[lo:hi]

    def extra_loss(self, ctx, feat, x, valid, n_act):
        sim, c = self.sim, self.cfg
        sim.model.eval()  # the global and previous models are frozen references: no dropout, as a teacher
        with torch.no_grad():
            zg, _ = sim._flat_forward(sim.global_flat, x.reshape(-1, *x.shape[2:]), features=sim.classifier)
            zp, _ = sim.stack.vmap_forward(x, rows=slice(0, n_act), features=sim.classifier,
                                           params=sim.stack.layout.param_views(ctx.chunk["rows"][:n_act]))
        sim.model.train()
        f = feat.reshape(-1, feat.shape[-1])
        logits = torch.stack([F.cosine_similarity(f, zg.reshape(f.shape), dim=-1),
                              F.cosine_similarity(f, zp.reshape(f.shape), dim=-1)], 1) / c.moon_tau
        lcon = torch.logsumexp(logits, 1) - logits[:, 0]
        v = valid.float()
        w = (v / v.sum(1, keepdim=True).clamp_min(1)).reshape(-1)
        return c.moon_mu * (lcon * w).sum()

    def collect(self, ctx, out, lo, hi):
        ctx.new_rows[lo:hi] = self.sim.stack.params[:hi - lo]


METHODS = {"fedavg": Algorithm, "fedprox": FedProx, "kd": KD, "fedntd": FedNTD, "fedgkd": FedGKD,
           "fedgkd_vote": FedGKDVote, "fedcad": FedCAD, "fedavgm": FedAvgM, "scaffold": Scaffold, "feddyn": FedDyn,
           "fedadc": FedADC, "fedadc_plus": FedADCPlus, "moon": MOON}
