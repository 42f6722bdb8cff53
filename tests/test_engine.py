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


def _flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _sequential(cfg, model, train, part, rounds):
    """The literal loop: per-client nn.Module + torch.optim.SGD, teacher forward per step, state_dict averaging,
    and each method's state written out plainly."""
    glob = copy.deepcopy(model)
    kind = {"fedntd": True}.get(cfg.algorithm, False)
    s = cfg.tau ** 2
    kdw = {"fedntd": cfg.beta * s, "kd": cfg.kd_weight * s, "fedgkd": cfg.gamma / 2 * s}.get(cfg.algorithm, 0.0)
    P = _flat(glob).numel()
    K = part.num_clients
    server_v, c_glob, hbar = torch.zeros(P), torch.zeros(P), torch.zeros(P)
    c_k = {k: torch.zeros(P) for k in range(K)}
    h_k = {k: torch.zeros(P) for k in range(K)}
    mean_n = float(np.mean([len(i) for i in part.indices]))
    gkd_hist = []
    if cfg.algorithm == "fedcad":  # the same auxiliary draw as the engine (32 per class, seeded)
        g = torch.Generator().manual_seed(cfg.seed + 7919)
        aux = torch.cat([torch.nonzero(train.y == c).flatten()[
            torch.randperm(int((train.y == c).sum()), generator=g)[:cfg.cad_aux_per_class]]
            for c in range(train.num_classes)])
    for rnd in range(rounds):
        sampled = sample_clients(cfg.seed, rnd, K, cfg.clients_per_round)
        lr = cfg.lr * cfg.lr_decay ** rnd
        states, sizes, flats, new_ck = [], [], [], {}
        teacher = copy.deepcopy(glob).eval()
        gflat = _flat(glob)
        if cfg.algorithm == "fedgkd" and cfg.gkd_buffer > 1 and gkd_hist:  # parameter average of buffered globals
            tflat = torch.stack(gkd_hist[-cfg.gkd_buffer:]).mean(0)
            off = 0
            with torch.no_grad():
                for p in teacher.parameters():
                    p.copy_(tflat[off:off + p.numel()].view_as(p))
                    off += p.numel()
        if cfg.algorithm == "fedcad":
            with torch.no_grad():
                xa, ya = train.batch(aux)
                py = torch.softmax(glob(xa), 1).gather(1, ya[:, None]).squeeze(1)
                mean_py = torch.stack([py[ya == c].mean() for c in range(train.num_classes)])
                class_alpha = cfg.cad_beta + (cfg.cad_gamma - cfg.cad_beta) * mean_py
        for k in sampled:
            idx = part.indices[k]
            local = copy.deepcopy(glob)
            wd = cfg.weight_decay
            alpha_k = cfg.dyn_alpha / (len(idx) / mean_n)
            if cfg.algorithm == "feddyn":
                wd = alpha_k + cfg.weight_decay
            opt = torch.optim.SGD(local.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=wd)
            nsteps = 0
            for e in range(cfg.local_epochs):
                perm = idx[torch.from_numpy(client_order(cfg.seed, rnd, int(k), e, len(idx)))]
                for b in perm.split(cfg.batch_size):
                    x, y = train.batch(b)
                    z = local(x)
                    with torch.no_grad():
                        t = teacher(x)
                    if cfg.algorithm == "fedcad":
                        loss = ffnn.CADLoss(tau=cfg.tau, backend="reference")(z, t, y, class_alpha)
                    elif cfg.asd:  # ASD add-on: the client's label distribution as prior, KD term replaced
                        prior = torch.bincount(train.y[idx], minlength=train.num_classes).float() / len(idx)
                        loss = ffnn.ASDLoss(tau=cfg.tau, lam=cfg.lam, not_true=kind, backend="reference")(
                            z, t, y, prior)
                    else:
                        loss = distill_reference(z, t, y, tau=cfg.tau, kd_weight=kdw, not_true=kind).mean()
                    flat = torch.cat([p.reshape(-1) for p in local.parameters()])
                    if cfg.mu:
                        loss = loss + cfg.mu / 2 * (flat - gflat).pow(2).sum()
                    if cfg.algorithm == "feddyn":
                        loss = loss + alpha_k * (flat * (h_k[int(k)] - gflat)).sum()
                    opt.zero_grad()
                    loss.backward()
                    if cfg.algorithm == "scaffold":
                        corr = c_glob - c_k[int(k)]
                        off = 0
                        for p in local.parameters():
                            p.grad += corr[off:off + p.numel()].view_as(p)
                            off += p.numel()
                    opt.step()
                    nsteps += 1
            wk = _flat(local)
            if cfg.algorithm == "scaffold":
                rho = cfg.momentum
                k_eff = (nsteps - rho * (1 - rho ** nsteps) / (1 - rho)) / (1 - rho)
                new_ck[int(k)] = c_k[int(k)] - c_glob + (gflat - wk) / (k_eff * lr)
            if cfg.algorithm == "feddyn":
                h_k[int(k)] = h_k[int(k)] + (wk - gflat)
            states.append(local.state_dict())
            sizes.append(len(idx))
            flats.append(wk)
        if cfg.algorithm == "feddyn":
            w = torch.full((len(sizes),), 1.0 / len(sizes))
        else:
            w = torch.tensor(sizes, dtype=torch.float32) / sum(sizes)
        avg = {key: sum(w[i] * states[i][key] for i in range(len(states))) for key in states[0]}
        glob.load_state_dict(avg)
        aflat = _flat(glob)
        if cfg.algorithm == "fedavgm":
            server_v = cfg.server_momentum * server_v + (gflat - aflat)
            newg = gflat - cfg.server_lr * server_v
        elif cfg.algorithm == "scaffold":
            c_glob = c_glob + sum(new_ck[k] - c_k[k] for k in new_ck) / K
            c_k.update(new_ck)
            newg = aflat
        elif cfg.algorithm == "feddyn":
            hbar = hbar + sum(f - gflat for f in flats) / K
            newg = aflat + hbar  # the cloud model: next round's start (and the teacher)
        else:
            newg = aflat
        off = 0
        with torch.no_grad():
            for p in glob.parameters():
                p.copy_(newg[off:off + p.numel()].view_as(p))
                off += p.numel()
        gkd_hist.append(newg.clone())
    return _flat(glob)


