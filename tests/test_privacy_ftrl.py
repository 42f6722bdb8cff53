"""DP-FTRL (issue 58; Kairouz et al., ICML 2021): the engine against the literal loop written from the definition
(each round's model the tree's anchor plus the noised nodes of the round's binary decomposition), the participation
count against a brute-force enumeration of the released nodes, the accounting against dp-accounting's single-epoch
tree event, and an audit from outside: the noise's covariance across rounds and one client's shift measured, epsilon
recomputed from them."""

import copy
import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sequential_loop import sequential, setup_data

import fedfast
from fedfast.privacy import DPFTRL, PrivacySettings, Secret
from fedfast.privacy.ftrl import TREE, participation

dpa = pytest.importorskip("dp_accounting")

BASE = dict(clients_per_round=4, rounds=6, local_epochs=1, batch_size=16, lr=0.05, seed=3, max_grad_norm=0.0)


def _sim(schedule=None, **kw):
    train, test, part, model = setup_data("mlp")
    cfg = fedfast.SimConfig(algorithm="fedavg", dp_mechanism="dp_ftrl", dp_clip=0.05, **{**BASE, **kw})
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part, schedule=schedule)
    return cfg, sim, (train, test, part, model)


@pytest.mark.parametrize("restart", [None, 4])
def test_ftrl_rounds_equal_the_literal_loop(restart):
    """Six rounds (restart None: one tree; 4: a second tree from round 5), clip 0.05 (every delta clipped), z 0.7:
    the engine's incremental noise (the new node in, the dropped ones out) equals the loop's nodes summed afresh each
    round; a loop that never restarts, or draws every round's noise afresh (DP-FedAvg), lands elsewhere."""
    cfg, sim, (train, _, part, model) = _sim(dp_noise_multiplier=0.7, dp_ftrl_restart=restart)
    start = copy.deepcopy(sim.model).cpu()
    sim.run()
    sec = sim.privacy.secret

    def loop(restart_):
        tree = dict(
            restart=restart_,
            node=lambda t, lev, st: torch.randn(sim.num_params, generator=sec.generator("cpu", TREE, t, lev, st)),
        )
        return sequential(
            cfg, copy.deepcopy(start), train, part, cfg.rounds, dp=dict(clip=0.05, z=0.7, E=4.0, tree=tree)
        )

    ref = loop(restart)
    err = float((sim.global_flat.cpu() - ref).abs().max() / ref.abs().max())
    assert err <= 1e-6, err
    other = loop(None if restart else 4)
    assert float((other - ref).abs().max() / ref.abs().max()) > 1e-2


def _released_nodes(r, restart):
    """Brute force: the (first, last) rounds (1-based, in the run) of every node released by round r: a node of a
    tree is released once a prefix sum uses it, i.e. the left-aligned dyadic intervals [a 2^l + 1, (a + 1) 2^l]
    with a even that end by then."""
    R = restart or r
    out = []
    for tree_start in range(0, r, R):
        end = min(r, tree_start + R) - tree_start
        for lev in range(int(math.log2(max(end, 1))) + 1):
            for a in range(0, end >> lev):
                if a % 2 == 0 and (a + 1) << lev <= end:
                    out.append((tree_start + (a << lev) + 1, tree_start + ((a + 1) << lev)))
    return out


@pytest.mark.parametrize("restart", [None, 3, 8])
def test_participation_equals_a_brute_force_count(restart):
    rng = np.random.default_rng(0)
    K, T = 12, 19
    cohorts = [np.sort(rng.choice(K, size=rng.integers(0, 6), replace=False)) for _ in range(T)]
    got = participation(cohorts, restart)
    for r in range(1, T + 1):
        best = 0
        for k in range(K):
            s = 0
            for lo, hi in _released_nodes(r, restart):
                m = sum(k in cohorts[t - 1] for t in range(lo, hi + 1))
                s += m * m
            best = max(best, s)
        assert got[r - 1] == best, (r, got[r - 1], best)


def _mechanism(cohorts, rounds, z=1.0, restart=None, secret=None, accountant="rdp", **kw):
    kw.setdefault("clients_per_round", max(len(c) for c in cohorts))
    cfg = fedfast.SimConfig(
        algorithm="fedavg",
        rounds=rounds,
        dp_mechanism="dp_ftrl",
        dp_clip=1.0,
        dp_noise_multiplier=z,
        dp_ftrl_restart=restart,
        dp_accountant=accountant,
        **kw,
    )
    K = 1 + max(int(c.max()) for c in cohorts if len(c))
    return DPFTRL(
        PrivacySettings.of(cfg), num_clients=max(K, 10**4), device="cpu", cohorts=lambda r: cohorts[r], secret=secret
    )


