"""FedGKD and FedGKD-VOTE (Yao et al., "Local-Global Knowledge Distillation in Heterogeneous Federated Learning
with Non-IID Data"): distillation from the history of global models.

**FedGKD** (Eq. 4). The server keeps a FIFO buffer of the M latest global models ``w_t, ..., w_{t-M+1}`` (pushed
right after aggregation; ``w_0`` is never buffered). The teacher of round ``t+1`` is their *parameter* average
``wbar_t`` (one model; while fewer than M are buffered, the average of those present). Client loss per
minibatch::

    CE(z, y) + (gamma/2) * tau^2 * KL(softmax(z_wbar/tau) || softmax(z/tau))

The paper has no temperature; the code uses ``tau = 1`` and multiplies by ``tau^2``. ``gamma = 0.2`` (ResNet-8,
DistilBERT; 0.1 for ResNet-50), so the KL's coefficient is 0.1. M = 5 is the CV default (Table 7 sweeps 1/3/5/7;
the paper recommends M = 1 for NLP). Taken from the official code (CGCL-codes/FedGKD @72e7bac):
``pcode/workers/worker.py`` clips the gradient norm at 10 every step (``max_grad_norm`` defaults to 10 for these
methods) and ``worker_fedgkd.py`` skips distillation in round 1 (``comm_round <= 1``), when the teacher would
be ``w_0`` (``skip_first_round``). Aggregation follows the paper (``n_k``-weighted; the code averages uniformly:
``aggregate_weights = "uniform"`` reproduces it).

**FedGKD-VOTE** (Eq. 5). The teachers are the M buffered global models themselves, weighted by their loss
``L_m`` on a server-held validation split: ``g_m = lambda * softmax(-L / beta)_m`` with ``beta = 1/M``, so the
weights sum to ``lambda = 0.1`` (= FedGKD's ``gamma/2``)::

    CE(z, y) + tau^2 * sum_m g_m KL(softmax(z_m/tau) || softmax(z/tau))

Each buffered model's validation loss is computed once, right after it is aggregated. Round 1 has an empty
buffer and no KD. The validation split is the last ``val_fraction`` (10 %) of the training set, held out before
partitioning (the code's ``val_data_ratio = 0.1``, "origin" order); ``fedfast run`` does this, and a Python
user passes it as ``Simulation(..., val=...)`` (``FedGKDVote().hold_out(train)`` makes the split). The
engine caches the M-teacher mixture ``pbar = sum_m g_m p_m / lambda`` once per round: the gradient of
``sum_m g_m KL(p_m || q)`` equals that of ``lambda * KL(pbar || q)`` exactly, and the loss differs by the
constant ``sum_m g_m H(p_m) - lambda H(pbar)``, which the cached ``negent`` restores.

**FedGKD+** (§5.1, "we add the projection layer for FedGKD", to compare with MOON): FedGKD on a model with MOON's
projection head (``Linear(F, F) -> ReLU -> Linear(F, 256) -> Linear(256, C)``, as the code's ``projection_layer``;
:func:`fedfast.models.with_projection_head`), the distillation on the logits as in FedGKD.

Public-code quirks not reproduced (snapshot 72e7bac): with ``buffer_length <= 1`` the teacher is set once to
``w_0`` and never refreshed; the VOTE sum is computed under ``no_grad``. fedfast implements the paper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import nn as fnn
from ..models.head import with_projection_head
from .base import Method, TeacherSpec
from .hooks import cross_entropy
from .options import opt
from .registry import register

_CODE = "official code 72e7bac, pcode/workers/worker.py: clip_grad_norm 10 every step"


@register("fedgkd")
class FedGKD(Method):
    """FedGKD (Yao et al., Eq. 4): CE + gamma/2 * tau^2 * KL to the parameter average of the last M global models."""

    paper = (
        "Yao et al., Local-Global Knowledge Distillation in Heterogeneous Federated Learning with Non-IID Data, 2021"
    )
    max_grad_norm, max_grad_norm_source = 10.0, _CODE
    state = ("buf", "count", "avg")

    @dataclass
    class Options:
        gamma: float = opt(
            0.2,
            "KD coefficient gamma (Eq. 4; gamma/2 = 0.1 on the batch-mean KL; ResNet-8 and DistilBERT)",
            check=">=0",
        )
        buffer: int = opt(5, "M, the global models averaged into the teacher (CV default, Table 7)", check=">=1")
        tau: float = opt(1.0, "temperature (the code's default; the paper has none)", check=">0")
        tau_squared: bool = opt(True, "multiply the KL by tau^2 (code)")
        skip_first_round: bool = opt(True, "no KD in round 1, when the teacher is w_0 (code: worker_fedgkd.py)")

    def uses_teacher(self):
        return True

    def setup(self):
        o, e = self.opts, self.engine
        self.kd = fnn.GKDLoss(tau=o.tau, gamma=o.gamma, tau_squared=o.tau_squared, backend=e.backend)
        self.count = 0  # models in the buffer
        self.buf = torch.zeros(o.buffer, e.num_params, device=e.device) if self._buffered() else None
        self.avg = None  # the parameter average of the buffer (the teacher); None: the global model (M = 1)
        if self._buffered() and e.num_buffers:  # a BatchNorm model's running statistics beside each buffered
            self.buf_buffers = torch.zeros(o.buffer, e.num_buffers, device=e.device)  # model (the code averages
            self.avg_buffers = None  # whole state_dicts); absent without, so older checkpoints still resume

    def _buffered(self):
        return self.opts.buffer > 1

    def teacher(self, ctx):
        if self.opts.skip_first_round and ctx.index == 0:
            return None
        if self.avg is None:
            return TeacherSpec.of(self.engine.global_flat)
        return TeacherSpec.of(self.avg, getattr(self, "avg_buffers", None))

    def loss(self, ctx, b):
        if b.teacher is None:
            return cross_entropy(b, self.engine.backend)
        return self.kd(b.logits, b.teacher.logits, b.target, segments=b.segments, num_segments=b.num_clients)

    def server_terms(self, ctx):
        if self.buf is None:
            return {}
        self.count = min(self.count + 1, self.opts.buffer)  # push the new global into the ring buffer
        # the buffer of the last M global models is the fused update's ring: B[slot] = w_{t+1}, teacher = mean
        return dict(ring=self.buf, ring_slot=ctx.index % self.opts.buffer, ring_count=self.count)

    def after_server(self, ctx, out):
        if self.buf is not None:
            self.buf, self.avg = out["ring"], out["ring_mean"]
            self._push_buffers(ctx)

    def _push_buffers(self, ctx):
        """The new global model's buffers into their ring (the slot the fused update gave its parameters)."""
        if hasattr(self, "buf_buffers"):
            self.buf_buffers[ctx.index % self.opts.buffer] = self.engine.global_buffers
            self.avg_buffers = self.buf_buffers[: self.count].mean(0)


