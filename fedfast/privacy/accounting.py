"""The accounting of private rounds: epsilon spent, the noise that spends a budget, the per-run record.

A private round of DP-FedAvg (:class:`fedfast.privacy.DPFedAvg`) is one Gaussian mechanism on the round's clipped
sum, applied to a subsample of the clients, and rounds compose:

* **Poisson sampling** at rate ``q`` (every client joins a round independently; the cohort may be empty):
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` under add/remove-one-client neighbouring (one client moves the
  clipped sum by up to ``C``; the noise's std is ``z C``);
* **fixed-size sampling** of ``m`` of ``K`` clients without replacement (``client_sampling = "uniform"``):
  ``SampledWithoutReplacementDpEvent(K, m, GaussianDpEvent(z / 2))`` under replace-one-client neighbouring, the
  relation that analysis holds for (dp-accounting's RDP accountant covers it; its PLD accountant does not: refused by
  name). Replacing one client moves the clipped sum by up to ``2 C``, and the accountant's formula takes the noise
  multiplier relative to that sensitivity, so it is given ``z / 2``: dp-accounting (0.6) passes
  ``GaussianDpEvent``'s multiplier through unchanged under replace-one, which would understate epsilon
  (google/differential-privacy issue 378). This bound is correct and loose: the same noise under Poisson sampling
  at ``q = m / K`` reports a far smaller epsilon (:func:`poisson_epsilon`; a private run says both);
* ``T`` rounds: ``SelfComposedDpEvent(event, T)``; ``epsilon`` at ``dp_delta`` from the RDP or PLD accountant of
  Google's dp-accounting library (an optional dependency: ``pip install "fedfast[privacy]"``).

Adaptive clipping's count of unclipped updates is released beside the sum; the mechanism centres it and noises the
update with the share of ``z`` the count leaves (:class:`fedfast.privacy.DPFedAvg`), so the pair is one Gaussian
mechanism of multiplier ``z`` under both relations and is accounted here as above.

:func:`epsilon` gives the budget spent after ``rounds`` rounds, :func:`calibrate` the smallest noise multiplier
that spends a target epsilon in the planned rounds (to a relative tolerance; the PLD search bracketed from the RDP
answer), :class:`Accountant` the per-run record (epsilon after every round).
"""

from __future__ import annotations

import contextlib
import logging
import math

SAMPLINGS = ("poisson", "fixed")
# the largest noise multiplier a calibration considers: beyond it the RDP accountant's epsilon sits on the floor its
# finite orders leave (0.045 for 100 rounds of 10 of 100 clients, any z from 1e3 to 4e5), so a target below that
# floor would run the search to absurd multipliers (4e5 in 27 s) for a model that learns nothing
MAX_MULTIPLIER = 1e4
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


def check_delta(delta, num_clients: int | None = None) -> None:
    """``dp_delta`` in (0, 1), and below ``1 / num_clients`` when the number of clients is known: a mechanism that
    publishes one client's whole data with probability ``delta`` meets ``(0, delta)``-DP for ``delta >= 1 / K``, so
    such a delta promises nothing."""
    if isinstance(delta, bool) or not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"dp_delta: in (0, 1), got {delta!r}")
    if num_clients is not None and delta * num_clients >= 1:
        raise ValueError(
            f"dp_delta: {delta:g} is not below 1 / num_clients = {1 / num_clients:.3g}: a mechanism that publishes "
            f"one client's whole data with probability delta meets it, so it promises nothing; take dp_delta well "
            f"below 1 / num_clients (1e-5, or 1 / num_clients**1.1)"
        )


def check_accounting(delta, sampling: str, accountant: str, num_clients: int | None = None) -> None:
    """The accounting settings a run can check before it trains (:class:`fedfast.SimConfig` too, without the number
    of clients): ``dp_delta``, ``dp_accountant``, and the one pair dp-accounting does not cover (PLD with
    fixed-size sampling)."""
    if sampling not in SAMPLINGS:
        raise ValueError(
            f"client_sampling: private rounds are accounted for 'poisson' or 'fixed' sampling, got {sampling!r}"
        )
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"dp_accountant: must be one of {ACCOUNTANTS}, got {accountant!r}")
    check_delta(delta, num_clients)
    if sampling == "fixed" and accountant == "pld":
        raise ValueError(
            "dp_accountant: dp-accounting's PLD accountant does not cover fixed-size sampling "
            'without replacement; use dp_accountant = "rdp" or client_sampling = "poisson"'
        )


