"""User-level differential privacy for federated rounds (issue 49): the privacy accounting.

The mechanism accounted for is DP-FedAvg's (McMahan et al., ICLR 2018): each sampled client's update is clipped to
L2 norm ``dp_clip``, the clipped updates are summed, Gaussian noise of standard deviation
``dp_noise_multiplier * dp_clip`` is added to the sum, and the sum is divided by the expected cohort size. One
client changes the sum by at most ``dp_clip``, so a round is one Gaussian mechanism of noise multiplier
``z = dp_noise_multiplier`` on a subsample of the clients, and rounds compose:

* **Poisson sampling** at rate ``q`` (every client joins a round independently; the cohort may be empty):
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` under add/remove-one-client neighbouring;
* **fixed-size sampling** of ``m`` of ``K`` clients without replacement (fedfast's default sampling):
  ``SampledWithoutReplacementDpEvent(K, m, GaussianDpEvent(z / 2))`` under replace-one-client neighbouring, the
  relation that analysis holds for (dp-accounting's RDP accountant covers it; its PLD accountant does not, and the
  pair is refused by name). Replacing one client moves the clipped sum by up to ``2 C``, and the accountant's
  formula takes the noise multiplier relative to that sensitivity, so it is given ``z / 2``: dp-accounting (0.6)
  passes ``GaussianDpEvent``'s multiplier (defined relative to ``C``) through unchanged under replace-one, which
  would understate epsilon (google/differential-privacy issue 378);
* ``T`` rounds: ``SelfComposedDpEvent(event, T)``; ``epsilon`` at ``dp_delta`` from the RDP or PLD accountant of
  Google's dp-accounting library (an optional dependency: ``pip install "fedfast[privacy]"``).

:func:`epsilon` gives the budget spent after ``rounds`` rounds, :func:`calibrate` the noise multiplier that spends a
target epsilon in the planned rounds, :class:`Accountant` the per-run record (epsilon after every round).
"""

from __future__ import annotations

import contextlib
import logging
import math

SAMPLINGS = ("poisson", "fixed")
ACCOUNTANTS = ("rdp", "pld")


def _dpa():
    try:
        import dp_accounting
    except ImportError:
        raise ImportError(
            "dp_accountant: privacy accounting needs Google's dp-accounting library: "
            'pip install "fedfast[privacy]" (or pip install dp-accounting)'
        ) from None
    return dp_accounting


@contextlib.contextmanager
def _quiet():
    """dp-accounting's RDP accountant logs (absl) every Renyi order it drops for not converging, once per call;
    the orders left still bound epsilon, so the run's log is spared them."""
    log = logging.getLogger("absl")
    old = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(old)


def check_accounting(delta, sampling: str, accountant: str) -> None:
    """The accounting settings a run can check before it knows its clients (:class:`fedfast.SimConfig` too):
    ``dp_delta``, ``dp_accountant``, and the one pair dp-accounting does not cover (PLD with fixed-size sampling)."""
    if sampling not in SAMPLINGS:
        raise ValueError(
            f"client_sampling: private rounds are accounted for 'poisson' or 'fixed' sampling, got {sampling!r}"
        )
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"dp_accountant: must be one of {ACCOUNTANTS}, got {accountant!r}")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"dp_delta: in (0, 1), got {delta!r}")
    if sampling == "fixed" and accountant == "pld":
        raise ValueError(
            "dp_accountant: dp-accounting's PLD accountant does not cover fixed-size sampling "
            'without replacement; use dp_accountant = "rdp" or client_sampling = "poisson"'
        )


def _check(noise_multiplier, delta, rounds, sampling, num_clients, clients_per_round, rate, accountant):
    check_accounting(delta, sampling, accountant)
    if noise_multiplier is not None and not (
        isinstance(noise_multiplier, (int, float)) and noise_multiplier >= 0 and math.isfinite(noise_multiplier)
    ):
        raise ValueError(f"dp_noise_multiplier: a finite number >= 0, got {noise_multiplier!r}")
    if not (isinstance(rounds, int) and rounds >= 0):
        raise ValueError(f"rounds: an integer >= 0, got {rounds!r}")
    if not (isinstance(num_clients, int) and num_clients >= 1):
        raise ValueError(f"num_clients: an integer >= 1, got {num_clients!r}")
    if sampling == "poisson":
        if not (isinstance(rate, (int, float)) and 0 < rate <= 1):
            raise ValueError(f"client_rate: Poisson sampling's rate q in (0, 1], got {rate!r}")
    else:
        if not (isinstance(clients_per_round, int) and 1 <= clients_per_round <= num_clients):
            raise ValueError(f"clients_per_round: in [1, num_clients = {num_clients}], got {clients_per_round!r}")


def round_event(
    noise_multiplier: float,
    sampling: str,
    num_clients: int,
    clients_per_round: int | None = None,
    rate: float | None = None,
):
    """The dp-accounting event of one private round (see the module docstring)."""
    dpa = _dpa()
    if sampling == "poisson":  # add/remove one client: the sum moves by up to C
        return dpa.PoissonSampledDpEvent(rate, dpa.GaussianDpEvent(noise_multiplier))
    # replace one client: by up to 2 C, the multiplier relative to that sensitivity (module docstring)
    return dpa.SampledWithoutReplacementDpEvent(
        num_clients, clients_per_round, dpa.GaussianDpEvent(noise_multiplier / 2)
    )


