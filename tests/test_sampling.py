"""fedfast.sampling alone: the seeded cohorts and data orders, each written out as the papers' code draws it
(issue 37)."""

import numpy as np

from fedfast.sampling import client_order, sample_clients, sample_clients_bernoulli, sample_clients_round_seeded


def test_sample_clients_is_seeded_sorted_and_distinct():
    a = sample_clients(3, 7, 100, 10)
    assert np.array_equal(a, sample_clients(3, 7, 100, 10)) and len(set(a.tolist())) == 10
    assert np.array_equal(a, np.sort(a)) and a.min() >= 0 and a.max() < 100
    assert not np.array_equal(a, sample_clients(3, 8, 100, 10)) and not np.array_equal(a, sample_clients(4, 7, 100, 10))
    assert np.array_equal(a, np.sort(np.random.default_rng([3, 7, 10**6]).choice(100, size=10, replace=False)))


def test_bernoulli_is_asds_draw_and_redraws_an_empty_cohort():
    K, p, seed, rnd = 50, 0.1, 2, 4
    u = np.random.RandomState(rnd + seed).uniform(size=K)
    assert np.array_equal(sample_clients_bernoulli(seed, rnd, K, p), np.nonzero(u <= p)[0])
    # p so small that the first draws are empty: the retries (seed offset by one each) give the first non-empty
    K, p = 3, 0.01
    retry = 0
    while not (np.random.RandomState(rnd + seed + retry).uniform(size=K) <= p).any():
        retry += 1
    assert retry > 0
    want = np.nonzero(np.random.RandomState(rnd + seed + retry).uniform(size=K) <= p)[0]
    assert np.array_equal(sample_clients_bernoulli(seed, rnd, K, p), want) and len(want)


def test_round_seeded_ignores_the_runs_seed():
    got = sample_clients_round_seeded(5, 100, 10)
    assert np.array_equal(got, np.sort(np.random.RandomState(5).choice(100, 10, replace=False)))


def test_client_order_is_a_seeded_permutation_per_client_and_epoch():
    o = client_order(1, 2, 3, 0, 20)
    assert sorted(o.tolist()) == list(range(20)) and np.array_equal(o, client_order(1, 2, 3, 0, 20))
    others = [
        client_order(1, 2, 3, 1, 20),
        client_order(1, 2, 4, 0, 20),
        client_order(1, 3, 3, 0, 20),
        client_order(2, 2, 3, 0, 20),
    ]
    assert all(not np.array_equal(o, x) for x in others)


def test_shuffled_takes_each_client_once_per_epoch():
    """client_sampling = "shuffled": K // m rounds per epoch, each a distinct block of one seeded permutation (the
    K mod m left over sit the epoch out); another epoch, another permutation; the seed decides."""
    from fedfast.sampling import sample_clients_shuffled

    K, m = 23, 5
    per = K // m
    for e in range(3):
        got = [sample_clients_shuffled(7, e * per + i, K, m) for i in range(per)]
        allc = np.concatenate(got)
        assert all(len(c) == m and (np.diff(c) > 0).all() for c in got)
        assert len(np.unique(allc)) == per * m  # nobody twice in an epoch
    first = [sample_clients_shuffled(7, i, K, m).tolist() for i in range(per)]
    second = [sample_clients_shuffled(7, per + i, K, m).tolist() for i in range(per)]
    assert first != second and first != [sample_clients_shuffled(8, i, K, m).tolist() for i in range(per)]
    perm = np.random.default_rng([7, 0, 10**6 + 2]).permutation(K)  # the draw written out
    assert sample_clients_shuffled(7, 1, K, m).tolist() == sorted(perm[5:10].tolist())
