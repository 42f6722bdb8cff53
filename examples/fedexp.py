"""FedExP (Jhunjhunwala, Wang and Joshi, "FedExP: Speeding Up Federated Averaging via Extrapolation", ICLR 2023)
as a plug-in, written from docs/methods.md's plug-in guide alone: a server rule with state and a value of its own
in every round's metrics.

The clients train as in FedAvg. With ``Delta_i = w - w_i`` the update of participant i (of M, averaged uniformly:
``Delta = mean_i Delta_i``), the server extrapolates along the average update with the step

    eta_g = max(1, sum_i ||Delta_i||^2 / (2 M (||Delta||^2 + eps))),        w' = w - eta_g * Delta,

which is 1 (FedAvg) when the clients agree and grows when their updates point in different directions. The paper
reports the average of the last two iterates, which damps the oscillation the large steps cause; the model
evaluated here is ``(w_t + w_{t-1}) / 2`` unless ``average_last_two = false``. ``eps`` keeps the step finite when
the average update vanishes; the paper tunes it, 1e-3 here.

    fedfast run --plugin examples/fedexp.py --set algorithm=fedexp --set fedexp.eps=1e-3
"""

from dataclasses import dataclass

import torch

from fedfast.methods import Collected, FedAvg, opt, register


@register("fedexp")
class FedExP(FedAvg):
    """FedExP (Jhunjhunwala et al., ICLR 2023): FedAvg with the adaptive server step size
    eta_g = max(1, sum_i ||Delta_i||^2 / (2 M (||Delta||^2 + eps)))."""

    paper = "Jhunjhunwala, Wang and Joshi, FedExP: Speeding Up Federated Averaging via Extrapolation, ICLR 2023"
    aggregation = "uniform"  # Delta is the plain mean of the participants' updates
    aggregation_fixed = True

    @dataclass
    class Options:
        eps: float = opt(1e-3, "eps in eta_g's denominator (the paper tunes it)", check=">0")
        average_last_two: bool = opt(True, "evaluate (w_t + w_{t-1}) / 2, the averaged iterate the paper reports")

    def setup(self):
        self.prev = self.engine.global_flat.clone()  # w_{t-1}: checkpointed without a list (guide: State)
        self.eta_g = torch.ones((), device=self.engine.device)

    def round_start(self, ctx):
        return {"sq": torch.zeros((), device=self.engine.device)}  # the round's sum_i ||Delta_i||^2

    def collect(self, ctx, out, lo, hi):
        rows = self.engine.client_params(hi - lo)  # the chunk's trained clients, one row each
        return Collected(sums={"sq": (rows - self.engine.global_flat).pow(2).sum()})

    def server(self, ctx, avg):
        w = self.engine.global_flat  # still the round's starting model here
        delta = w - avg
        M = ctx.num_total
        self.eta_g = torch.clamp(ctx.sums["sq"] / (2 * M * (delta.pow(2).sum() + self.opts.eps)), min=1.0)
        self.prev = w
        return w - self.eta_g * delta

    def evaluated(self, global_flat):
        return 0.5 * (global_flat + self.prev) if self.opts.average_last_two else global_flat

    def round_metrics(self, ctx):
        return {"eta_g": self.eta_g}