def _check(noise_multiplier, delta, rounds, sampling, num_clients, clients_per_round, rate, accountant):
    if not (isinstance(num_clients, int) and num_clients >= 1):
        raise ValueError(f"num_clients: an integer >= 1, got {num_clients!r}")
    check_accounting(delta, sampling, accountant, num_clients)
    if noise_multiplier is not None and not (
        isinstance(noise_multiplier, (int, float)) and noise_multiplier >= 0 and math.isfinite(noise_multiplier)
    ):
        raise ValueError(f"dp_noise_multiplier: a finite number >= 0, got {noise_multiplier!r}")
    if not (isinstance(rounds, int) and rounds >= 0):
        raise ValueError(f"rounds: an integer >= 0, got {rounds!r}")
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


def poisson_epsilon(noise_multiplier: float, delta: float, rounds: int, *, num_clients: int, clients_per_round: int):
    """What Poisson sampling at ``q = clients_per_round / num_clients`` would report for the same noise and rounds
    (RDP): the figure a fixed-size private run states beside its own, looser one."""
    return epsilon(
        noise_multiplier,
        delta,
        rounds,
        sampling="poisson",
        num_clients=num_clients,
        rate=clients_per_round / num_clients,
    )


def bisect_multiplier(spend, target: float, *, start: float = 1.0, rtol: float = 1e-3, lo=None, hi=None) -> float:
    """The smallest noise multiplier ``z`` (to ``rtol``, relative) with ``spend(z) <= target``, ``spend`` falling
    as ``z`` grows: a bracket grown geometrically from ``start`` (or the given ends), then narrowed (:func:`_narrow`).
    The answer ``hi`` spends at most ``target``, and ``hi / (1 + rtol)`` more."""
    if hi is None or lo is None:
        z = float(start)
        if spend(z) <= target:
            hi = z
            while True:
                z /= 2
                if z < 1e-6:
                    return hi  # every multiplier down to 1e-6 spends at most the target
                if spend(z) > target:
                    lo = z
                    break
                hi = z
        else:
            lo = z
            while True:
                z *= 2
                if z > MAX_MULTIPLIER:
                    raise ValueError(
                        f"dp_epsilon: {target:g} is not reached by any noise multiplier up to {MAX_MULTIPLIER:g} "
                        f"(epsilon {spend(MAX_MULTIPLIER):.4g} there: the accountant's floor for these rounds, and "
                        f"a model under such noise learns nothing); raise dp_epsilon, or try dp_accountant = "
                        f'"pld", which certifies smaller epsilons than RDP\'s'
                    )
                if spend(z) <= target:
                    hi = z
                    break
                lo = z
    return _narrow(spend, target, lo, hi, rtol)