def _fresh(accountant: str, sampling: str):
    dpa = _dpa()
    rel = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE if sampling == "poisson" else dpa.NeighboringRelation.REPLACE_ONE
    return (
        dpa.rdp.RdpAccountant(neighboring_relation=rel)
        if accountant == "rdp"
        else dpa.pld.PLDAccountant(neighboring_relation=rel)
    )


def epsilon(
    noise_multiplier: float,
    delta: float,
    rounds: int,
    *,
    sampling: str,
    num_clients: int,
    clients_per_round: int | None = None,
    rate: float | None = None,
    accountant: str = "rdp",
) -> float:
    """Epsilon at ``delta`` after ``rounds`` private rounds (``inf`` without noise, 0 after no round)."""
    _check(noise_multiplier, delta, rounds, sampling, num_clients, clients_per_round, rate, accountant)
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    acc = _fresh(accountant, sampling)
    with _quiet():
        acc.compose(round_event(noise_multiplier, sampling, num_clients, clients_per_round, rate), rounds)
        return float(acc.get_epsilon(delta))


def calibrate(
    target_epsilon: float,
    delta: float,
    rounds: int,
    *,
    sampling: str,
    num_clients: int,
    clients_per_round: int | None = None,
    rate: float | None = None,
    accountant: str = "rdp",
    tol: float = 1e-3,
) -> float:
    """The smallest noise multiplier (to ``tol``) whose ``rounds`` rounds spend at most ``target_epsilon`` at
    ``delta`` (``dp_epsilon`` given instead of ``dp_noise_multiplier``)."""
    _check(None, delta, rounds, sampling, num_clients, clients_per_round, rate, accountant)
    if not (isinstance(target_epsilon, (int, float)) and 0 < target_epsilon < math.inf):
        raise ValueError(f"dp_epsilon: a finite number > 0, got {target_epsilon!r}")
    if rounds < 1:
        raise ValueError(f"rounds: a budget is spent over >= 1 round, got {rounds!r}")
    dpa = _dpa()

    def event(z):
        return dpa.SelfComposedDpEvent(round_event(z, sampling, num_clients, clients_per_round, rate), rounds)

    with _quiet():
        return float(
            dpa.calibrate_dp_mechanism(
                lambda: _fresh(accountant, sampling),
                event,
                target_epsilon,
                delta,
                bracket_interval=dpa.LowerEndpointAndGuess(1e-3, 1.0),
                tol=tol,
            )
        )


class Accountant:
    """A private run's accounting: the budget spent after each round (``epsilon(r)``), and the refusal of a run
    whose rounds would spend more than ``max_epsilon`` (a resume with more rounds, say)."""

    def __init__(
        self,
        noise_multiplier: float,
        delta: float,
        *,
        sampling: str,
        num_clients: int,
        clients_per_round: int | None = None,
        rate: float | None = None,
        accountant: str = "rdp",
        max_epsilon: float | None = None,
    ):
        _check(noise_multiplier, delta, 0, sampling, num_clients, clients_per_round, rate, accountant)
        self.kw = dict(
            sampling=sampling,
            num_clients=num_clients,
            clients_per_round=clients_per_round,
            rate=rate,
            accountant=accountant,
        )
        self.noise_multiplier, self.delta, self.max_epsilon = noise_multiplier, delta, max_epsilon
        self._rdp_z = self._orders = self._rdp = None  # one round's RDP curve, for the multiplier _rdp_z

    def epsilon(self, rounds: int) -> float:
        """Epsilon after ``rounds`` rounds. RDP composes linearly, so one round's RDP curve is computed once (the
        subsampled Gaussian's orders: 0.1-0.2 s on a CPU core) and each round's epsilon is its conversion at
        ``rounds`` times it (dp-accounting's ``compute_epsilon``); PLD composes each time."""
        if self.kw["accountant"] != "rdp" or rounds == 0 or self.noise_multiplier == 0:
            return epsilon(self.noise_multiplier, self.delta, rounds, **self.kw)
        _check(
            self.noise_multiplier,
            self.delta,
            rounds,
            self.kw["sampling"],
            self.kw["num_clients"],
            self.kw["clients_per_round"],
            self.kw["rate"],
            "rdp",
        )
        if self._rdp_z != self.noise_multiplier:
            acc = _fresh("rdp", self.kw["sampling"])
            with _quiet():
                acc.compose(
                    round_event(
                        self.noise_multiplier,
                        self.kw["sampling"],
                        self.kw["num_clients"],
                        self.kw["clients_per_round"],
                        self.kw["rate"],
                    ),
                    1,
                )
            self._rdp_z, self._orders, self._rdp = self.noise_multiplier, acc.orders, acc.rdp
        rdp = _dpa().rdp.rdp_privacy_accountant
        return float(rdp.compute_epsilon(self._orders, rounds * self._rdp, self.delta)[0])

    def check_plan(self, rounds: int) -> float:
        """Epsilon after ``rounds``; a ValueError naming ``rounds`` if it passes ``max_epsilon``."""
        eps = self.epsilon(rounds)
        if self.max_epsilon is not None and eps > self.max_epsilon * (1 + 1e-9):
            raise ValueError(
                f"rounds: {rounds} private rounds spend epsilon = {eps:.4g} at delta = {self.delta:g}, "
                f"past the run's budget dp_epsilon = {self.max_epsilon:g}"
            )
        return eps
