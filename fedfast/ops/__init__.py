"""fedfast's functional core: fused ops with a ``backend=`` argument.

* :func:`distill` - CE + (not-true / full / mixture / FedADC+ / FedCAD) distillation, loss and gradient
  in one pass (:mod:`fedfast.ops.distill_reference` is the spec).
* :func:`teacher_mixture` - FedGKD-VOTE: M teachers -> one target distribution.
* :func:`asd_weights`, :func:`asd_row_weight`, :func:`asd_row_weights` - ASD entropy x inverse-prior weights.
* :func:`aggregate` - fused server update over flat client rows (FedAvg/M, SlowMo, FedADC, FedDyn, SCAFFOLD,
  FedGKD buffer); :func:`client_step` - fused all-client optimizer step (SGD); :func:`client_adam` - the same
  for Adam / AdamW.
* :func:`update_norms` - DP-FedAvg's ``||X_k - g||`` per client row (its own op file).
* :func:`raise_if_invalid` - read the deferred (no-sync) validation flags of GPU calls.
"""

from ._backend import BACKENDS, resolve as resolve_backend
from ._validate import raise_if_invalid
from .aggregate import NonFiniteUpdate, aggregate
from .asd_weights import asd_row_weight, asd_row_weights, asd_weights
from .client_adam import client_adam
from .client_step import client_step, drift_shift_
from .distill import distill, row_scale_torch
from .distill_reference import (
    asd_weights_reference,
    distill_reference,
    distill_rows_reference,
    teacher_mixture_reference,
)
from .linear_distill import linear_distill
from .teacher_mixture import teacher_mixture
from .update_norms import update_norms

__all__ = [
    "aggregate",
    "update_norms",
    "NonFiniteUpdate",
    "client_step",
    "client_adam",
    "drift_shift_",
    "BACKENDS",
    "resolve_backend",
    "raise_if_invalid",
    "distill",
    "row_scale_torch",
    "linear_distill",
    "teacher_mixture",
    "asd_weights",
    "asd_row_weight",
    "asd_row_weights",
    "distill_reference",
    "distill_rows_reference",
    "teacher_mixture_reference",
    "asd_weights_reference",
]
