"""SimConfig.local_steps: a fixed number of minibatch steps per client and round (FedGen's protocol) through
successive passes over the client's data, equal to a literal loop that walks the same passes."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sequential_loop import flat, setup_data

import fedfast
from fedfast.sampling import client_order, sample_clients


def _batches(idx, order, B, drop_last):
    out = list(idx[torch.from_numpy(order)].split(B))
    return [b for b in out if len(b) == B] if drop_last else out


def literal(cfg, model, train, part, rounds):
    glob = copy.deepcopy(model)
    for rnd in range(rounds):
        ids = sample_clients(cfg.seed, rnd, part.num_clients, cfg.clients_per_round)
        states, sizes = [], []
        for k in ids:
            idx = part.indices[k]
            local = copy.deepcopy(glob)
            opt = torch.optim.SGD(local.parameters(), lr=cfg.lr, momentum=cfg.momentum)
            batches, e = [], 0
            steps = cfg.local_steps or float("inf")
            while len(batches) < steps and (cfg.local_steps or e < cfg.local_epochs):  # pass after pass, each in
                batches += _batches(
                    idx,
                    client_order(cfg.seed, rnd, int(k), e, len(idx)),
                    cfg.batch_size,  # the
                    cfg.drop_last,
                )  # seeded order
                e += 1
            for b in batches[: cfg.local_steps] if cfg.local_steps else batches:
                x, y = train.batch(b)
                opt.zero_grad()
                F.cross_entropy(local(x), y).backward()
                opt.step()
            states.append(local.state_dict())
            sizes.append(len(idx))
        w = np.asarray(sizes, dtype=np.float64) / sum(sizes)
        glob.load_state_dict({key: sum(float(w[i]) * s[key] for i, s in enumerate(states)) for key in states[0]})
    return flat(glob)


@pytest.mark.parametrize(
    "steps,extra", [(3, {}), (11, dict(momentum=0.9, client_chunk=2)), (11, dict(drop_last=True, batch_size=4))]
)
def test_local_steps_equal_the_literal_loop(steps, extra):
    """Clients of unequal sizes (5..40 rows, B = 16): 3 steps stop inside the first pass; 11 steps wrap around
    several passes with a partial batch at the end of each."""
    train, test, part, model = setup_data()
    kw = dict(algorithm="fedavg", clients_per_round=4, rounds=2, batch_size=16, lr=0.05)
    cfg = fedfast.SimConfig(**{**kw, **extra}, local_steps=steps)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    sim.run()
    ref = literal(cfg, model, train, part, 2)
    assert float((sim.global_flat - ref).abs().max() / ref.abs().max()) <= 1e-4
    epochs = fedfast.SimConfig(**{**kw, **extra})
    other = fedfast.Simulation(epochs, copy.deepcopy(model), train, test, part)
    other.run()
    assert float((other.global_flat - ref).abs().max() / ref.abs().max()) > 1e-3  # not the epochs protocol


def test_local_steps_rounds_and_methods_see_the_steps():
    train, test, part, model = setup_data()
    cfg = fedfast.SimConfig(algorithm="scaffold", clients_per_round=3, rounds=1, batch_size=16, lr=0.05, local_steps=7)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    ctx, totals, _ = sim.plan.sample(sim.rnd)
    assert (ctx.steps == 7).all() and ctx.epochs == 1 and totals["steps"] == 21
    assert (ctx.data_batches == np.ceil(ctx.sizes / 16)).all() and (np.diff(ctx.data_batches) <= 0).all()
    # the labels of the rows each client trains on (FedGen's label counts)
    rows = [sum(min(16, n - 16 * (b % -(-n // 16))) for b in range(7)) for n in ctx.sizes]  # step b's batch size
    assert ctx.seen_hist.sum(1).tolist() == [float(r) for r in rows]
    sim.round()
    with pytest.raises(ValueError, match="local_steps: 5 steps per round replace local_epochs = 2"):
        fedfast.SimConfig(local_steps=5, local_epochs=2)
    with pytest.raises(ValueError, match="local_steps: an integer >= 1"):
        fedfast.SimConfig(local_steps=0)


def test_drop_last_in_epochs_mode_equals_the_literal_loop_and_refuses_small_clients():
    train, test, part, model = setup_data()
    cfg = fedfast.SimConfig(
        algorithm="fedavg",
        clients_per_round=4,
        rounds=2,
        batch_size=6,
        lr=0.05,
        local_epochs=2,
        drop_last=True,
        momentum=0.9,
    )
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    sim.run()
    ref = literal(cfg, model, train, part, 2)
    assert float((sim.global_flat - ref).abs().max() / ref.abs().max()) <= 1e-4
    ctx, _, _ = sim.plan.sample(sim.rnd)
    assert ctx.seen_hist.sum(1).tolist() == [float(2 * 6 * (n // 6)) for n in ctx.sizes]
    big = fedfast.SimConfig(algorithm="fedavg", clients_per_round=8, batch_size=64, drop_last=True)
    with pytest.raises(ValueError, match="drop_last: client.*fewer than batch_size = 64"):
        fedfast.Simulation(big, copy.deepcopy(model), train, test, part).round()
