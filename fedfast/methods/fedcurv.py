"""FedCurv (Shoham et al., "Overcoming Forgetting in Federated Learning on Non-IID Data", NeurIPS 2019 workshop on
federated learning), as run in FedNTD's code (Lee-Gihun/FedNTD @be00ee5, ``algorithms/fedcurv``), whose Table 1
reports it.

After its local training, client k estimates the diagonal of its Fisher information at its trained weights
``w_k`` and uploads it with the Fisher-weighted weights::

    u_k = (1/J) sum_{j=1..J} g_j * g_j,     v_k = u_k * w_k

``g_j`` the gradient of minibatch j's mean cross-entropy, over the client's minibatches in a fresh shuffled
order (train mode, augmented as in training: the code reuses the training loader), stopping after the first
minibatch that brings the count of samples above ``samples`` (J = min(minibatches, floor(samples / B) + 1)).
The server keeps every trained client's latest ``(u_k, v_k)`` and their sums ``U``, ``V``. Client k's local loss
adds the other clients' Fisher-weighted distance::

    lam * sum_{j != k} u_j * (w - w_j)^2  =  lam * (P_k . w^2 - 2 Q_k . w) + const,
    P_k = U - u_k,   Q_k = V - v_k            (u_k = v_k = 0 before the client first trains)

a loss-side gradient ``2 lam (P_k * w - Q_k)`` (before clipping; the fused client step's ``loss_rows``). Round 1
has no penalty (U = V = 0). Defaults ``lam = 1``, ``samples = 500``: FedNTD's Table 5 (searched over
{0.1, 0.5, 1} x {250, 500}) and ``config/fedcurv.json``.

Readings. The code squares minibatch-mean gradients (not per-sample ones); fedfast follows it. Public-code quirk
not reproduced: in ``Server._clients_training`` ``Pt = Ut`` then ``Pt -= u_k`` subtracts in place from ``Ut``,
so each client also loses the ``u`` of the round's earlier clients (an order-dependent sum); fedfast subtracts
only the client's own, as the paper's sum over ``j != k``.

Private runs (``dp_clip``): each client uploads its update and the changes ``u_k' - u_k``, ``v_k' - v_k`` of its
Fisher terms, clipped together (one norm over the three), and the server's ``U``, ``V`` take their noised sums;
``(u_k, v_k)`` stay the client's own, which its penalty subtracts from ``U``, ``V`` as before. The Fisher terms'
units (squared gradients) weigh against the update's in that norm as they come.

State: two parameter-sized rows per client ``[u_k | v_k]`` (``[K, 2P]``) plus ``U``, ``V`` [P]:
2 x K x P x 4 bytes. For the 100 clients of FedNTD's presets: 1.33 GB with the MNIST CNN (P = 1,663,370),
1.73 GB with the CIFAR-10 CNN (P = 2,156,490), 1.76 GB on CIFAR-100 (P = 2,202,660), and 3.45 GB for
CINIC-10's 200 clients; half with ``state_dtype = "bfloat16"``, in host memory with ``state_on_host``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from .._io import host_to_device
from .base import StateSpec, UploadSpec
from .fedavg import FedAvg
from .options import opt
from .registry import register
from .round import Collected

_CODE = "FedNTD Table 5; Lee-Gihun/FedNTD @be00ee5, config/fedcurv.json"


def fisher_batches(steps: np.ndarray, samples: int, batch_size: int) -> np.ndarray:
    """Minibatches in each client's Fisher estimate: up to and including the first that brings the sample count
    above ``samples`` (FedCurv's ``upload_local_fisher``), at most all of them."""
    return np.minimum(np.asarray(steps), samples // batch_size + 1)


@dataclass
class _Penalty:
    """FedCurv's per-chunk state: 2 lam P_k, -2 lam Q_k, the penalty-gradient buffer, then the Fisher u_k."""

    curv: torch.Tensor
    lin: torch.Tensor
    grad: torch.Tensor
    u: torch.Tensor | None = None


@register("fedcurv")
class FedCurv(FedAvg):
    """FedCurv (Shoham et al. 2019): local loss + lam sum_{j != k} u_j (w - w_j)^2, u_j the diagonal Fisher of
    client j at its trained weights w_j (FedNTD's code)."""

    uploads = "its Fisher information diagonals (U, V)"
    paper = "Shoham et al., Overcoming Forgetting in Federated Learning on Non-IID Data, NeurIPS 2019 FL workshop"
    accepts_asd = False
    state = ("U", "V")

    @dataclass
    class Options:
        lam: float = opt(1.0, f"penalty lambda ({_CODE}: lam 1.0)", check=">=0")
        samples: int = opt(500, f"samples in the Fisher estimate, s ({_CODE}: size 500)", check=">=0")

    def client_state_spec(self, engine):
        return StateSpec(rows=2)  # [u_k | v_k]

    def setup(self):
        e = self.engine
        self.U = torch.zeros(e.num_params, device=e.device)
        self.V = torch.zeros(e.num_params, device=e.device)

    def round_start(self, ctx):
        return {"U": torch.zeros_like(self.U), "V": torch.zeros_like(self.V)}  # the clients' changes of U and V

    def chunk_start(self, ctx, lo, hi):
        P, lam = self.engine.num_params, self.opts.lam
        rows = ctx.rows[lo:hi]
        curv = 2 * lam * (self.U - rows[:, :P])  # 2 lam P_k
        lin = -2 * lam * (self.V - rows[:, P:])  # -2 lam Q_k
        return _Penalty(curv, lin, torch.empty_like(curv))

    def step_terms(self, ctx, n_act):
        if not self.opts.lam:
            return {}
        ch = ctx.chunk
        theta = self.engine.client_params(n_act)
        # the penalty's gradient 2 lam (P_k w - Q_k) is a per-client loss term (clipped with the loss gradient)
        return dict(loss_rows=torch.addcmul(ch.lin[:n_act], ch.curv[:n_act], theta, out=ch.grad[:n_act]))

    def chunk_end(self, ctx, lo, hi):
        e = self.engine
        batches = fisher_batches(ctx.data_batches[lo:hi], self.opts.samples, e.batch_size)
        u = ctx.chunk.grad.zero_()  # reuse the penalty buffer: training is over
        for _, n_act, g in e.local_gradients(ctx, lo, hi, batches, epoch=ctx.epochs):
            u[:n_act].addcmul_(g, g)
        u /= host_to_device(batches, e.device, torch.float32)[:, None]
        return dataclasses.replace(ctx.chunk, u=u)

    def upload_spec(self):
        """Private runs: U's and V's increments, the clients' changes of u_k and v_k, clipped with their updates."""
        P = self.engine.num_params
        return {"U": UploadSpec(cols=P), "V": UploadSpec(cols=P)}

    def upload_rows(self, ctx, lo, hi):
        P = self.engine.num_params
        u, old = ctx.chunk.u, ctx.rows[lo:hi]
        return {"U": u - old[:, :P], "V": u * self.engine.client_params(hi - lo) - old[:, P:]}

    def collect(self, ctx, out, lo, hi):
        P = self.engine.num_params
        u, old = ctx.chunk.u, ctx.rows[lo:hi]
        v = u * self.engine.client_params(hi - lo)
        return Collected(rows=torch.cat([u, v], 1), sums={"U": (u - old[:, :P]).sum(0), "V": (v - old[:, P:]).sum(0)})

    def server(self, ctx, avg):
        self.U = self.U + ctx.sums["U"]
        self.V = self.V + ctx.sums["V"]
        return super().server(ctx, avg)
