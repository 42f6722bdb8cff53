"""FedAvg, FedProx, FedAvgM against the plain sequential loop; the engine's plain defaults; user schedules and data
orders (replaying another framework's cohorts); Partition from plain index lists; the trained model."""

import copy

import numpy as np
import pytest
import torch
from sequential_loop import engine_vs_loop, flat, sequential, setup_data

import fedfast
from fedfast import data


@pytest.mark.parametrize(
    "algorithm,options,extra",
    [
        ("fedavg", {}, {}),
        ("fedprox", dict(mu=0.1), {}),
        ("fedprox", dict(mu=0.3), dict(max_grad_norm=0.5)),
        ("fedavgm", dict(server_lr=1.0, server_momentum=0.9), {}),
        ("fedavgm", dict(server_lr=0.7), dict(client_chunk=3)),
        ("fedavg", {}, dict(aggregate_weights="uniform")),
    ],
)
def test_matches_sequential_loop(algorithm, options, extra):
    err, sim, hist = engine_vs_loop(algorithm, options, lr_decay=0.99, **extra)
    assert len(hist) == 2 and all(np.isfinite(h["test_loss"]) for h in hist)
    assert err <= 1e-4, err


def test_engine_defaults_are_plain_sgd():
    """SimConfig(algorithm="fedavg") is plain SGD: no momentum, no weight decay, no clipping; equal to a loop with
    torch.optim.SGD(lr) and nothing else."""
    cfg = fedfast.SimConfig(algorithm="fedavg", clients_per_round=4, rounds=2, local_epochs=2, batch_size=16, lr=0.1)
    assert (cfg.momentum, cfg.weight_decay, cfg.max_grad_norm, cfg.aggregate_weights) == (0.0, 0.0, 0.0, "size")
    assert fedfast.SimConfig(algorithm="fedprox").method().opts.mu == 0.1
    train, test, part, model = setup_data()
    ref = sequential(cfg, model, train, part, 2)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    sim.run()
    assert (sim.global_flat - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_schedule_and_data_order_replay_given_cohorts():
    """A fixed schedule (variable cohort sizes) and a user data order give exactly the loop run on them."""
    train, test, part, model = setup_data()
    cohorts = [np.array([5, 1, 2]), np.array([0, 3, 4, 6, 7]), np.array([2])]

    def order(rnd, client, epoch, n):
        return np.random.default_rng(1000 * rnd + 10 * client + epoch).permutation(n)[::-1].copy()

    for sched in (cohorts, lambda r: cohorts[r]):
        cfg = fedfast.SimConfig(
            algorithm="fedavgm", clients_per_round=3, rounds=3, local_epochs=2, batch_size=16, lr=0.05, momentum=0.9
        )
        ref = sequential(cfg, model, train, part, 3, sampled_fn=lambda r: cohorts[r], order_fn=order)
        sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part, schedule=sched, data_order=order)
        hist = sim.run()
        assert [sorted(h["clients"]) for h in hist] == [sorted(c.tolist()) for c in cohorts]
        assert (sim.global_flat - ref).abs().max() <= 1e-5 * ref.abs().max()
    cfg = fedfast.SimConfig(algorithm="fedavg", clients_per_round=3, rounds=2, batch_size=16)
    for sched, _msg in (
        ([[0, 0]], "distinct"),
        ([[9]], "distinct and in"),
        ([[]], "non-empty"),
        ([[1]], "has 1 rounds"),
    ):
        sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part, schedule=sched)
        with pytest.raises(ValueError, match="schedule"):
            sim.run()
    bad = fedfast.Simulation(
        cfg, copy.deepcopy(model), train, test, part, data_order=lambda r, k, e, n: np.zeros(n, int)
    )
    with pytest.raises(ValueError, match="data_order"):
        bad.round()
    with pytest.raises(TypeError, match="schedule"):
        fedfast.Simulation(cfg, model, train, test, part, schedule=5)


def test_partition_from_plain_index_lists():
    train, test, part, model = setup_data()
    lists = [i.numpy() for i in part.indices]  # numpy arrays, no labels
    p2 = data.Partition(lists)
    p3 = data.Partition([i.tolist() for i in part.indices], labels=train.y)
    assert p3.num_classes == 5 and torch.equal(p3.histogram, part.histogram)
    cfg = fedfast.SimConfig(algorithm="fedavg", clients_per_round=4, rounds=1, batch_size=16, lr=0.05)
    outs = []
    for p in (part, p2, p3):
        sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, p)
        sim.run()
        outs.append(sim.global_flat)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    for bad, msg in (
        ([], "non-empty"),
        ([[0, 1], [2.5]], "integer"),
        ([[0, -1]], "negative"),
        ([[0], []], "no samples"),
        ([np.zeros((1, 1), int)], "1-d"),
    ):
        with pytest.raises(ValueError, match=msg):
            data.Partition(bad)
    with pytest.raises(ValueError, match="beyond"):
        data.Partition([[0, 10**6]], labels=train.y)
    with pytest.raises(ValueError, match="partition: holds sample indices beyond"):
        fedfast.Simulation(cfg, model, train, test, data.Partition([[0, 1], [2, 10**6], [3, 4], [5, 6]]))
    with pytest.raises(ValueError, match="labels"):
        _ = p2.histogram


def test_trained_model_is_loaded_into_the_module():
    """After run() the user's module holds the evaluated global model; state_dict() loads into a fresh copy."""
    train, test, part, model = setup_data()
    init = copy.deepcopy(model)
    cfg = fedfast.SimConfig(algorithm="fedavg", clients_per_round=4, rounds=2, batch_size=16, lr=0.1)
    sim = fedfast.Simulation(cfg, model, train, test, part)
    hist = sim.run()
    assert torch.equal(flat(model), sim.global_flat) and not torch.equal(flat(model), flat(init))
    fresh = copy.deepcopy(init)
    fresh.load_state_dict(sim.state_dict())
    x, y = test.batch(torch.arange(len(test)))
    with torch.no_grad():
        acc = float((fresh(x).argmax(1) == y).float().mean())
    assert abs(acc - hist[-1]["test_accuracy"]) < 1e-6
