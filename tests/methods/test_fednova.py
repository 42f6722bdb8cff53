"""FedNova against a literal per-client loop written as FedNTD's code runs it (gradient assignment with the
variance-reduction term, the normalised average of the local models), on the batched executor and on vmap; its
defaults (FedNTD's config) and effective step counts."""

import collections

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sequential_loop import PlainLoop, engine_vs, flat

import fedfast
from fedfast.methods.fednova import effective_steps


class NovaLoop(PlainLoop):
    """Lee-Gihun/FedNTD algorithms/fednova: local SGD on g + (c - d_k); server w - tau_eff sum p_i (w - w_i)/a_i."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        P = self.w0.numel()
        self.d = collections.defaultdict(lambda: torch.zeros(P))  # d_k, the client's last normalised update
        self.c = torch.zeros(P)  # the server variate (weighted_d)
        self.local = {}

    def round_start(self, sampled):
        c, rho = self.cfg, self.cfg.momentum
        tau = c.local_epochs * np.ceil(self.sizes / c.batch_size)
        self.a = (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho) if rho else tau  # a_i for every client

    def step(self, local, opt, x, y, k):
        opt.zero_grad()
        F.cross_entropy(local(x), y).backward()
        self.clip(local)
        if self.o["ccvr"]:  # grad_batch = grad + c_i, c_i = weighted_d - d_i, assigned back before opt.step()
            corr, off = self.c - self.d[k], 0
            for p in local.parameters():
                p.grad += corr[off : off + p.numel()].view_as(p)
                off += p.numel()
        opt.step()

    def client_end(self, k, local, nsteps):
        self.local[k] = flat(local)

    def server(self, avg, sampled):  # _nova_aggregation: from the local models, not the plain average
        n = self.sizes[sampled].astype(float)
        p = n / n.sum() if self.cfg.aggregate_weights == "size" else np.full(len(n), 1 / len(n))
        a = self.a[sampled]
        c1, c2 = float((p * a).sum()), float((p / a).sum())
        new = (1.0 - c1 * c2) * self.gflat
        for i, k in enumerate(sampled):
            new = new + self.local[int(k)] * (c1 * p[i] / a[i])
        for i, k in enumerate(sampled):  # d_i = (w_t - w_i) / (lr a_i)
            self.d[int(k)] = (self.gflat - self.local[int(k)]) / (self.lr * a[i])
        if self.o["ccvr_server"]:  # _update_weighted_d
            share = self.sizes[sampled].sum() / self.sizes.sum()
            self.c = self.c * (1 - share) + sum(self.sizes[k] / self.sizes.sum() * self.d[int(k)] for k in sampled)
        return new


@pytest.mark.parametrize("executor", ["auto", "vmap"])
@pytest.mark.parametrize(
    "options,extra",
    [
        ({}, {}),
        (dict(ccvr=False), {}),
        (dict(ccvr_server=True), dict(client_chunk=3)),
        ({}, dict(momentum=0.0, aggregate_weights="uniform")),
    ],
)
def test_matches_literal_loop(options, extra, executor):
    err, sim, _ = engine_vs(NovaLoop, "fednova", options, rounds=3, executor=executor, lr_decay=0.99, **extra)
    assert err <= 1e-4, err
    if sim.method.opts.ccvr:
        assert sim.method.client_state.dense().abs().max() > 0
    if sim.method.opts.ccvr_server:
        assert sim.method.c.abs().max() > 0


def test_differs_from_fedavg_with_unequal_steps():
    """The dirichlet split gives the clients different step counts: FedNova's model is not FedAvg's."""
    _, nova, _ = engine_vs(NovaLoop, "fednova", dict(ccvr=False))
    _, avg, _ = engine_vs(PlainLoop, "fedavg", {})
    assert float((nova.global_flat - avg.global_flat).abs().max() / avg.global_flat.abs().max()) > 1e-3


def test_effective_steps_and_defaults():
    """a_i = (tau - rho (1 - rho^tau)/(1 - rho)) / (1 - rho) (Wang et al. 2020, Eq. 8; FedNTD's
    _init_nova_dependencies): the distance a unit gradient moves the weights in tau momentum steps."""
    tau, rho = 7, 0.9
    buf, moved = 0.0, 0.0
    for _ in range(tau):
        buf = rho * buf + 1.0
        moved += buf
    assert np.isclose(effective_steps(np.array([tau]), rho)[0], moved)
    assert effective_steps(np.array([5.0]), 0.0)[0] == 5.0
    o = fedfast.SimConfig(algorithm="fednova").method().opts  # FedNTD @be00ee5 config/fednova.json: nova_ccvr true
    assert (o.ccvr, o.ccvr_server) == (True, False)
    with pytest.raises(ValueError, match="client_optimizer"):
        fedfast.SimConfig(algorithm="fednova", client_optimizer="adam")
    with pytest.raises(ValueError, match="fednova.ccvr"):
        fedfast.SimConfig(algorithm="fednova", options={"ccvr": "maybe"})
