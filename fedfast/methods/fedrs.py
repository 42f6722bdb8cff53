"""FedRS (Li and Zhan, "FedRS: Federated Learning with Restricted Softmax for Label Distribution Non-IID Data",
KDD 2021).

A client's softmax is restricted on the classes it lacks: class c's logit is scaled by ``s_c`` before the
cross-entropy, so the missing classes' classifier rows get smaller updates::

    CE(s * z, y),     s_c = alpha + (1 - alpha) n_c / max_j n_j          (official code, proportional = true)
                      s_c = 1 if n_c > 0 else alpha                       (the paper's restricted softmax)

``n_c`` the client's label counts. The official code (lxcnju/FedRepo @48288a1, ``algorithms/fedrs.py``, by the
paper's first author) scales in proportion to the counts; fedfast follows it by default. Its classifier has no
bias and it scales ``h W^T``; fedfast scales the whole logit (bias included), which is the same for a bias-free
classifier. ``alpha = 0.5`` is FedADC Table I's setting; the code clips gradients at norm 100 (``config.py``,
``max_grad_norm``), fedfast's default for this method. Server: FedAvg.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .fedavg import FedAvg
from .hooks import cross_entropy
from .options import opt
from .registry import register

_CODE = "lxcnju/FedRepo @48288a1, algorithms/fedrs.py"


@register("fedrs")
class FedRS(FedAvg):
    """FedRS (Li and Zhan 2021): CE of the logits scaled per class by s_c = alpha + (1 - alpha) n_c / max n
    (restricted softmax: the classes the client lacks get alpha)."""

    paper = (
        "Li and Zhan, FedRS: Federated Learning with Restricted Softmax for Label Distribution Non-IID Data, KDD 2021"
    )
    max_grad_norm, max_grad_norm_source = 100.0, "lxcnju/FedRepo @48288a1, config.py: max_grad_norm 100"
    accepts_asd = False

    @dataclass
    class Options:
        alpha: float = opt(0.5, "scale of the missing classes' logits (FedADC Table I: 0.5)", check="[0,1]")
        proportional: bool = opt(
            True,
            f"s_c = alpha + (1 - alpha) n_c / max n ({_CODE}); false: 1 for the "
            "client's classes, alpha for the others (the paper)",
        )

    def scale(self, hist: torch.Tensor) -> torch.Tensor:
        """s [n, C] from the clients' label counts [n, C]."""
        a = self.opts.alpha
        if self.opts.proportional:
            return a + (1 - a) * hist / hist.amax(1, keepdim=True).clamp_min(1)
        return torch.where(hist > 0, torch.ones_like(hist), torch.full_like(hist, a))

    def loss(self, ctx, b):
        return cross_entropy(
            dataclasses.replace(b, logits=b.logits * self.scale(b.hist)[b.segments]), self.engine.backend
        )
