"""A method fedfast does not ship, written in a user's own file: FedLC's logit calibration (Zhang et al.,
"Federated Learning with Label Distribution Skew via Logits Calibration", ICML 2022).

Each client trains on the cross-entropy of *calibrated* logits ``z_c - tau * n_c^(-1/4)``, ``n_c`` the number of
the client's samples of class c: classes the client has few samples of get their logits lowered during training,
so the local model is not pushed to over-predict its frequent classes. Classes the client has no sample of get
probability 0 (``n_c^(-1/4) = inf``, as in the authors' code, where ``exp(-inf) = 0``). Client step, server rule
and state are FedAvg's.

Run it without editing fedfast:

    fedfast run --plugin examples/custom_method.py --set algorithm=fedlc --set fedlc.tau=1.0
    fedfast methods fedlc --plugin examples/custom_method.py

or from Python: import this file (or define the class in your script), then
``fedfast.SimConfig(algorithm="fedlc", options={"fedlc": {"tau": 1.0}})``.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedfast.methods import FedAvg, opt, register, weighted_mean_rows


@register("fedlc")
class FedLC(FedAvg):
    """FedLC (Zhang et al., ICML 2022): CE on the calibrated logits z_c - tau * n_c^(-1/4), n_c the client's label
    counts; FedAvg otherwise."""

    paper = "Zhang et al., Federated Learning with Label Distribution Skew via Logits Calibration, ICML 2022"

    @dataclass
    class Options:
        tau: float = opt(1.0, "calibration strength tau (the paper tunes it per setting)", check=">=0")

    def loss(self, ctx, b):
        n = b.hist  # [clients, C] label counts of the active clients
        inv = torch.where(n > 0, n.clamp_min(1).pow(-0.25), torch.full_like(n, float("inf")))
        z = b.logits - self.opts.tau * inv[b.segments]  # each row calibrated by its own client's counts
        rows = F.cross_entropy(z, b.target, reduction="none", ignore_index=-100)  # 0 on padding rows
        return weighted_mean_rows(rows, b.valid)  # sum over clients of each client's minibatch mean
