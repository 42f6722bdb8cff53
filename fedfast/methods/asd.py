"""ASD, adaptive self-distillation (Yashwanth et al., "Adaptive Self-Distillation for Minimizing Client Drift in
Heterogeneous Federated Learning", TMLR), an add-on to a base method: ``algorithm = "fedavg+asd"``,
``"fedprox+asd"``, ``"fedntd+asd"``, ``"feddyn+asd"``, ``"scaffold+asd"``, ``"fedavgm+asd"``, ``"fedsam+asd"``,
``"fedspeed+asd"``, ``"feddisco+asd"``; its options are the
``[asd]`` table, the base's stay in the base's table.

The base's client loss (its KD term, if any) becomes, per minibatch, in the official code's scaling::

    CE_mean(z, y) + lam * sum_i alpha_i * KL(softmax(z_g,i/tau) || softmax(z_i/tau))          (Eq. 2-5)
    alpha_i = ahat_i / sum_{j in batch} ahat_j,   ahat_i = exp(-H(x_i)) / p_k(y_i)            (Eq. 9-10)
    H(x_i) = entropy of softmax(z_g,i / entropy_tau)                                            (Eq. 11)

``z_g`` the frozen model the client received (FedDyn: the cloud model), ``p_k`` the client's label distribution
over its whole local data (Eq. 12). ``sum_i alpha_i = 1``, so ``lam`` is "in units of B" (A.3): the code's
``CE_mean + lam * sum_i alpha_i KL_i`` equals Eq. 5 with lambda * B. No ``tau^2`` (paper and code). On FedNTD
the KL runs over the not-true classes (Eq. 17-19; the weights still come from the full teacher softmax). The
base's client-step terms (FedProx's proximal term, FedDyn's linear term, SCAFFOLD's correction), server rule
and state are unchanged.

Defaults from the paper and the official code (vcl-iisc/fed-adaptive-self-distillation @6cb4b68): ``tau = 2``
(§5, A.6); ``lam = 10`` (CIFAR-10; 30 for CIFAR-100 and 20 for Tiny-ImageNet, A.3); gradient clipping at norm 10
(``max_norm = 10`` in the code; fedfast's ``max_grad_norm`` defaults to it for every ``+asd`` method). The
entropy's temperature differs between the code's paths (ambiguity A1): ``train_fedavgreg_mdl`` (FedAvg+ASD,
FedNTD+ASD and FedDisco+ASD) and ``compute_distill_loss`` (FedSpeed+ASD) compute H at temperature 1,
``train_fedprox_mdl`` and ``train_feddyn_mdl_reg`` at ``tau``; ``entropy_tau`` left unset follows the code of the
base (1 on fedavg, fedntd, feddisco and fedspeed, ``tau`` elsewhere; FedSAM+ASD has no released path: the
paper's ``tau``). With
``entropy_tau = 1`` fedfast's loss equals the official FedAvg+ASD loss and gradient to 2e-8.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import nn as fnn
from .base import Method, TeacherSpec
from .options import make_options, opt
from .registry import names

# the official code's paths that compute H at temperature 1: train_fedavgreg_mdl (FedAvg+ASD, FedNTD+ASD, and
# FedDisco+ASD, which is that path with disco = 1) and compute_distill_loss (FedSpeed+ASD)
_ENTROPY_TAU_1 = ("fedavg", "fedntd", "feddisco", "fedspeed")
_CODE = "official ASD code 6cb4b68: max_norm = 10"


class ASD(Method):
    """The ASD add-on (Yashwanth et al.): the base's KD term becomes lam * sum_i alpha_i KL_i, alpha_i ∝ exp(-H_i) /
    p_k(y_i) normalised over the minibatch. Use it as ``"<base>+asd"``."""

    paper = "Yashwanth et al., Adaptive Self-Distillation for Minimizing Client Drift in Heterogeneous FL, TMLR"
    max_grad_norm, max_grad_norm_source = 10.0, _CODE

    @dataclass
    class Options:
        lam: float = opt(10.0, "lambda in units of B (A.3: CIFAR-10 10, CIFAR-100 30, Tiny-ImageNet 20)", check=">=0")
        tau: float = opt(2.0, "temperature of both softmaxes (§5, A.6)", check=">0")
        entropy_tau: float | None = opt(
            None,
            "temperature of the teacher entropy H (None: the code's path for the "
            "base: 1 on fedavg/fedntd, tau elsewhere; A1)",
            check=">0",
        )
        not_true: bool | None = opt(None, "KL over the not-true classes (None: true on fedntd, Eq. 17-19)")
        tau_squared: bool = opt(False, "multiply the KL by tau^2 (neither paper nor code does)")


class _WithASD:
    """Mixin placed before the base method by :func:`with_asd`."""

    base: type[Method]

    def __init__(self, options=None, **kw):
        tables = dict(options or {})
        own = tables.get(self.table_name(), {})
        unused = [k for k in {**(own if isinstance(own, dict) else {}), **kw} if k in self.base.loss_options]
        if unused:
            raise ValueError(
                f"{self.table_name()}.{unused[0]}: not used by {self.name} (ASD replaces "
                f"{self.base.name}'s distillation term; set the [asd] options instead)"
            )
        a = tables.get("asd", {})
        self.asd = a if isinstance(a, ASD.Options) else make_options("asd", ASD.Options, a, method=self.name)
        super().__init__(options, **kw)
        base = self.base.name
        if self.asd.not_true is None:
            self.asd.not_true = base == "fedntd"
        if self.asd.entropy_tau is None:
            self.asd.entropy_tau = 1.0 if base in _ENTROPY_TAU_1 else self.asd.tau

    @classmethod
    def option_tables(cls):
        return {**cls.base.option_tables(), "asd": ASD.Options}

    def options(self):
        out = super().options()
        own = out[self.table_name()]
        out[self.table_name()] = {k: v for k, v in own.items() if k not in self.base.loss_options}
        return {**out, "asd": dataclasses.asdict(self.asd)}

    def uses_teacher(self):
        return True

    def teacher(self, ctx):
        return TeacherSpec.of(self.engine.global_flat)  # the model the clients received (FedDyn: the cloud model)

    def setup(self):
        super().setup()
        a = self.asd
        self.asd_loss = fnn.ASDLoss(
            tau=a.tau,
            lam=a.lam,
            not_true=a.not_true,
            entropy_tau=a.entropy_tau,
            tau_squared=a.tau_squared,
            backend=self.engine.backend,
        )

    def loss(self, ctx, b):
        prior = b.hist / b.hist.sum(1, keepdim=True)
        return self.asd_loss(
            b.logits, b.teacher.logits, b.target, prior, segments=b.segments, num_segments=b.num_clients
        )


_COMPOSED: dict[type, type] = {}


def _first_line(doc: str | None) -> str:
    """A docstring's first line ("" for a class without one: a plug-in's may have none)."""
    lines = (doc or "").strip().splitlines()
    return lines[0] if lines else ""


def with_asd(base: type[Method]) -> type[Method]:
    """The method ``base`` with the ASD add-on (registered name ``base.name + "+asd"``)."""
    if not base.accepts_asd:
        takes = ", ".join(n[:-4] for n in names() if n.endswith("+asd"))
        raise ValueError(f"algorithm: the ASD add-on composes with {takes}, not {base.name!r}")
    if base not in _COMPOSED:
        _COMPOSED[base] = type(
            f"{base.__name__}ASD",
            (_WithASD, base),
            {
                "__doc__": f"{base.name} + ASD: {_first_line(base.__doc__)} The KD term is ASD's "
                f"(Yashwanth et al.): lam * sum_i alpha_i KL_i, alpha_i ∝ exp(-H_i) / p_k(y_i).",
                "name": base.name + "+asd",
                "table": base.table_name(),
                "base": base,
                "paper": f"{base.paper}; + {ASD.paper}",
                "max_grad_norm": ASD.max_grad_norm,
                "max_grad_norm_source": _CODE,
                "accepts_asd": False,
                "__module__": __name__,
            },
        )
    return _COMPOSED[base]
