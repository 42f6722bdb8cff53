"""FedAvg, FedProx and FedAvgM: the plain-SGD baselines.

* **FedAvg** (McMahan et al. 2017): each sampled client starts from the global model ``w_t``, runs local SGD on
  the cross-entropy, and the server averages: ``w_{t+1} = sum_k n_k w_k / sum_k n_k`` (``aggregate_weights =
  "uniform"``: ``1/|S_t|``).
* **FedProx** (Li et al., MLSys 2020): the local objective adds ``(mu/2) ||w - w_t||^2``; its gradient
  ``mu (w - w_t)`` is a term of the fused client step (``prox_mu``, ``anchor = w_t``). ``mu = 0.1`` is the value
  FedNTD's Table 5 chose from {0.1, 0.5, 1.0} (FedGKD uses 0.01 on CIFAR-10 and 0.001 on CIFAR-100; FedADC
  searches {0.1, 0.01, 0.001}).
* **FedAvgM** (Hsu et al. 2019; SlowMo): server momentum on the pseudo-gradient ``d = w_t - avg``:
  ``v <- beta v + d``, ``w_{t+1} = w_t - server_lr * v``; ``v_0 = 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Method
from .hooks import graph_safe
from .options import opt
from .registry import register


@register("fedavg")
class FedAvg(Method):
    """FedAvg (McMahan et al. 2017): CE, local SGD, size-weighted average of the participants' models."""

    accepts_asd = True


@register("fedprox")
class FedProx(FedAvg):
    """FedProx (Li et al. 2020): CE + (mu/2)||w - w_t||^2, the proximal gradient applied in the fused client step."""

    paper = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020"

    @dataclass
    class Options:
        mu: float = opt(0.1, "proximal coefficient (FedNTD Table 5: best of {0.1, 0.5, 1.0})", check=">=0")

    @graph_safe  # the anchor is the round's global model, held by the engine at one address
    def step_terms(self, ctx, n_act):
        return dict(prox_mu=self.opts.mu, anchor=self.engine.global_flat) if self.opts.mu else {}


@register("fedavgm")
class FedAvgM(FedAvg):
    """FedAvgM (Hsu et al. 2019): server momentum v <- beta v + (w_t - avg), w_{t+1} = w_t - server_lr v."""

    state = ("server_m",)
    paper = (
        "Hsu et al., Measuring the Effects of Non-Identical Data Distribution for Federated Visual Classification, 2019"
    )

    @dataclass
    class Options:
        server_lr: float = opt(1.0, "server learning rate (Hsu et al. 2019 use 1.0 with momentum)", check=">0")
        server_momentum: float = opt(0.9, "server momentum beta (Hsu et al. 2019, Fig. 2: 0.9)", check="[0,1]")

    def setup(self):
        self.server_m = torch.zeros(self.engine.num_params, device=self.engine.device)

    def server_terms(self, ctx):
        return dict(beta=self.opts.server_momentum, lr=self.opts.server_lr, momentum=self.server_m)

    def after_server(self, ctx, out):
        self.server_m = out["momentum"]
