"""KD and FedNTD against the plain sequential loop; their defaults follow Lee et al. (FedNTD) and its code."""

import pytest
import torch
from sequential_loop import PlainLoop, engine_vs, engine_vs_loop

import fedfast


@pytest.mark.parametrize(
    "algorithm,options,extra",
    [
        ("kd", dict(tau=3.0), {}),
        ("kd", dict(beta=0.5, tau=2.0, tau_squared=False), {}),
        ("fedntd", dict(tau=2.0), {}),
        ("fedntd", dict(tau=2.0, beta=0.3), dict(max_grad_norm=0.5)),
        ("fedntd", {}, dict(client_chunk=2)),
    ],
)
def test_matches_sequential_loop(algorithm, options, extra):
    err, _, _ = engine_vs_loop(algorithm, options, lr_decay=0.99, **extra)
    assert err <= 1e-4, err


def test_defaults():
    """FedNTD Table 5 (beta = 1, tau = 1); the official trainer (algorithms/fedntd/ClientTrainer.py) clips nothing;
    KD as FedNTD's code KD config (tau = 3, beta = 1)."""
    cfg = fedfast.SimConfig(algorithm="fedntd")
    o = cfg.method().opts
    assert (o.beta, o.tau, o.tau_squared, cfg.max_grad_norm, cfg.aggregate_weights) == (1.0, 1.0, True, 0.0, "size")
    k = fedfast.SimConfig(algorithm="kd").method().opts
    assert (k.beta, k.tau, k.tau_squared) == (1.0, 3.0, True)


class NTDLoop(PlainLoop):
    """FedNTD / FedLS-NTD written out: CE + beta tau^2 KL over the not-true classes (the true class's logit removed
    from student and teacher before the tau-softmax), the teacher the model the client received."""

    def round_start(self, sampled):
        import copy

        self.teacher = copy.deepcopy(self.glob).eval()

    def loss(self, local, x, y, k):
        o, z = self.o, local(x)
        with torch.no_grad():
            t = self.teacher(x)
        keep = torch.ones_like(z, dtype=torch.bool).scatter_(1, y[:, None], False)
        zs, ts = z[keep].view(len(y), -1) / o["tau"], t[keep].view(len(y), -1) / o["tau"]
        kl = (torch.softmax(ts, 1) * (torch.log_softmax(ts, 1) - torch.log_softmax(zs, 1))).sum(1).mean()
        return torch.nn.functional.cross_entropy(z, y) + o["beta"] * (o["tau"] ** 2 if o["tau_squared"] else 1) * kl


@pytest.mark.parametrize("executor", ["auto", "vmap"])
def test_fedls_ntd_matches_literal_loop(executor):
    err, _, _ = engine_vs(NTDLoop, "fedls_ntd", {}, executor=executor, lr_decay=0.99)
    assert err <= 1e-4, err


def test_fedls_ntd_is_fedntd_with_fedadc_settings():
    """FedLS-NTD (FedADC Table I; §IV-C: T = 1, beta = 0.3) is FedNTD with those options, bit for bit (FedNTD is
    checked against the literal loop above)."""
    o = fedfast.SimConfig(algorithm="fedls_ntd").method().opts
    assert (o.beta, o.tau, o.tau_squared) == (0.3, 1.0, True)
    _, a, _ = engine_vs_loop("fedls_ntd", {})
    err, b, _ = engine_vs_loop("fedntd", dict(beta=0.3, tau=1.0))
    assert torch.equal(a.global_flat, b.global_flat) and err <= 1e-4
    _, c, _ = engine_vs_loop("fedntd", {})
    assert not torch.equal(a.global_flat, c.global_flat)
