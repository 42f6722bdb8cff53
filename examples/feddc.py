"""FedDC (Gao et al., "FedDC: Federated Learning with Non-IID Data via Local Drift Decoupling and Correction",
CVPR 2022) as a plug-in: a drift-correction method that is not built into fedfast, written with the fused ops'
generic terms and no kernel edit (the issue 29 check that the kernels speak maths, not methods).

Every client i keeps a local drift h_i and a gradient-correction state G_i; the server keeps G and the mean drift
over all clients. With w the global (cloud) model, the client trains on

    F_i(theta) + alpha_i / 2 ||theta - (w - h_i)||^2 + <theta, G / r_i - G_i>,      alpha_i = alpha / r_i,

r_i = n_i / mean_j n_j the client's relative data size, clipping the whole gradient at norm 10 and stepping with
plain SGD (weight decay coupled). Then, with Delta_i = theta_i - w and beta = 1 / (n_minibatch * lr):

    h_i  <- h_i + Delta_i
    G_i' =  G_i - G / r_i - beta Delta_i,            G <- G + (1/N) sum_i r_i (G_i' - G_i)
    w'   =  mean_i theta_i + (1/N) sum_{all j} h_j   (the plain mean over the round's clients; N all clients)

All of this follows the authors' code (github.com/gaoliang13/FedDC, utils_methods_FedDC.py and utils_general.py
``train_model_FedDC``): ``n_minibatch`` = epochs * ceil(mean client size / batch size) and ``lr`` the base learning
rate (not the decayed one), as there.

How it maps onto fedfast's generic terms (docs/methods.md):

* client step: the penalty's gradient alpha_i (theta - w + h_i) + G / r_i - G_i is a per-client ``loss_rows`` term
  (clipped with the loss gradient), recomputed from theta at every step;
* aggregate: h_i <- h_i + (theta_i - w) is a ``state_rows`` update with coefficient 1; its ``state_change`` is the
  round's sum of Delta_i, from which the mean drift over all clients follows;
* G_i' and the server's G are plain tensor arithmetic in ``collect`` and ``server``.

    fedfast run --plugin examples/feddc.py --set algorithm=feddc --set feddc.alpha=0.01
"""

from dataclasses import dataclass

import numpy as np
import torch

from fedfast._io import host_to_device
from fedfast.methods import Collected, FedAvg, StateSpec, opt, register

_CODE = "gaoliang13/FedDC, example_code_cifar10.py and utils_general.py"


@dataclass
class _Chunk:
    """FedDC's per-chunk state (returned by chunk_start, read back as ctx.chunk): r_i, alpha_i, the penalty
    gradient's theta-free part and its buffer."""

    r: torch.Tensor
    alpha: torch.Tensor
    lin: torch.Tensor
    grad: torch.Tensor


@register("feddc")
class FedDC(FedAvg):
    """FedDC (Gao et al., CVPR 2022): local drift h_i and gradient correction G_i; the global model is the mean of
    the round's clients plus the mean drift of all clients."""

    paper = (
        "Gao et al., FedDC: Federated Learning with Non-IID Data via Local Drift Decoupling and Correction, CVPR 2022"
    )
    aggregation = "uniform"  # w' = mean_i theta_i (np.mean over the selected clients in the code)
    aggregation_fixed = True
    max_grad_norm, max_grad_norm_source = 10.0, f"{_CODE}: clip_grad_norm_(max_norm=10) every step"
    sgd_only = "its correction beta = 1 / (n_minibatch lr) counts plain SGD steps (Gao et al. 2022)"

    @dataclass
    class Options:
        alpha: float = opt(0.01, f"alpha, the drift penalty's coefficient ({_CODE}: alpha_coef 1e-2)", check=">=0")

    def client_state_spec(self, engine):
        return StateSpec(rows=2)  # [h_i | G_i], zero before a client trains

    def setup(self):
        e = self.engine
        self.G = torch.zeros(e.num_params, device=e.device)
        self.hbar = torch.zeros(e.num_params, device=e.device)  # (1/N) sum over all clients of h_j
        sizes = np.asarray(e.client_sizes, dtype=np.float64)
        self.rel = sizes / sizes.mean()  # r_i = n_i / mean_j n_j (weight_list in the code)
        c = e.config
        self.n_minibatch = c.local_epochs * int(np.ceil(sizes.mean() / c.batch_size))

    def round_start(self, ctx):
        # the round's sums (collect adds to them; the engine sums them over chunks and ranks before server)
        return {
            "dh": torch.zeros_like(self.hbar),  # sum_i Delta_i
            "dG": torch.zeros_like(self.G),
        }  # sum_i r_i (G_i' - G_i)

    def chunk_start(self, ctx, lo, hi):
        e, P = self.engine, self.engine.num_params
        r = host_to_device(self.rel[ctx.sampled[lo:hi]], e.device, torch.float32)[:, None]
        rows = ctx.rows[lo:hi]
        alpha = self.opts.alpha / r
        # the theta-free part of the penalty's gradient: alpha_i (h_i - w) + G / r_i - G_i
        lin = alpha * (rows[:, :P] - e.global_flat) + (self.G / r - rows[:, P:])
        return _Chunk(r, alpha, lin, torch.empty_like(lin))  # handed back to the other hooks as ctx.chunk

    def step_terms(self, ctx, n_act):
        ch = ctx.chunk
        theta = self.engine.client_params(n_act)
        # + alpha_i theta: the whole penalty gradient as per-client loss rows, clipped with the loss gradient
        return dict(loss_rows=torch.addcmul(ch.lin[:n_act], ch.alpha[:n_act], theta, out=ch.grad[:n_act]))

    def chunk_aggregate(self, ctx, lo, hi):
        # h_i <- h_i + (theta_i - w): state rows with coefficient 1
        return dict(state_rows=ctx.rows[lo:hi, : self.engine.num_params].contiguous())

    def collect(self, ctx, out, lo, hi):
        e, P = self.engine, self.engine.num_params
        r, G_old = ctx.chunk.r, ctx.rows[lo:hi, P:]
        delta = e.client_params(hi - lo) - e.global_flat
        beta = 1.0 / (self.n_minibatch * e.config.lr)
        G_new = G_old - self.G / r - beta * delta
        # the clients' new rows [h_i' | G_i'], and their shares of the round's sums
        return Collected(
            rows=torch.cat([out["state_rows"], G_new], 1),
            sums={"dG": (r * (G_new - G_old)).sum(0), "dh": out["state_change"]},
        )

    def server(self, ctx, avg):
        N = self.engine.num_clients
        self.G = self.G + ctx.sums["dG"] / N
        self.hbar = self.hbar + ctx.sums["dh"] / N
        return avg + self.hbar
