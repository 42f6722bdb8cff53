"""FedNTD (Lee et al., NeurIPS 2022): not-true distillation from the global model the client received.

``CE(z, y) + beta * s * KL(pt_g || pt)`` (Eq. 10-11), where ``pt`` is the tau-softmax over the C-1 *not-true*
classes: the true class's logit is removed from student and teacher before the softmax (never ``q/(1 - q_y)``,
which loses digits as ``q_y -> 1``). ``s = tau^2`` as in the official code's HEAD (code ``043269e`` and Eq. 10 have
no factor; it does not matter at the papers' ``tau = 1``). Defaults ``beta = 1``, ``tau = 1`` (Table 5). The
official trainer clips no gradients (``algorithms/fedntd/ClientTrainer.py``), so neither does fedfast; the protocol
(SGD lr 0.01 decayed 0.99 per round, momentum 0.9, weight decay 1e-5, B = 50, E = 5, 200 rounds) is a run setting,
not the method's. The fused loss is :class:`fedfast.nn.NTDLoss`; the teacher is the global model
(:class:`fedfast.methods.kd.FromGlobalModel`, the KD base this file shares with plain KD and FedCAD).

**FedLS-NTD**: FedNTD under the name and settings FedADC's Table I runs it with (§IV-C: "FedLS-NTD", T = 1,
beta = 0.3, local momentum 0.9), a named method over FedNTD with those defaults.

Reading chosen: aggregation is size-weighted (Eq. 2 and the code; Alg. 1 writes uniform, equal under sharding).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import nn as fnn
from .hooks import graph_safe
from .kd import FromGlobalModel
from .options import opt
from .registry import register


@register("fedntd")
class FedNTD(FromGlobalModel):
    """FedNTD (Lee et al. 2022, Eq. 10-11): CE + beta * tau^2 * KL over the not-true classes."""

    paper = (
        "Lee et al., Preservation of the Global Knowledge by Not-True Distillation in Federated Learning, NeurIPS 2022"
    )
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

    @graph_safe
    def loss(self, ctx, b):
        return self.kd(b.logits, b.teacher.logits, b.target, segments=b.segments, num_segments=b.num_clients)


@register("fedls_ntd")
class FedLSNTD(FedNTD):
    """FedLS-NTD (FedADC Table I): FedNTD with beta = 0.3, tau = 1 (Ozfatura et al. §IV-C)."""

    paper = "Lee et al. (FedNTD, NeurIPS 2022) as FedLS-NTD in Ozfatura, Ozfatura and Gündüz, FedADC, Table I"
    accepts_asd = False  # fedntd+asd is the same method

    @dataclass
    class Options:
        beta: float = opt(0.3, "weight of the not-true KL (FedADC §IV-C: beta = 0.3)", check=">=0")
        tau: float = opt(1.0, "temperature (FedADC §IV-C: T = 1)", check=">0")
        tau_squared: bool = opt(True, "multiply the KL by tau^2 (FedNTD's code HEAD; no effect at tau = 1)")