@pytest.mark.parametrize("epochs,R", [(1, 7), (1, 8), (3, 5)])
def test_one_participation_per_tree_equals_dp_accountings_tree_event(epochs, R):
    """A round-robin schedule (every client once per tree, the tree restarted each epoch): epsilon equals
    dp-accounting's SingleEpochTreeAggregationDpEvent (REPLACE_SPECIAL, ceil(log2(R + 1)) per tree), composed over the
    epochs; the worst client joins the first round of each tree, where that bound is met."""
    m = 3
    cohorts = [np.arange(m) + m * (r % R) for r in range(epochs * R)]
    z = 2.0
    mech = _mechanism(cohorts, epochs * R, z=z, restart=R)
    acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_SPECIAL)
    acc.compose(dpa.SelfComposedDpEvent(dpa.SingleEpochTreeAggregationDpEvent(z, R), epochs))
    assert mech.epsilon(epochs * R) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


def test_every_round_participation_grows_as_the_tree_sums_it():
    """A client in every round of T = 8 leaves: its nodes hold 1, 2, 4 and 8 of its rounds, sum_j m_j^2 =
    8 * 1 + 4 * 4 + 2 * 16 + 1 * 64 over all nodes, of which the released ones (a even) are 4, 2, 1, 1 of each
    level: 4 + 2 * 4 + 16 + 64 = 92."""
    cohorts = [np.array([0])] * 8
    assert participation(cohorts, None)[-1] == 92


def _release(mech, g, U, rnd):
    ctx = SimpleNamespace(sums={}, index=rnd)
    mech.begin_round(ctx)
    n = U.shape[0]
    w = torch.ones(n)
    out = fedfast.ops.aggregate(g + U, g, rows=n, **mech.bound({}, w, None))
    return mech.average(g, mech.chunk_sum(out, w, g), float(n), ctx).double()


def test_ftrl_audit_from_the_measured_noise_and_shift():
    """Six rounds of one tree; client 0 joins rounds 1, 2, 3 and 5, nine others once each. From outside: the noise
    of the released increments measured over 400 secrets (its T x T covariance, shared by the coordinates), and
    client 0's shift measured by running each of its rounds with and without it (an update far past the clip);
    epsilon of one Gaussian mechanism of multiplier 1 / sqrt(shift' cov^-1 shift) equals the reported one (3 %),
    and the cumulative noise after round t has variance popcount(t) (z C / E)^2, the tree's, not t times it."""
    T, P, E = 6, 48, 4
    others = iter(range(1, 100))
    joins = {1, 2, 3, 5}
    cohorts = [np.array(([0] if t in joins else []) + [next(others) for _ in range(2)]) for t in range(1, T + 1)]
    gen = torch.Generator().manual_seed(0)
    U = torch.randn(2, P, generator=gen) * 0.3  # the other clients' updates (inside the clip)
    u = torch.randn(P, generator=gen)
    u = u / u.norm() * 50.0  # client 0: far past the clip
    g = torch.zeros(P)
    z = 1.3
    cfg_kw = dict(clients_per_round=E)
    draws = []
    for i in range(400):
        mech = _mechanism(cohorts, T, z=z, secret=Secret(1000 + i), **cfg_kw)
        draws.append(torch.stack([_release(mech, g, U, r) for r in range(T)]))  # [T, P]
    X = torch.stack(draws)  # [N, T, P]
    noise = X - X.mean(0)
    cov = torch.einsum("ntp,nsp->ts", noise, noise) / (noise.shape[0] - 1) / P  # [T, T]
    sigma = z * 1.0 / E
    cum = torch.cumsum(noise, 1).pow(2).mean((0, 2))  # the cumulative noise's variance after each round
    popcount = torch.tensor([bin(t).count("1") for t in range(1, T + 1)], dtype=torch.float64)
    assert torch.allclose(cum / sigma**2, popcount, rtol=0.05), cum / sigma**2
    mech = _mechanism(cohorts, T, z=z, secret=Secret(7), **cfg_kw)
    shift = torch.stack(
        [
            _release(mech, g, torch.cat([U, u[None]]), r) - _release(mech, g, U, r)
            if r + 1 in joins
            else torch.zeros(P, dtype=torch.float64)
            for r in range(T)
        ]
    )  # [T, P]: the same noise on both sides
    mu = math.sqrt(float(torch.einsum("tp,ts,sp->", shift, torch.linalg.inv(cov), shift)))
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.GaussianDpEvent(1 / mu))
    measured = acc.get_epsilon(1e-5)
    assert mech.epsilon(T) == pytest.approx(measured, rel=0.03), (mech.epsilon(T), measured)


