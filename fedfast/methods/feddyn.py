"""FedDyn (Acar et al., ICLR 2021) in the "cloud model" form of its code (and of the ASD code).

State: per client ``h_k`` [P] (zero at the start), the server's ``hbar = (1/N) sum_{all k} h_k`` and the cloud
model ``w_cld`` (the model clients start from and distil from). Client k starts from ``w_cld`` and minimises::

    L_k(w) + alpha_k <w, h_k - w_cld> + (alpha_k / 2) ||w||^2

the last term as SGD weight decay ``alpha_k + weight_decay``; after training ``h_k += w_k - w_cld``. Server::

    avg = (1/|S_t|) sum_{k in S_t} w_k                    (uniform: the method's own averaging)
    hbar += (1/N) sum_{k in S_t} (w_k - w_cld)
    w_cld = avg + hbar

The evaluated (reported) model is ``avg``, as in both codes. ``alpha_k = alpha / s_k`` with ``s_k`` set by
``alpha_scaling``: ``"mean_size"`` (default, FedDyn's code: client sizes normalised to mean 1,
``s_k = n_k / mean_j n_j``; reproduces FedDyn's and FedADC's FedDyn numbers) or ``"minibatches"`` (the ASD
code, vcl-iisc/fed-adaptive-self-distillation @6cb4b68: ``s_k = n_k / B``, the raw number of minibatches;
reproduces ASD's Table 2 FedDyn and FedDyn+ASD rows). ``alpha = 0.01`` is the middle of the FedDyn/FedADC grid
{0.1, 0.01, 0.001}; FedNTD's code uses 0.1.

Private runs (``dp_clip``): the server's ``hbar`` takes the round's noised sum of clipped updates, the one the
average releases (``hbar += E (avg - w_cld) / N``: post-processing, no upload of its own); ``h_k`` stays the
client's own, unclipped. ``alpha_scaling = "mean_size"`` is refused there: it scales each client's regulariser by
the mean data size of all clients, a statistic of every client's data that the mechanism does not release.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import StateSpec, UploadSpec
from .fedavg import FedAvg
from .options import opt
from .registry import register
from .round import Collected


@dataclass
class _Linear:
    """FedDyn's per-chunk state: alpha_k and the linear term's gradient alpha_k (h_k - w_t)."""

    alpha: torch.Tensor
    dyn: torch.Tensor


@register("feddyn")
class FedDyn(FedAvg):
    """FedDyn (Acar et al. 2021; cloud form): loss + alpha_k <w, h_k - w_cld>, weight decay alpha_k + wd;
    h_k += w_k - w_cld; w_cld = mean_k w_k + hbar. The evaluated model is the participants' average."""

    uploads = "its unclipped model change w_k - g, summed into the server's state h"
    sgd_only = (
        "its regulariser enters the client step as SGD weight decay alpha + wd (FedDyn's code); fedfast "
        "defines FedDyn for SGD client steps only"
    )
    paper = "Acar et al., Federated Learning Based on Dynamic Regularization, ICLR 2021"
    aggregation, aggregation_fixed = "uniform", True
    state = ("hbar", "avg")

    @dataclass
    class Options:
        alpha: float = opt(0.01, "regulariser alpha (FedDyn/FedADC grid {0.1, 0.01, 0.001})", check=">=0")
        alpha_scaling: str = opt(
            "mean_size",
            "alpha_k = alpha / s_k: 'mean_size' (FedDyn code) or 'minibatches' (ASD code)",
            choices=("mean_size", "minibatches"),
        )

    def client_state_spec(self, engine):
        return StateSpec()  # h_k, zero before a client trains

    def setup(self):
        e = self.engine
        self.hbar = torch.zeros(e.num_params, device=e.device)
        self.avg = e.global_flat

    def coefficient(self) -> tuple[float, str]:
        """(alpha, its per-client scaling)."""
        return self.opts.alpha, self.opts.alpha_scaling

    def round_start(self, ctx):
        e = self.engine
        alpha, scaling = self.coefficient()
        sizes = torch.tensor(ctx.sizes, dtype=torch.float32, device=e.device)
        if scaling == "mean_size":
            s = sizes / float(e.client_sizes.mean())
        elif scaling == "minibatches":
            s = sizes / e.batch_size
        else:
            s = torch.ones_like(sizes)
        self.alpha_k = alpha / s

    def upload_spec(self):
        """Private runs: hbar's increment is the sum of the updates over N: the average's own noised sum."""
        if self.coefficient()[1] == "mean_size":
            raise ValueError(
                f"{self.table_name()}.alpha_scaling: 'mean_size' scales each client's regulariser by the mean data "
                f"size of all clients, which a private run does not release; use 'minibatches' (or 'none') under "
                f"dp_clip"
            )
        return {"increment": UploadSpec(cols=None, scale=1.0 / self.engine.num_clients)}

    def _h(self, rows):
        """The h_k columns of the state rows (a subclass may keep more per client after them)."""
        return rows if rows.shape[1] == self.engine.num_params else rows[:, : self.engine.num_params]

    def chunk_start(self, ctx, lo, hi):
        a = self.alpha_k[lo:hi]
        return _Linear(a, a[:, None] * (self._h(ctx.rows[lo:hi]) - self.engine.global_flat))

    def step_terms(self, ctx, n_act):
        ch = ctx.chunk
        # the linear term's gradient alpha_k (h_k - w_t) is a per-client loss term (clipped with the loss gradient)
        return dict(loss_rows=ch.dyn[:n_act], weight_decay=ch.alpha[:n_act] + self.engine.weight_decay)

    def chunk_aggregate(self, ctx, lo, hi):
        # h_k' = h_k + (w_k - w_t): the fused update's state rows with coefficient 1 and no shift
        return dict(state_rows=self._h(ctx.rows[lo:hi]).contiguous())

    def collect(self, ctx, out, lo, hi):
        # h_k' the clients' new rows; hbar' = hbar + sum_k (w_k - w_t) / K
        return Collected(rows=out["state_rows"], increment=out["state_change"] * (1.0 / self.engine.num_clients))

    def server(self, ctx, avg):
        self.hbar = self.hbar + ctx.increment
        self.avg = avg
        return avg + self.hbar

    def evaluated(self, global_flat):
        return self.avg
