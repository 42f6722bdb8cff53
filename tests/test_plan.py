"""fedfast.sim.plan, the round plan as pure functions of seed, round and data placement (issue 37): cohort size,
participants (seeded samplers and user schedules), each client's data order, and local_steps mode's step table."""

import numpy as np
import pytest
import torch
from sequential_loop import setup_data

import fedfast
from fedfast.sampling import client_order, sample_clients, sample_clients_bernoulli, sample_clients_round_seeded
from fedfast.sim import plan


def test_max_cohort():
    assert plan.max_cohort(10, 100, "uniform") == 10
    assert plan.max_cohort(10, 100, "bernoulli") == 22  # 10 + 4 * sqrt(100 * 0.1 * 0.9) = 22
    assert plan.max_cohort(90, 100, "bernoulli") == 100  # never more than every client


def test_round_clients_samplers_and_schedules():
    assert np.array_equal(plan.round_clients(3, 5, 50, 7, "uniform"), sample_clients(3, 5, 50, 7))
    assert np.array_equal(plan.round_clients(3, 5, 50, 7, "bernoulli"), sample_clients_bernoulli(3, 5, 50, 7 / 50))
    assert np.array_equal(plan.round_clients(3, 5, 50, 7, "round_seeded"), sample_clients_round_seeded(5, 50, 7))
    sched = [[4, 2], torch.tensor([0, 1, 3])]
    got = plan.round_clients(0, 1, 5, 2, "uniform", sched)
    assert got.dtype == np.int64 and got.tolist() == [0, 1, 3]
    assert plan.round_clients(0, 2, 5, 2, "uniform", lambda r: [r, r + 1]).tolist() == [2, 3]
    with pytest.raises(ValueError, match="schedule: has 2 rounds, round 3 was asked for"):
        plan.round_clients(0, 2, 5, 2, "uniform", sched)
    for bad, msg in (([], "non-empty 1-d"), ([1.5], "non-empty 1-d"), ([1, 1], "distinct"), ([5], r"in \[0, 5\)")):
        with pytest.raises(ValueError, match=f"schedule: round 1: .*{msg}"):
            plan.round_clients(0, 0, 5, 2, "uniform", [bad])


def test_data_order_seeded_or_the_users_checked():
    assert np.array_equal(plan.data_order(1, 2, 3, 0, 9), client_order(1, 2, 3, 0, 9))
    assert plan.data_order(1, 2, 3, 1, 4, lambda r, k, e, n: list(reversed(range(n)))).tolist() == [3, 2, 1, 0]
    with pytest.raises(
        ValueError, match=r"data_order: round 3, client 3, epoch 1: expected a permutation of range\(4\)"
    ):
        plan.data_order(1, 2, 3, 1, 4, lambda r, k, e, n: [0, 0, 1, 2])


def test_steps_table_by_hand():
    rows = [np.array([10, 11, 12, 13, 14]), np.array([20, 21, 22])]
    ident = lambda k, e, n: np.arange(n)  # noqa: E731
    t = plan.steps_table(np.array([0, 1]), np.array([5, 3]), np.array([3, 2]), 4, 2, rows, ident)
    assert t.tolist() == [
        [10, 11, 12, 13, 14, -1, 10, 11],  # the pass's last batch padded, then a new pass
        [20, 21, 22, -1, 20, 21, 22, -1],
    ]
    t = plan.steps_table(np.array([0]), np.array([5]), np.array([2]), 3, 2, rows, ident)  # drop_last: 2 full batches
    assert t.tolist() == [[10, 11, 12, 13, 10, 11]]
    rev = lambda k, e, n: np.arange(n)[::-1] if e % 2 else np.arange(n)  # noqa: E731  pass e in its own order
    t = plan.steps_table(np.array([1]), np.array([3]), np.array([2]), 3, 2, rows, rev)
    assert t.tolist() == [[20, 21, 22, -1, 22, 21]]


def test_engine_plans_with_these_functions():
    train, test, part, model = setup_data()
    cfg = fedfast.SimConfig(algorithm="fedavg", clients_per_round=3, local_steps=3, seed=4)
    sim = fedfast.Simulation(cfg, model, train, test, part)
    sim.round()
    assert np.array_equal(sim.plan.clients(sim.rnd), sample_clients(4, 1, sim.K, 3))
    ctx, _, step_rows = sim.plan.sample(sim.rnd)
    want = plan.steps_table(
        ctx.sampled,
        ctx.sizes,
        ctx.data_batches,
        3,
        cfg.batch_size,
        sim.plan.client_rows,
        lambda k, e, n: client_order(4, 1, k, e, n),
    )
    assert np.array_equal(step_rows, want)