def test_public_cohorts_run_and_calibrate():
    """DP-FTRL takes a given schedule and round_seeded cohorts (refused under DP-FedAvg), records them (they are
    public), and calibrates dp_epsilon from the schedule's participation."""
    sched = [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]
    _, sim, _ = _sim(schedule=sched, dp_epsilon=4.0, rounds=4)
    hist = sim.run()
    assert sorted(hist[-1]["clients"]) == [4, 5, 6, 7]
    assert 3.5 < hist[-1]["dp_epsilon"] <= 4.0 and hist[-1]["train_loss"] is None
    _, sim, _ = _sim(client_sampling="round_seeded", dp_noise_multiplier=1.0)
    assert sim.run()[-1]["dp_epsilon"] > 0


def test_ftrl_resumes_bit_for_bit_and_refuses_other_cohorts():
    cfg, sim, (train, test, part, model) = _sim(dp_noise_multiplier=0.7, dp_ftrl_restart=4)
    for _ in range(3):
        sim.round()
    ck = sim.checkpoint()
    sim.run()
    again = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    again.restore(ck)
    again.run()
    assert torch.equal(again.global_flat, sim.global_flat)
    sched = [[0, 1, 2, 3]] * 6
    other = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part, schedule=sched)
    with pytest.raises(ValueError, match="schedule: the checkpoint's 3 rounds ran other cohorts"):
        other.restore(ck)
    restarted = fedfast.SimConfig(**{**cfg.__dict__, "dp_ftrl_restart": 2})
    with pytest.raises(ValueError, match="^dp_ftrl_restart: the checkpoint's"):
        fedfast.Simulation(restarted, copy.deepcopy(model), train, test, part).restore(ck)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(dp_clip_quantile=0.5), "dp_clip_quantile: adaptive clipping is DP-FedAvg's"),
        (dict(dp_ftrl_restart=0), "dp_ftrl_restart: rounds per tree"),
        (dict(dp_mechanism="ftrl"), "dp_mechanism: one of"),
        (dict(dp_mechanism="dp_fedavg", dp_ftrl_restart=4), "dp_ftrl_restart: a DP-FTRL key"),
    ],
)
def test_ftrl_refusals_name_the_key(kw, match):
    base = dict(algorithm="fedavg", dp_clip=1.0, dp_noise_multiplier=1.0, dp_mechanism="dp_ftrl")
    with pytest.raises(ValueError, match=match):
        fedfast.SimConfig(**{**base, **kw})
    with pytest.raises(ValueError, match="dp_mechanism: a private-run key"):
        fedfast.SimConfig(dp_mechanism="dp_ftrl")


def test_the_brute_force_enumeration_is_itself_right():
    """The brute force above, on T = 4 without restart: the released nodes are [1,1], [1,2], [3,3], [1,4]."""
    assert sorted(_released_nodes(4, None)) == [(1, 1), (1, 2), (1, 4), (3, 3)]
    assert sorted(_released_nodes(5, 3)) == [(1, 1), (1, 2), (3, 3), (4, 4), (4, 5)]
    assert list(itertools.chain(_released_nodes(1, None))) == [(1, 1)]


def test_shuffled_epochs_with_a_tree_each():
    """client_sampling = "shuffled" with dp_ftrl_restart = K // m: each client joins each tree once, so epsilon is at
    most dp-accounting's single-epoch tree event composed over the epochs (its bound assumes the worst leaf in every
    tree), and at least one epoch of it (some client sits at the first leaf of a tree)."""
    from fedfast.sampling import sample_clients_shuffled

    K, m, epochs, z = 24, 4, 3, 2.0
    R = K // m
    cohorts = [sample_clients_shuffled(5, r, K, m) for r in range(epochs * R)]
    mech = _mechanism(cohorts, epochs * R, z=z, restart=R)

    def lib(n):
        acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_SPECIAL)
        acc.compose(dpa.SelfComposedDpEvent(dpa.SingleEpochTreeAggregationDpEvent(z, R), n))
        return acc.get_epsilon(1e-5)

    assert lib(1) <= mech.epsilon(epochs * R) <= lib(epochs) * (1 + 1e-9)
    _, sim, _ = _sim(client_sampling="shuffled", dp_noise_multiplier=1.0, dp_ftrl_restart=2, clients_per_round=4)
    assert sim.run()[-1]["dp_epsilon"] > 0
    with pytest.raises(ValueError, match="client_sampling: 'shuffled' takes each client once per epoch"):
        fedfast.SimConfig(algorithm="fedavg", client_sampling="shuffled", dp_clip=1.0, dp_noise_multiplier=1.0)
