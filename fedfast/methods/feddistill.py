"""FedDistill+ (Seo et al., "Federated Knowledge Distillation", 2020, with parameter sharing), as FedGKD defines and
runs it (Yao et al. §5.1; CGCL-codes/FedGKD @72e7bac, ``pcode/workers/worker_feddistill.py`` and
``pcode/masters/master_feddistill.py``): clients share their per-label mean logits besides their parameters.

During local training client k tracks the logits its model produces on its training minibatches, per label::

    S_k[c] = sum of the logit vectors z of its samples with label c (all local steps of the round)
    A_k[c] = S_k[c] / (1 + n_c)         (the code's counts start at 1: classes it lacks give a zero row)

and uploads ``A_k`` [C, C]. The server keeps every client's latest ``A_k`` (zeros before its first round) and
sends client k the mean of the others' over all K clients, ``G_k = (sum_j A_j - A_k) / (K - 1)``. Client k's loss
adds, per sample with label y::

    coef * tau^2 * KL(softmax(G_k[y] / tau) || softmax(z / tau))        (batch mean; no term in round 1)

and the parameters are averaged as in FedAvg. ``coef = 0.1`` (FedGKD §5.1: "coefficient 0.1"; the code's
``distillation_coefficient``), ``tau = 1`` (the code's default; the paper's sentence on the temperature is garbled).

Readings. Public-code quirks not reproduced: the worker receives the global logits into a ``.clone()`` of its
buffer, so its teacher stays all-zero (a uniform target); and its tracker is never reset, so it accumulates over
every client and round the worker process simulated. fedfast implements the intended method: the client's own
logits of the round, the others' means as the target. On a SAM step the tracked logits are the first pass's.
State: ``A_k`` [C, C] per client in the per-client state store (``client_state``: rows for the clients that
trained, zeros read for the others; 40 KB a client of CIFAR-100); ``sum_j A_j`` is the store's mean times K.

Private runs (``dp_clip``): the store's rows are the clients' own; the server keeps only a running sum of their
uploads instead, each client's change ``A_k' - A_k`` clipped together with its update (one norm over both) and
noised, ``dp_total``, and client k's target is ``(dp_total - A_k) / (K - 1)`` (its own ``A_k`` subtracted on its
side).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import nn as fnn
from .base import StateSpec, UploadSpec
from .fedavg import FedAvg
from .hooks import cross_entropy
from .options import opt
from .registry import register
from .round import Collected

_CODE = "CGCL-codes/FedGKD @72e7bac, worker_feddistill.py"


@dataclass
class _Logits:
    """FedDistill+'s per-chunk state: each (client, label)'s logit sum and count this round, and its targets."""

    sum: torch.Tensor
    count: torch.Tensor
    target: torch.Tensor


@register("feddistill_plus")
class FedDistillPlus(FedAvg):
    """FedDistill+ (Seo et al. 2020, as FedGKD runs it): CE + coef tau^2 KL(softmax(G_k[y]/tau) || softmax(z/tau)),
    G_k the other clients' per-label mean logits; parameters averaged."""

    uploads = "its per-label mean logits"
    paper = "Seo et al., Federated Knowledge Distillation, 2020 (FedDistill+, with parameter sharing, as Yao et al.)"
    max_grad_norm, max_grad_norm_source = 10.0, "CGCL-codes/FedGKD @72e7bac, pcode/workers/worker.py: clip 10"
    accepts_asd = False

    @dataclass
    class Options:
        coef: float = opt(0.1, f"distillation coefficient (FedGKD §5.1: 0.1; {_CODE})", check=">=0")
        tau: float = opt(1.0, f"temperature ({_CODE}: conf.temperature, default 1)", check=">0")
        tau_squared: bool = opt(True, f"multiply the KL by tau^2 ({_CODE})")
        skip_first_round: bool = opt(True, f"no distillation in round 1 ({_CODE}: comm_round <= 1)")

    def client_state_spec(self, e):
        return StateSpec(cols=e.num_classes**2)  # A_k [C * C]: every client's latest upload (zeros before)

    def setup(self):
        e, o = self.engine, self.opts
        self.kd = fnn.KDLoss(tau=o.tau, kd_weight=o.coef, tau_squared=o.tau_squared, backend=e.backend)
        if e.private:  # private: the server's noised running sum of the clients' A_j
            self.dp_total = torch.zeros(e.num_classes**2, device=e.device)

    def round_start(self, ctx):
        if hasattr(self, "dp_total"):
            self.total = self.dp_total
            return {"A": torch.zeros_like(self.dp_total)}  # the round's noised sum of the clients' changes
        self.total = self.client_state.mean() * self.engine.num_clients  # sum_j A_j [C * C]

    def upload_spec(self):
        """Private runs: each client's change of its per-label mean logits, clipped with its update."""
        return {"A": UploadSpec(cols=self.engine.num_classes**2)}

    def upload_rows(self, ctx, lo, hi):
        C = self.engine.num_classes
        return {"A": (ctx.chunk.sum / ctx.chunk.count[:, None]).reshape(hi - lo, C * C) - ctx.rows[lo:hi]}

    def server(self, ctx, avg):
        if hasattr(self, "dp_total"):
            self.dp_total = self.dp_total + ctx.sums["A"]
        return super().server(ctx, avg)

    def chunk_start(self, ctx, lo, hi):
        C, n, K = self.engine.num_classes, hi - lo, self.engine.num_clients
        target = (self.total - ctx.rows[lo:hi]) / max(K - 1, 1)  # G_k = (sum_j A_j - A_k) / (K - 1); ctx.rows: A_k
        return _Logits(
            torch.zeros(n * C, C, device=self.engine.device),
            torch.ones(n * C, device=self.engine.device),
            target.reshape(n * C, C),
        )

    def loss(self, ctx, b):
        C = self.engine.num_classes
        row = b.segments * C + b.target.clamp_min(0)  # (client, label) of every row; padding rows weigh 0
        if not b.perturbed:
            w = (b.target >= 0).float()
            ctx.chunk.sum.index_add_(0, row, b.logits.detach() * w[:, None])
            ctx.chunk.count.index_add_(0, row, w)
        if self.opts.skip_first_round and ctx.index == 0:
            return cross_entropy(b, self.engine.backend)
        return self.kd(b.logits, ctx.chunk.target[row], b.target, segments=b.segments, num_segments=b.num_clients)

    def collect(self, ctx, out, lo, hi):
        C = self.engine.num_classes
        avg = ctx.chunk.sum / ctx.chunk.count[:, None]
        return Collected(rows=avg.reshape(hi - lo, C * C))  # the engine stores them after the round
