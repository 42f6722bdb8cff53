"""FedCAD against the plain sequential loop; its class weights (Eq. 6) and server-held auxiliary data."""

import copy

import pytest
import torch
from sequential_loop import PlainLoop, engine_vs, engine_vs_loop, setup_data

import fedfast
from fedfast import data


@pytest.mark.parametrize(
    "options,extra",
    [({}, {}), (dict(tau=1.0, beta=0.1, gamma=0.9, tau_squared=True), {}), (dict(alpha_tau=2.0), dict(client_chunk=2))],
)
def test_matches_sequential_loop(options, extra):
    err, _, _ = engine_vs_loop("fedcad", options, lr_decay=0.99, **extra)
    assert err <= 1e-4, err


def test_given_aux_set_and_alpha_temperature():
    """A server-held aux dataset equal to the default draw gives the same run; alpha_tau changes alpha."""
    train, test, part, model = setup_data()
    cfg = fedfast.SimConfig(algorithm="fedcad", clients_per_round=3, rounds=2, batch_size=16, lr=0.05, seed=4)
    o = cfg.method().opts
    assert (o.beta, o.gamma, o.tau, o.tau_squared, o.alpha_tau, o.aux_per_class) == (0.3, 0.7, 2.0, False, 1.0, 32)
    pick = data.per_class_sample(train.y, o.aux_per_class, cfg.seed + 7919)
    runs = []
    for kw in (dict(), dict(aux=train.subset(pick))):
        sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part, **kw)
        sim.run()
        runs.append(sim)
    assert torch.equal(runs[0].global_flat, runs[1].global_flat)
    m = runs[0].method
    a1 = m.class_alpha(runs[0].global_flat)
    m.opts.alpha_tau = 4.0  # the same global model, a hotter softmax
    a4 = m.class_alpha(runs[0].global_flat)
    assert not torch.allclose(a1, a4)
    C = train.num_classes  # a hotter softmax pulls p_y towards 1/C: alpha towards beta + (gamma - beta) / C
    mid = o.beta + (o.gamma - o.beta) / C
    assert ((a4 - mid).abs() <= (a1 - mid).abs() + 1e-6).all()
    assert ((a1 >= o.beta - 1e-6) & (a1 <= o.gamma + 1e-6)).all()
    with pytest.raises(ValueError, match="fedcad.gamma"):
        fedfast.SimConfig(algorithm="fedcad", options={"beta": 0.7, "gamma": 0.3})


def test_aux_holdout_removes_the_samples():
    train, _, _, _ = setup_data()
    m = fedfast.methods.FedCAD(aux_holdout=True, aux_per_class=4)
    tr, splits = m.hold_out(train, seed=3)
    assert len(splits["aux"]) == 20 and len(tr) == len(train) - 20
    assert torch.bincount(splits["aux"].y, minlength=5).tolist() == [4] * 5
    assert fedfast.methods.FedCAD().hold_out(train) == (train, {})


class LSDLoop(PlainLoop):
    """FedLSD as FedCAD's Eq. 4: (1 - alpha) CE + alpha * (-sum_c softmax(z_g/T)_c log softmax(z/T)_c), batch mean."""

    def round_start(self, sampled):
        self.teacher = copy.deepcopy(self.glob).eval()

    def loss(self, local, x, y, k):
        o, z = self.o, local(x)
        alpha = o["alpha"] if "alpha" in o else o["beta"]  # FedCAD with beta = gamma: the same constant weight
        with torch.no_grad():
            p = torch.softmax(self.teacher(x) / o["tau"], 1)
        soft = -(p * torch.log_softmax(z / o["tau"], 1)).sum(1).mean() * (o["tau"] ** 2 if o["tau_squared"] else 1)
        return (1 - alpha) * torch.nn.functional.cross_entropy(z, y) + alpha * soft


@pytest.mark.parametrize("executor", ["auto", "vmap"])
@pytest.mark.parametrize("options", [{}, dict(alpha=0.5, tau=1.0, tau_squared=True)])
def test_fedlsd_matches_literal_loop(options, executor):
    err, _, _ = engine_vs(LSDLoop, "fedlsd", options, executor=executor, lr_decay=0.99)
    assert err <= 1e-4, err


def test_fedlsd_is_fedcad_with_equal_bounds():
    """FedLSD is FedCAD with beta = gamma = alpha (a named method over it): the same model bit for bit; its
    defaults T = 2 (FedCAD: 'For FedLSD, we set the temperature parameter T to 2'), alpha 0.3 (grid {0.1, 0.3,
    0.5}), no T^2; no auxiliary data."""
    _, lsd, _ = engine_vs(LSDLoop, "fedlsd", dict(alpha=0.5))
    err, cad, _ = engine_vs(LSDLoop, "fedcad", dict(beta=0.5, gamma=0.5))
    assert torch.equal(lsd.global_flat, cad.global_flat) and err <= 1e-4
    o = fedfast.SimConfig(algorithm="fedlsd").method().opts
    assert (o.alpha, o.tau, o.tau_squared) == (0.3, 2.0, False)
    assert fedfast.methods.FedLSD().hold_out("train") == ("train", {})
    with pytest.raises(ValueError, match="fedlsd.alpha"):
        fedfast.SimConfig(algorithm="fedlsd", options={"alpha": 2.0})
    with pytest.raises(ValueError, match="fedlsd.beta: not an option"):
        fedfast.SimConfig(algorithm="fedlsd", options={"beta": 0.3})
