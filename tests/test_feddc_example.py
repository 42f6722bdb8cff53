"""examples/feddc.py: FedDC, a drift-correction method built from the fused ops' generic terms with no kernel edit,
against a literal per-client loop that writes the authors' formulas out (loss with the drift penalty and the
gradient correction through autograd, per-client h_i and G_i, the cloud model from all clients' drifts)."""

import collections
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sequential_loop import PlainLoop, engine_vs, flat, plugin_fixture

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "feddc.py")


feddc = plugin_fixture(EXAMPLE, "feddc")


class FedDCLoop(PlainLoop):
    """FedDC written plainly (gaoliang13/FedDC: train_FedDC, train_model_FedDC)."""

    def __init__(self, cfg, model, train, part):
        super().__init__(cfg, model, train, part)
        P = self.w0.numel()
        self.h = collections.defaultdict(lambda: torch.zeros(P))  # parameter_drifts
        self.Gk = collections.defaultdict(lambda: torch.zeros(P))  # state_gadient_diffs[i]
        self.G = torch.zeros(P)  # state_gadient_diffs[-1]
        self.r = self.sizes / self.sizes.sum() * self.K  # weight_list
        self.n_minibatch = cfg.local_epochs * int(np.ceil(self.sizes.mean() / cfg.batch_size))

    def round_start(self, sampled):
        self.dG = torch.zeros_like(self.G)

    def loss(self, local, x, y, k):
        theta = torch.cat([p.reshape(-1) for p in local.parameters()])
        alpha = self.o["alpha"] / float(self.r[k])
        diff = -self.Gk[k] + self.G / float(self.r[k])  # state_update_diff
        return (
            F.cross_entropy(local(x), y)
            + alpha / 2 * ((theta - (self.gflat - self.h[k])) ** 2).sum()
            + (theta * diff).sum()
        )

    def client_end(self, k, local, nsteps):
        delta = flat(local) - self.gflat
        self.h[k] = self.h[k] + delta
        beta = 1.0 / self.n_minibatch / self.cfg.lr
        g_new = self.Gk[k] - self.G / float(self.r[k]) + beta * (-delta)
        self.dG += (g_new - self.Gk[k]) * float(self.r[k])
        self.Gk[k] = g_new

    def server(self, avg, sampled):
        self.G = self.G + self.dG / self.K
        hbar = torch.stack([self.h[j] for j in range(self.K)]).mean(0)  # np.mean(parameter_drifts, axis=0)
        return avg + hbar


@pytest.mark.parametrize(
    "options,extra",
    [
        ({}, dict(momentum=0.0, max_grad_norm=10.0)),
        (dict(alpha=0.1), dict(momentum=0.0, max_grad_norm=1.0, client_chunk=3)),
        (dict(alpha=0.05), dict(momentum=0.0, lr_decay=0.9)),
    ],
)
def test_feddc_matches_the_literal_loop(options, extra):
    err, sim, loop = engine_vs(FedDCLoop, "feddc", options, rounds=3, **extra)
    assert err <= 1e-4, err
    assert sim.cfg.aggregate_weights == "uniform" and sim.method.aggregation_fixed
    assert float(loop.G.abs().max()) > 0 and float(sim.method.hbar.abs().max()) > 0  # the corrections are live


def test_feddc_terms_matter():
    """The drift and correction change the result (against FedAvg on the same data), and the method keeps its
    defaults: clipping at 10 (the authors' code), uniform averaging, SGD only."""
    err, sim, _ = engine_vs(FedDCLoop, "feddc", dict(alpha=0.1), rounds=2, momentum=0.0, max_grad_norm=10.0)
    err_avg, avg_sim, _ = engine_vs(
        PlainLoop, "fedavg", {}, rounds=2, momentum=0.0, max_grad_norm=10.0, aggregate_weights="uniform"
    )
    assert err <= 1e-4 and err_avg <= 1e-4
    assert float((sim.global_flat - avg_sim.global_flat).abs().max()) > 1e-3
    import fedfast

    cfg = fedfast.SimConfig(algorithm="feddc")
    assert cfg.max_grad_norm == 10.0 and cfg.aggregate_weights == "uniform"
    with pytest.raises(ValueError, match="feddc"):
        fedfast.SimConfig(algorithm="feddc", client_optimizer="adam")
