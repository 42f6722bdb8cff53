"""Private federated learning: user-level differential privacy for the engine's rounds (docs/privacy.md).

* :mod:`~fedfast.privacy.mechanism`: the contract a mechanism keeps with the engine (a per-client bound step fused
  in the aggregation, a noise step on the round's sum, the record, the checkpoint) and :class:`NoPrivacy`;
* :class:`DPFedAvg` (:mod:`~fedfast.privacy.fedavg`): DP-FedAvg with adaptive clipping;
* :class:`DPFTRL` (:mod:`~fedfast.privacy.ftrl`): DP-FTRL, tree-aggregated noise with restarts, for cohorts that
  are not sampled secretly;
* :mod:`~fedfast.privacy.accounting`: epsilon, the calibration of the noise to a budget, the per-run accountant
  (Google's dp-accounting: ``pip install "fedfast[privacy]"``);
* :class:`Secret` (:mod:`~fedfast.privacy.secret`): the OS entropy a private run's noise and cohorts come from;
* :class:`PrivacySettings`: what a mechanism reads of the config; :func:`mechanism`: the run's mechanism.
"""

from __future__ import annotations

from .accounting import (
    ACCOUNTANTS,
    SAMPLINGS,
    Accountant,
    calibrate,
    check_accounting,
    check_delta,
    epsilon,
    poisson_epsilon,
    round_event,
)
from .fedavg import UNACCOUNTED, DPFedAvg
from .ftrl import DPFTRL
from .mechanism import Mechanism, NoPrivacy
from .secret import Secret
from .settings import PrivacySettings

MECHANISMS = ("dp_fedavg", "dp_ftrl")


def run_secret(settings: PrivacySettings, broadcast, device) -> Secret | None:
    """A private run's secret (None without ``dp_clip``): fresh OS entropy, process 0's on every process
    (``broadcast``: the run's collectives' broadcast)."""
    return Secret().shared(broadcast, device) if PrivacySettings.given(settings).dp_clip else None


def secret_cohorts(settings: PrivacySettings) -> bool:
    """Whether the run's cohorts must come from its secret: DP-FedAvg's sampling amplification assumes them
    secret; DP-FTRL's accounting takes the cohorts as they are (public: the run seed's, or a schedule)."""
    s = PrivacySettings.given(settings)
    return bool(s.dp_clip) and s.dp_mechanism == "dp_fedavg"


def mechanism(
    settings: PrivacySettings,
    *,
    num_clients: int,
    num_buffers: int,
    schedule,
    cohorts,
    device,
    secret: Secret | None,
    method,
) -> Mechanism:
    """The run's mechanism: :class:`NoPrivacy` without ``dp_clip``, else DP-FedAvg or DP-FTRL (``dp_mechanism``).
    ``cohorts``: round -> its client ids (DP-FTRL accounts the planned rounds' cohorts); ``method``: the run's
    method (its name in refusals, its declared uploads, ``Method.upload_spec``). Refused by name: a model
    with buffers (``num_buffers``: BatchNorm's running statistics, averaged from the clients' data unclipped) and,
    for DP-FedAvg, a given ``schedule`` (public cohorts; its sampling amplification assumes secret ones)."""
    s = PrivacySettings.given(settings)
    if not s.dp_clip:
        return NoPrivacy()
    name = getattr(method, "name", "the method")
    kw = dict(num_clients=num_clients, device=device, secret=secret, method_name=name, uploads=method.upload_spec())
    if num_buffers:
        raise ValueError(
            f"dp_clip: the model's {num_buffers} buffer values (BatchNorm running statistics) are averaged from the "
            f"clients' data, uploads the mechanism's clipping and noise do not cover; use a model without them "
            f"(GroupNorm)"
        )
    if s.dp_mechanism == "dp_ftrl":
        return DPFTRL(s, cohorts=cohorts, **kw)
    if schedule is not None:
        raise ValueError(
            "schedule: DP-FedAvg's cohorts must be sampled secretly (client_sampling); a given schedule is refused "
            'under dp_mechanism = "dp_fedavg" (dp_mechanism = "dp_ftrl" accounts public cohorts)'
        )
    return DPFedAvg(s, **kw)


__all__ = [
    "ACCOUNTANTS",
    "SAMPLINGS",
    "UNACCOUNTED",
    "Accountant",
    "DPFTRL",
    "DPFedAvg",
    "MECHANISMS",
    "Mechanism",
    "NoPrivacy",
    "PrivacySettings",
    "Secret",
    "calibrate",
    "check_accounting",
    "check_delta",
    "epsilon",
    "mechanism",
    "poisson_epsilon",
    "round_event",
    "run_secret",
    "secret_cohorts",
]
