"""Plain KD and FedNTD: distillation from the global model the client received.

* **KD** (Hinton et al. 2015, as FedNTD's App. H baseline): ``CE(z, y) + beta * tau^2 * KL(softmax(z_g/tau) ||
  softmax(z/tau))`` averaged over the minibatch; ``z_g`` the frozen global model's logits on the same batch. The
  FedNTD code's KD config uses ``tau = 3``, ``beta = 1`` and this form (not the ``(1-beta)`` CE of Eq. 3).
* **FedNTD** (Lee et al., NeurIPS 2022, Eq. 10-11): ``CE(z, y) + beta * s * KL(pt_g || pt)`` where ``pt`` is the
  tau-softmax over the C-1 *not-true* classes: the true class's logit is removed from student and teacher
  before the softmax (never ``q/(1 - q_y)``, which loses digits as ``q_y -> 1``). ``s = tau^2`` as in the
  official code's HEAD (code ``043269e`` and Eq. 10 have no factor; it does not matter at the papers'
  ``tau = 1``). Defaults ``beta = 1``, ``tau = 1`` (Table 5). The official trainer clips no gradients
  (``algorithms/fedntd/ClientTrainer.py``), so neither does fedfast; the protocol (SGD lr 0.01 decayed 0.99
  per round, momentum 0.9, weight decay 1e-5, B = 50, E = 5, 200 rounds) is a run setting, not the method's.

**FedLS-NTD**: FedNTD under the name and settings FedADC's Table I runs it with (§IV-C: "FedLS-NTD", T = 1,
beta = 0.3, local momentum 0.9), a named method over FedNTD with those defaults.

Reading chosen: aggregation is size-weighted (Eq. 2 and the code; Alg. 1 writes uniform, equal under sharding).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import nn as fnn
from . import register
from .base import Method, TeacherSpec, opt
from .hooks import cross_entropy


class _FromGlobal(Method):
    """A method that distils from the global model the clients received this round."""

    def uses_teacher(self):
        return True

    def teacher(self, ctx):
        return TeacherSpec.of(self.engine.global_flat)


@register("kd")
class KD(_FromGlobal):
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


@register("fedntd")
class FedNTD(_FromGlobal):
    """FedNTD (Lee et al. 2022, Eq. 10-11): CE + beta * tau^2 * KL over the not-true classes."""
    paper = "Lee et al., Preservation of the Global Knowledge by Not-True Distillation in Federated Learning, NeurIPS 2022"
    accepts_asd = True
    loss_options = ("beta", "tau", "tau_squared")

    @dataclass
    class Options:
        beta: float = opt(1.0, "weight of the not-true KL (Eq. 10; Table 5: beta = 1)", check=">=0")
        tau: float = opt(1.0, "temperature (Table 5: tau = 1)", check=">0")
        tau_squared: bool = opt(True, "multiply the KL by tau^2 (official code HEAD; Eq. 10 has none)")

    def setup(self):
        o = self.opts
        self.kd = fnn.NTDLoss(tau=o.tau, beta=o.beta, tau_squared=o.tau_squared, backend=self.engine.backend)

    def loss(self, ctx, b):
        return self.kd(b.logits, b.teacher.logits, b.target, segments=b.segments, num_segments=b.num_clients)


@register("fedls_ntd")
class FedLSNTD(FedNTD):
    """FedLS-NTD (FedADC Table I): FedNTD with beta = 0.3, tau = 1 (Ozfatura et al. §IV-C)."""
    paper = ("Lee et al. (FedNTD, NeurIPS 2022) as FedLS-NTD in Ozfatura, Ozfatura and Gündüz, FedADC, Table I")
    accepts_asd = False  # fedntd+asd is the same method

    @dataclass
    class Options:
        beta: float = opt(0.3, "weight of the not-true KL (FedADC §IV-C: beta = 0.3)", check=">=0")
        tau: float = opt(1.0, "temperature (FedADC §IV-C: T = 1)", check=">0")
        tau_squared: bool = opt(True, "multiply the KL by tau^2 (FedNTD's code HEAD; no effect at tau = 1)")