def _narrow(spend, target: float, lo: float, hi: float, rtol: float) -> float:
    """Narrow ``spend(lo) > target >= spend(hi)`` to ``hi / lo <= 1 + rtol``: each step guesses the crossing from
    the ends (log epsilon linear in log z between them; the geometric middle when an end's epsilon is 0 or inf),
    then evaluates just above the guess and, when that spends at most the target, just below it: near the answer
    two evaluations close the bracket (an evaluation of the PLD accountant takes about a second)."""
    f_lo = f_hi = None
    while hi / lo - 1 > rtol:
        t = 0.5
        if f_lo is not None and f_hi is not None and f_lo > 0 and f_hi > 0 and target > 0:
            a, b = math.log(f_lo) - math.log(target), math.log(f_hi) - math.log(target)
            if a > 0 >= b and a - b > 0:
                t = min(max(a / (a - b), 0.02), 0.98)
        guess = lo * (hi / lo) ** t
        up = min(guess * (1 + rtol / 2), math.sqrt(guess * hi)) if t != 0.5 else guess
        e = spend(up)
        if e <= target:
            hi, f_hi = up, e
            down = up / (1 + rtol)
            if down > lo:
                e = spend(down)
                if e <= target:
                    hi, f_hi = down, e
                else:
                    lo, f_lo = down, e
        else:
            lo, f_lo = up, e
    return hi


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
    rtol: float = 1e-3,
) -> float:
    """The smallest noise multiplier (to ``rtol``, relative) whose ``rounds`` rounds spend at most
    ``target_epsilon`` at ``delta`` (``dp_epsilon`` given instead of ``dp_noise_multiplier``). With the PLD
    accountant the search starts from the RDP answer, an upper end (RDP's epsilon bounds PLD's from above), and
    steps down by 0.8 to the lower end: every PLD evaluation is at a multiplier near the answer, where its grid is
    small (a search from z = 0.001 would allocate tens of GiB)."""
    _check(None, delta, rounds, sampling, num_clients, clients_per_round, rate, accountant)
    if isinstance(target_epsilon, bool) or not (
        isinstance(target_epsilon, (int, float)) and 0 < target_epsilon < math.inf
    ):
        raise ValueError(f"dp_epsilon: a finite number > 0, got {target_epsilon!r}")
    if rounds < 1:
        raise ValueError(f"rounds: a budget is spent over >= 1 round, got {rounds!r}")
    kw = dict(sampling=sampling, num_clients=num_clients, clients_per_round=clients_per_round, rate=rate)
    target = float(target_epsilon)
    try:
        rdp_z = bisect_multiplier(lambda z: epsilon(z, delta, rounds, **kw, accountant="rdp"), target, rtol=rtol)
    except ValueError:
        if accountant == "rdp":
            raise
        rdp_z = MAX_MULTIPLIER  # below RDP's floor: PLD's search starts from the largest multiplier
    if accountant == "rdp":
        return rdp_z

    def spend(z):
        return epsilon(z, delta, rounds, **kw, accountant="pld")

    hi = rdp_z
    while spend(hi) > target:
        hi *= 1.25
        if hi > MAX_MULTIPLIER * 1.25:
            raise ValueError(
                f"dp_epsilon: {target:g} is not reached by any noise multiplier up to {MAX_MULTIPLIER:g} with the "
                f"PLD accountant either; raise dp_epsilon"
            )
    lo = hi * 0.8
    for _ in range(60):
        if spend(lo) > target:
            break
        hi, lo = lo, lo * 0.8
    else:
        return hi
    return _narrow(spend, target, lo, hi, rtol)


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
        self._pld = None  # (multiplier, rounds composed, a PLD accountant holding them)

    def _event(self):
        k = self.kw
        return round_event(self.noise_multiplier, k["sampling"], k["num_clients"], k["clients_per_round"], k["rate"])

    def epsilon(self, rounds: int) -> float:
        """Epsilon after ``rounds`` rounds. RDP composes linearly, so one round's RDP curve is computed once (the
        subsampled Gaussian's orders: 0.1-0.2 s on a CPU core) and each round's epsilon is its conversion at
        ``rounds`` times it (dp-accounting's ``compute_epsilon``). PLD: the accountant of the rounds so far is kept
        and composed with one more round at a time (a fresh one when fewer rounds are asked for)."""
        z = self.noise_multiplier
        k = self.kw
        _check(z, self.delta, rounds, k["sampling"], k["num_clients"], k["clients_per_round"], k["rate"], "rdp")
        if rounds == 0:
            return 0.0
        if z == 0:
            return math.inf
        if k["accountant"] == "pld":
            if self._pld is None or self._pld[0] != z or self._pld[1] > rounds:
                self._pld = (z, 0, _fresh("pld", k["sampling"]))
            _, done, acc = self._pld
            with _quiet():
                if rounds > done:
                    acc.compose(self._event(), rounds - done)
                self._pld = (z, rounds, acc)
                return float(acc.get_epsilon(self.delta))
        if self._rdp_z != z:
            acc = _fresh("rdp", k["sampling"])
            with _quiet():
                acc.compose(self._event(), 1)
            self._rdp_z, self._orders, self._rdp = z, acc.orders, acc.rdp
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