@register("fedgkd_plus")
class FedGKDPlus(FedGKD):
    """FedGKD+ (Yao et al., §5.1): FedGKD on a model with MOON's projection head (2-layer MLP, output 256)."""

    needs_classifier = True

    @dataclass
    class Options(FedGKD.Options):
        projection_dim: int = opt(
            256, "output of the projection head (§5.1 and the code's projection_layer: 256)", check=">=1"
        )

    def prepare_model(self, model, seed=0):
        return with_projection_head(model, self.opts.projection_dim, seed, classifier=self.classifier_name)


@register("fedgkd_vote")
class FedGKDVote(FedGKD):
    """FedGKD-VOTE (Yao et al., Eq. 5): CE + tau^2 * sum_m g_m KL(p_m || q), g = lambda * softmax(-L / beta) over
    the M buffered global models' losses on the server's validation split; no KD in round 1."""

    state = ("buf", "count", "val_loss")

    @dataclass
    class Options:
        lam: float = opt(0.1, "lambda, the sum of the teacher weights g_m (Eq. 5; = FedGKD's gamma/2)", check=">=0")
        buffer: int = opt(5, "M, the buffered global models used as teachers (5 on CV, 3 on NLP; Table 8)", check=">=1")
        beta: float | None = opt(None, "softmax temperature of -L (Eq. 5; None: 1/M)", check=">0")
        tau: float = opt(1.0, "KD temperature (code default)", check=">0")
        tau_squared: bool = opt(True, "multiply the KL by tau^2 (code)")
        val_fraction: float = opt(
            0.1,
            "the last fraction of the training set held out as the server's validation "
            "split (code: val_data_ratio 0.1)",
            check="(0,1)",
        )

    def resolve(self):
        if self.opts.beta is None:
            self.opts.beta = 1.0 / self.opts.buffer

    def _buffered(self):
        return True

    def hold_out(self, train, seed=0):
        cut = len(train) - max(1, int(round(len(train) * self.opts.val_fraction)))
        if cut < 1:
            raise ValueError(f"fedgkd_vote.val_fraction: leaves no training data ({len(train)} samples)")
        return train.subset(slice(0, cut)), {"val": train.subset(slice(cut, None))}

    def setup(self):
        o, e = self.opts, self.engine
        self.val = e.server_data("val")
        if self.val is None:
            raise ValueError(
                "val: FedGKD-VOTE needs a server-held validation split (Simulation(..., val=...); "
                "fedfast.methods.FedGKDVote().hold_out(train) makes one)"
            )
        self.kd = fnn.GKDLoss(tau=o.tau, gamma=2 * o.lam, tau_squared=o.tau_squared, backend=e.backend)
        self.count = 0
        self.buf = torch.zeros(o.buffer, e.num_params, device=e.device)
        self.val_loss = torch.zeros(o.buffer, device=e.device)
        self.avg = None
        if e.num_buffers:  # each buffered model's running statistics (absent without: older checkpoints resume)
            self.buf_buffers = torch.zeros(o.buffer, e.num_buffers, device=e.device)
            self.avg_buffers = None

    def teacher(self, ctx):
        if self.count == 0:
            return None  # round 1: no buffered global model yet, no KD (Eq. 5)
        w = torch.softmax(-self.val_loss[: self.count] / self.opts.beta, 0)
        bufs = getattr(self, "buf_buffers", None)
        return TeacherSpec(
            self.buf[: self.count], w, tau=self.opts.tau, buffers=None if bufs is None else bufs[: self.count]
        )

    def loss(self, ctx, b):
        if b.teacher is None:
            return cross_entropy(b, self.engine.backend)
        t = b.teacher
        return self.kd(
            b.logits,
            t.logits,
            b.target,
            teacher_weights=t.weights,
            mixture=t.mixture,
            segments=b.segments,
            num_segments=b.num_clients,
        )

    def after_server(self, ctx, out):
        self.buf = out["ring"]  # the teachers are the buffered models themselves
        self._push_buffers(ctx)
        g = out["global"]
        self.val_loss[ctx.index % self.opts.buffer] = F.cross_entropy(
            self.engine.predict(g, self.val).float(), self.val.y
        )
