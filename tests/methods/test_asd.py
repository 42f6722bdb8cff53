"""ASD as an add-on over each base method, against the plain sequential loop; defaults from Yashwanth et al. and
the official code (vcl-iisc/fed-adaptive-self-distillation @6cb4b68)."""

import pytest
import torch
from sequential_loop import engine_vs_loop

import fedfast
from fedfast import nn as ffnn


@pytest.mark.parametrize(
    "algorithm,options,extra",
    [
        ("fedavg+asd", dict(asd=dict(lam=10.0, tau=2.0)), {}),
        ("fedntd+asd", dict(asd=dict(lam=5.0)), {}),
        ("scaffold+asd", dict(asd=dict(lam=5.0)), {}),
        ("feddyn+asd", dict(asd=dict(lam=5.0), feddyn=dict(alpha=0.1)), {}),
        ("fedprox+asd", dict(asd=dict(tau=2.0), fedprox=dict(mu=0.05)), {}),
        ("fedavg+asd", dict(asd=dict(entropy_tau=2.0, not_true=True)), dict(max_grad_norm=0.5)),
    ],
)
def test_matches_sequential_loop(algorithm, options, extra):
    err, _, _ = engine_vs_loop(algorithm, options, lr_decay=0.99, **extra)
    assert err <= 1e-4, err


def test_defaults_follow_the_official_code():
    """lam 10, tau 2, clipping at 10 on every +asd method; the teacher entropy at temperature 1 on the official
    FedAvg+ASD / FedNTD+ASD path (train_fedavgreg_mdl) and at tau on FedProx+ASD / FedDyn+ASD."""
    for alg, ent, nt in (
        ("fedavg+asd", 1.0, False),
        ("fedntd+asd", 1.0, True),
        ("fedprox+asd", 2.0, False),
        ("feddyn+asd", 2.0, False),
        ("scaffold+asd", 2.0, False),
    ):
        cfg = fedfast.SimConfig(algorithm=alg)
        a = cfg.method().asd
        assert (a.lam, a.tau, a.entropy_tau, a.not_true, cfg.max_grad_norm) == (10.0, 2.0, ent, nt, 10.0), alg
    assert fedfast.SimConfig(algorithm="fedprox+asd", options={"asd": {"tau": 3.0}}).method().asd.entropy_tau == 3.0
    assert fedfast.SimConfig(algorithm="fedavg").max_grad_norm == 0.0


def test_official_fedavg_asd_loss():
    """With the default entropy temperature of fedavg+asd (1) the loss is the official code's: per batch,
    CE_mean + lam * sum_i alpha_i KL_i with alpha ∝ exp(-H(softmax(t))) / p(y), normalised over the batch."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(12, 7, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(12, 7, generator=g, dtype=torch.float64)
    y = torch.randint(0, 7, (12,), generator=g)
    prior = torch.bincount(y, minlength=7).double() / 12
    a = fedfast.SimConfig(algorithm="fedavg+asd").method().asd
    got = ffnn.ASDLoss(tau=a.tau, lam=a.lam, entropy_tau=a.entropy_tau, backend="reference")(z, t, y, prior)
    p1 = torch.softmax(t, 1)
    H = -(p1 * torch.log(p1)).sum(1)
    ahat = torch.exp(-H) / prior[y]
    alpha = ahat / ahat.sum()
    pt, lq = torch.softmax(t / a.tau, 1), torch.log_softmax(z / a.tau, 1)
    kl = (pt * (torch.log(pt) - lq)).sum(1)
    want = torch.nn.functional.cross_entropy(z, y) + a.lam * (alpha * kl).sum()
    assert torch.allclose(got, want, rtol=1e-10)