@pytest.mark.parametrize("algorithm,extra", [("fedavg", {}), ("fedprox", dict(mu=0.1)), ("kd", dict(tau=3.0)),
                                             ("fedntd", dict(tau=2.0)), ("fedgkd", {}),
                                             ("fedavg", dict(asd=True, lam=10.0, tau=2.0)),
                                             ("fedavgm", dict(server_lr=1.0, server_momentum=0.9)),
                                             ("scaffold", {}), ("feddyn", dict(dyn_alpha=0.1)),
                                             ("fedgkd", dict(gkd_buffer=2)), ("fedcad", dict(tau=2.0)),
                                             ("fedntd", dict(asd=True, lam=5.0, tau=2.0))])
def test_engine_matches_sequential_loop(algorithm, extra):
    train, test, part, model = _setup()
    rounds = 3 if "gkd_buffer" in extra else 2  # the buffer needs > 1 round to differ from the last global
    cfg = fedfast.SimConfig(algorithm=algorithm, clients_per_round=4, rounds=rounds, local_epochs=2, batch_size=16,
                            lr=0.05, lr_decay=0.99, momentum=0.9, weight_decay=1e-4, seed=3, **extra)
    ref = _sequential(cfg, model, train, part, cfg.rounds)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    hist = sim.run()
    if algorithm == "fedgkd" and cfg.gkd_buffer > 1:  # the teacher is the buffer average, not the last global
        assert not torch.equal(sim.teacher_flat, sim.global_flat)
    assert len(hist) == cfg.rounds and all(np.isfinite(h["test_loss"]) for h in hist)
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
