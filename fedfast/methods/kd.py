"""Plain KD: distillation from the global model the client received, and the base every method that distils from
that model shares (:class:`FromGlobalModel`: FedNTD in ``fedntd.py``, FedCAD / FedLSD in ``fedcad.py``).

* **KD** (Hinton et al. 2015, as FedNTD's App. H baseline): ``CE(z, y) + beta * tau^2 * KL(softmax(z_g/tau) ||
  softmax(z/tau))`` averaged over the minibatch; ``z_g`` the frozen global model's logits on the same batch. The
  FedNTD code's KD config uses ``tau = 3``, ``beta = 1`` and this form (not the ``(1-beta)`` CE of Eq. 3).

FedNTD, the not-true form, is in :mod:`fedfast.methods.fedntd`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .. import nn as fnn
from .._deprecation import deprecated
from .base import Method, TeacherSpec
from .hooks import cross_entropy
from .options import opt
from .registry import register


class FromGlobalModel(Method):
    """A method that distils from the global model the clients received this round."""

    def uses_teacher(self):
        return True

    def teacher(self, ctx):
        return TeacherSpec.of(self.engine.global_flat)


@register("kd")
class KD(FromGlobalModel):
    """Plain KD to the global model: CE + beta * tau^2 * KL(softmax(z_g/tau) || softmax(z/tau))."""

    paper = "Hinton et al. 2015, as the KD baseline of Lee et al. (FedNTD), NeurIPS 2022, App. H"

    @dataclass
    class Options:
        beta: float = opt(1.0, "KD weight (FedNTD code, KD config: beta = 1)", check=">=0")
        tau: float = opt(3.0, "temperature (FedNTD code, KD config: tau = 3)", check=">0")
        tau_squared: bool = opt(True, "multiply the KL by tau^2 (FedNTD code)")

    def setup(self):
        o = self.opts
        self.kd = fnn.KDLoss(tau=o.tau, kd_weight=o.beta, tau_squared=o.tau_squared, backend=self.engine.backend)

    def loss(self, ctx, b):
        if b.teacher is None:
            return cross_entropy(b, self.engine.backend)
        return self.kd(b.logits, b.teacher.logits, b.target, segments=b.segments, num_segments=b.num_clients)


def __getattr__(name: str):
    """``fedfast.methods.kd.FedNTD`` / ``FedLSNTD``: moved to :mod:`fedfast.methods.fedntd` (issue 50); the old
    addresses work for one release, with a DeprecationWarning naming the new one (the module, which imports this
    one, is loaded by then: ``fedfast.methods`` loads both)."""
    if name in ("FedNTD", "FedLSNTD"):
        deprecated(
            f"fedfast.methods.kd.{name} moved to fedfast.methods.fedntd.{name} (or fedfast.methods.{name}); "
            f"the old address goes in the next release"
        )
        return getattr(importlib.import_module(".fedntd", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
