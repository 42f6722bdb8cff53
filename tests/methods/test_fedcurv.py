"""FedCurv against a literal per-client loop written as FedNTD's code runs it (the penalty in the loss, the
Fisher from squared minibatch gradients after training, the server's dictionaries of every client's latest
u, v), on the batched executor and on vmap; its defaults and options."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sequential_loop import PlainLoop, engine_vs, fisher_diagonal, flat

import fedfast
from fedfast.methods.fedcurv import fisher_batches


class CurvLoop(PlainLoop):
    """Lee-Gihun/FedNTD algorithms/fedcurv: loss += lam (P.w^2 - 2 Q.w), P = U - u_k, Q = V - v_k; after training
    u_k = mean over minibatches of grad^2 (until more than `size` samples), v_k = u_k * w_k."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.u, self.v = {}, {}

    def round_start(self, sampled):
        zero = torch.zeros_like(self.w0)
        self.Ut = sum(self.u.values(), zero)  # the server's sums over every client that has trained
        self.Vt = sum(self.v.values(), zero)

    def loss(self, local, x, y, k):
        loss = F.cross_entropy(local(x), y)
        if self.u:  # no regulariser in round 1
            w = torch.cat([p.reshape(-1) for p in local.parameters()])
            Pt = self.Ut - self.u.get(k, 0.0)
            Qt = self.Vt - self.v.get(k, 0.0)
            loss = loss + self.o["lam"] * torch.inner(Pt, w * w) - 2.0 * self.o["lam"] * torch.inner(Qt, w)
        return loss

    def client_end(self, k, local, nsteps):  # upload_local_fisher: a fresh pass over the shuffled data
        self.u[k] = fisher_diagonal(
            local, self.train, self.batches(self.rnd, k, self.cfg.local_epochs), self.o["samples"]
        )
        self.v[k] = self.u[k] * flat(local)


@pytest.mark.parametrize("executor", ["auto", "vmap"])
@pytest.mark.parametrize(
    "options,extra",
    [
        ({}, {}),
        (dict(samples=20, lam=0.5), dict(client_chunk=3)),
        (dict(lam=2.0), dict(momentum=0.0, max_grad_norm=1.0)),
    ],
)
def test_matches_literal_loop(options, extra, executor):
    err, sim, loop = engine_vs(CurvLoop, "fedcurv", options, rounds=3, executor=executor, lr_decay=0.99, **extra)
    assert err <= 1e-4, err
    m, P = sim.method, sim.num_params
    seen = sorted(loop.u)
    u = m.client_state.dense()[seen, :P]
    assert float((u - torch.stack([loop.u[k] for k in seen])).abs().max() / u.abs().max()) <= 1e-3
    for total, cols in ((m.U, slice(0, P)), (m.V, slice(P, 2 * P))):  # U, V: the sums of the clients' rows
        rows = m.client_state.dense()[:, cols].sum(0)
        assert float((total - rows).abs().max() / rows.abs().max()) <= 1e-5


def test_penalty_changes_training():
    _, curv, _ = engine_vs(CurvLoop, "fedcurv", dict(lam=50.0), rounds=3)
    _, avg, _ = engine_vs(PlainLoop, "fedavg", {}, rounds=3)
    assert float((curv.global_flat - avg.global_flat).abs().max() / avg.global_flat.abs().max()) > 1e-3
    _, zero, _ = engine_vs(CurvLoop, "fedcurv", dict(lam=0.0), rounds=3)
    assert torch.equal(zero.global_flat, avg.global_flat)  # lam = 0: FedAvg


def test_fisher_batches_and_defaults():
    """The Fisher loop stops after the minibatch that brings the count above s (FedNTD's upload_local_fisher):
    s = 500, B = 50: 11 minibatches, or all 10 of a 500-sample client; defaults lam 1, s 500 (Table 5)."""
    assert fisher_batches(np.array([10, 12, 3]), 500, 50).tolist() == [10, 11, 3]
    assert fisher_batches(np.array([4]), 0, 50).tolist() == [1]
    o = fedfast.SimConfig(algorithm="fedcurv").method().opts
    assert (o.lam, o.samples) == (1.0, 500)
    for key, bad in (("lam", -1.0), ("samples", -5), ("samples", 2.5)):
        with pytest.raises(ValueError, match=f"fedcurv.{key}"):
            fedfast.SimConfig(algorithm="fedcurv", options={key: bad})
