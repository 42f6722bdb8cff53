"""The batched engine against a literal sequential loop (per-client nn.Module, torch.optim.SGD, teacher forward
per step, state_dict averaging) on the same partition, sampling, seeds and batch order: 2 rounds."""
import copy

import numpy as np
import pytest
import torch

import fedfast
from fedfast import data, models
from fedfast import nn as ffnn
from fedfast.engine import client_order, sample_clients
from fedfast.ops import distill_reference


def _setup():
    train, test = data.synthetic(5, 400, 100, (1, 6, 6), separation=0.7, seed=0)
    part = data.dirichlet_lda(train.y, 8, alpha=0.5, seed=1, min_size=5)  # unequal sizes: exercises masking
    torch.manual_seed(0)
    model = models.MLP(36, (16,), 5)
    return train, test, part, model


def _sequential(cfg, model, train, part, rounds):
    glob = copy.deepcopy(model)
    kind = {"fedntd": True}.get(cfg.algorithm, False)
    s = cfg.tau ** 2
    kdw = {"fedavg": 0.0, "fedprox": 0.0, "kd": cfg.kd_weight * s, "fedntd": cfg.beta * s, "fedgkd": cfg.gamma / 2 * s}
    for rnd in range(rounds):
        sampled = sample_clients(cfg.seed, rnd, part.num_clients, cfg.clients_per_round)
        lr = cfg.lr * cfg.lr_decay ** rnd
        states, sizes = [], []
        teacher = copy.deepcopy(glob).eval()
        gflat = torch.cat([p.detach().reshape(-1) for p in glob.parameters()])
        for k in sampled:
            idx = part.indices[k]
            local = copy.deepcopy(glob)
            opt = torch.optim.SGD(local.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
            for e in range(cfg.local_epochs):
                perm = idx[torch.from_numpy(client_order(cfg.seed, rnd, int(k), e, len(idx)))]
                for b in perm.split(cfg.batch_size):
                    x, y = train.batch(b)
                    z = local(x)
                    with torch.no_grad():
                        t = teacher(x)
                    if cfg.asd:  # ASD add-on: the client's label distribution as prior, KD term replaced
                        prior = torch.bincount(train.y[idx], minlength=train.num_classes).float() / len(idx)
                        loss = ffnn.ASDLoss(tau=cfg.tau, lam=cfg.lam, not_true=kind, backend="reference")(
                            z, t, y, prior)
                    else:
                        loss = distill_reference(z, t, y, tau=cfg.tau, kd_weight=kdw[cfg.algorithm],
                                                 not_true=kind).mean()
                    if cfg.mu:
                        flat = torch.cat([p.reshape(-1) for p in local.parameters()])
                        loss = loss + cfg.mu / 2 * (flat - gflat).pow(2).sum()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            states.append(local.state_dict())
            sizes.append(len(idx))
        w = torch.tensor(sizes, dtype=torch.float32) / sum(sizes)
        glob.load_state_dict({key: sum(w[i] * states[i][key] for i in range(len(states))) for key in states[0]})
    return torch.cat([p.detach().reshape(-1) for p in glob.parameters()])


@pytest.mark.parametrize("algorithm,extra", [("fedavg", {}), ("fedprox", dict(mu=0.1)), ("kd", dict(tau=3.0)),
                                             ("fedntd", dict(tau=2.0)), ("fedgkd", {}),
                                             ("fedavg", dict(asd=True, lam=10.0, tau=2.0)),
                                             ("fedntd", dict(asd=True, lam=5.0, tau=2.0))])
def test_engine_matches_sequential_loop(algorithm, extra):
    train, test, part, model = _setup()
    cfg = fedfast.SimConfig(algorithm=algorithm, clients_per_round=4, rounds=2, local_epochs=2, batch_size=16,
                            lr=0.05, lr_decay=0.99, momentum=0.9, weight_decay=1e-4, seed=3, **extra)
    ref = _sequential(cfg, model, train, part, 2)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    hist = sim.run()
    assert len(hist) == 2 and all(np.isfinite(h["test_loss"]) for h in hist)
    err = (sim.global_flat - ref).abs().max() / ref.abs().max()
    assert err <= 1e-4, float(err)
    assert not torch.equal(sim.global_flat, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


def test_engine_learns_and_reports():
    train, test, part, model = _setup()
    cfg = fedfast.SimConfig(algorithm="fedntd", clients_per_round=8, rounds=6, local_epochs=2, batch_size=16,
                            lr=0.1, seed=0)
    hist = fedfast.Simulation(cfg, model, train, test, part).run()
    assert hist[-1]["test_accuracy"] > 0.5 > 0.2  # 5 classes: chance is 0.2
    assert {"round", "test_accuracy", "test_loss", "train_loss", "seconds", "timers"} <= set(hist[0])
    with pytest.raises(ValueError, match="algorithm"):
        fedfast.SimConfig(algorithm="fedsomething")
    with pytest.raises(ValueError, match="asd"):
        fedfast.SimConfig(algorithm="kd", asd=True)
