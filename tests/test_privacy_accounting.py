"""Issue 49, the accounting of private rounds (fedfast.privacy): epsilon equal to dp-accounting called directly for
each sampling and accountant, an analytic check where no subsampling happens (T Gaussian mechanisms compose to one of
noise multiplier z / sqrt(T): Balle & Wang's analytic epsilon), the calibration of the noise multiplier to a target
epsilon, the budget check, and refusals by name."""

import math

import pytest

dpa = pytest.importorskip("dp_accounting")
from fedfast import privacy  # noqa: E402


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_poisson_rounds_equal_the_library_called_directly(kind):
    z, q, T, delta = 1.1, 0.1, 50, 1e-5
    acc = dpa.rdp.RdpAccountant() if kind == "rdp" else dpa.pld.PLDAccountant()
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), T)
    want = acc.get_epsilon(delta)
    got = privacy.epsilon(z, delta, T, sampling="poisson", num_clients=1000, rate=q, accountant=kind)
    assert got == pytest.approx(want, rel=1e-12) and 0 < got < math.inf


def test_fixed_size_rounds_equal_the_library_with_replace_one():
    """Replace-one neighbouring: one client replaced moves the clipped sum by up to 2C, so the library's formula gets
    the multiplier z / 2 (relative to that sensitivity; dp-accounting passes GaussianDpEvent's z, relative to C,
    through unchanged: google/differential-privacy issue 378)."""
    z, K, m, T, delta = 1.3, 100, 10, 40, 1e-5
    acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    acc.compose(dpa.SampledWithoutReplacementDpEvent(K, m, dpa.GaussianDpEvent(z / 2)), T)
    got = privacy.epsilon(z, delta, T, sampling="fixed", num_clients=K, clients_per_round=m)
    assert got == pytest.approx(acc.get_epsilon(delta), rel=1e-12)
    with pytest.raises(ValueError, match="dp_accountant"):
        privacy.epsilon(z, delta, T, sampling="fixed", num_clients=K, clients_per_round=m, accountant="pld")


def test_fixed_size_without_subsampling_is_a_gaussian_of_sensitivity_2c():
    """m = K: every round is the Gaussian mechanism on a sum whose replace-one sensitivity is 2C; T rounds compose to
    one of multiplier z / (2 sqrt(T)). The RDP epsilon bounds its exact (analytic) epsilon from above and stays
    within 1.5x of it: with z instead of z / 2 (sensitivity taken as C) it would fall below, and a library that
    halved it again would pass 1.5x."""
    z, K, T, delta = 6.0, 20, 16, 1e-5
    exact = dpa.get_epsilon_gaussian(z / 2 / math.sqrt(T), delta)
    got = privacy.epsilon(z, delta, T, sampling="fixed", num_clients=K, clients_per_round=K)
    assert exact * 0.999 <= got <= 1.5 * exact, (got, exact)


def test_without_subsampling_rounds_compose_to_one_gaussian():
    """q = 1: T rounds at z are one Gaussian mechanism at z / sqrt(T); the PLD accountant's epsilon is the analytic
    one (Balle & Wang) up to its discretisation, the RDP one an upper bound."""
    z, T, delta = 4.0, 16, 1e-5
    exact = dpa.get_epsilon_gaussian(z / math.sqrt(T), delta)
    pld = privacy.epsilon(z, delta, T, sampling="poisson", num_clients=10, rate=1.0, accountant="pld")
    rdp = privacy.epsilon(z, delta, T, sampling="poisson", num_clients=10, rate=1.0, accountant="rdp")
    assert pld == pytest.approx(exact, rel=2e-2) and rdp >= pld * 0.999


def test_more_rounds_or_less_noise_spend_more():
    kw = dict(sampling="poisson", num_clients=1000, rate=0.1)
    e = [privacy.epsilon(1.0, 1e-5, T, **kw) for T in (0, 1, 10, 100)]
    assert e[0] == 0 and e[1] < e[2] < e[3]
    assert privacy.epsilon(2.0, 1e-5, 100, **kw) < e[3] and privacy.epsilon(0.0, 1e-5, 5, **kw) == math.inf


@pytest.mark.parametrize("target", [1.0, 8.0])
def test_calibrated_noise_spends_the_target(target):
    kw = dict(sampling="poisson", num_clients=1000, rate=0.1)
    z = privacy.calibrate(target, 1e-5, 100, **kw)
    assert privacy.epsilon(z, 1e-5, 100, **kw) <= target * (1 + 1e-9)
    assert privacy.epsilon(z * 0.99, 1e-5, 100, **kw) > target  # the smallest such multiplier, within 1 %


def test_the_budget_refuses_more_rounds_and_bad_values_are_named():
    z = privacy.calibrate(4.0, 1e-5, 20, sampling="poisson", num_clients=500, rate=0.1)
    acc = privacy.Accountant(z, 1e-5, sampling="poisson", num_clients=500, rate=0.1, max_epsilon=4.0)
    assert acc.check_plan(20) <= 4.0 and acc.epsilon(10) < acc.epsilon(20)
    with pytest.raises(ValueError, match="rounds: 40 private rounds"):
        acc.check_plan(40)
    base = dict(sampling="poisson", num_clients=100, rate=0.1)
    for kw, key in (
        (dict(base, rate=0.0), "client_rate"),
        (dict(base, sampling="bernoulli"), "client_sampling"),
        (dict(base, accountant="prv"), "dp_accountant"),
        (dict(sampling="fixed", num_clients=10, clients_per_round=11), "clients_per_round"),
    ):
        with pytest.raises(ValueError, match=key):
            privacy.epsilon(1.0, 1e-5, 3, **kw)
    with pytest.raises(ValueError, match="dp_delta"):
        privacy.epsilon(1.0, 1.5, 3, **base)
    with pytest.raises(ValueError, match="dp_noise_multiplier"):
        privacy.epsilon(-1.0, 1e-5, 3, **base)
    with pytest.raises(ValueError, match="dp_epsilon"):
        privacy.calibrate(0.0, 1e-5, 3, **base)
