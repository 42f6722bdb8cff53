"""FedDisco (Ye et al., "FedDisco: Federated Learning with Discrepancy-Aware Collaboration", ICML 2023).

Only the server's aggregation weights change; clients train as in FedAvg. For the round's participants::

    n_k = the participant's share of the round's data   (1/m with aggregate_weights = "uniform")
    d_k = D(p_k, q) / sum_j D(p_j, q)                    (all 0 when every D is 0)
    w_k = ReLU(n_k - a d_k + b) / sum_j ReLU(n_j - a d_j + b)

``p_k`` the client's label distribution, ``q`` the hypothesised global one: ``target = "uniform"`` (the code's
default, ``global_dist = 1/C``) or ``"global"`` (the label distribution of all clients' data together). ``D``
(``distance``): ``"kl"`` = KL(p_k || q) (scipy's ``kl_div`` summed, as the code), ``"l1"``, ``"l2"``, or
``"cosine"`` = 1 - cos(p_k, q). Defaults ``a = 0.5``, ``b = 0.1``, KL, from the official code (MediaBrain-SJTU/
FedDisco @f3ea299, ``args.py`` and ``disco.py``), which computes ``d`` over each round's participants
(``scope = "round"``).

ASD's code (vcl-iisc/fed-adaptive-self-distillation @6cb4b68, ``src/utils_general.py``,
``get_disco_adjusted_weights``), whose Tables 2 and 13 report FedDisco and FedDisco+ASD, computes the weights
once over all K clients (``scope = "all"``: ``n_k`` the share of all data, ``d_k`` normalised over the K clients,
the clipped weights renormalised over each round's participants) with ``a = 0.1``, ``b = 0.5``; the ASD presets
set these. If every participant's weight is <= 0 (``a`` much larger than ``b``) the code fails; fedfast raises
an error naming ``feddisco.a``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .fedavg import FedAvg
from .options import opt
from .registry import register

_CODE = "MediaBrain-SJTU/FedDisco @f3ea299, args.py"


def discrepancy(p: np.ndarray, q: np.ndarray, distance: str) -> np.ndarray:
    """D(p_k, q) for each row of ``p`` [k, C] (label distributions) against ``q`` [C], as FedDisco's ``disco.py``."""
    if distance == "kl":  # scipy.special.kl_div summed: p log(p/q) - p + q, 0 log 0 = 0
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0) / np.where(q > 0, q, 1.0)), 0.0)
        return (t - p + q).sum(1)
    if distance == "l1":
        return np.abs(p - q).sum(1)
    if distance == "l2":
        return np.sqrt(((p - q) ** 2).sum(1))
    return 1.0 - (p @ q) / (np.linalg.norm(p, axis=1) * np.linalg.norm(q))


@register("feddisco")
class FedDisco(FedAvg):
    """FedDisco (Ye et al. 2023): aggregation weights ReLU(n_k - a d_k + b), normalised, d_k the normalised
    discrepancy between the client's label distribution and the global one."""

    uploads = "its label distribution (the server's discrepancy-aware weights)"
    private_refusal = (
        "its aggregation weights are each client's size and label distribution against the global one (every "
        "client's distribution moves every weight) and are normalised by their data-dependent sum: one client's "
        "influence on the average has no bound; a private run weighs clients equally"
    )
    paper = "Ye et al., FedDisco: Federated Learning with Discrepancy-Aware Collaboration, ICML 2023"
    accepts_asd = True

    @dataclass
    class Options:
        a: float = opt(0.5, f"weight of the discrepancy d_k ({_CODE}: disco_a 0.5; ASD's code 0.1)", check=">=0")
        b: float = opt(0.1, f"offset b ({_CODE}: disco_b 0.1; ASD's code 0.5)", check=">=0")
        distance: str = opt(
            "kl", f"the discrepancy D ({_CODE}: measure_difference 'kl')", choices=("kl", "l1", "l2", "cosine")
        )
        target: str = opt(
            "uniform",
            "the hypothesised global label distribution q: 'uniform' (the code) or 'global' (all clients' data)",
            choices=("uniform", "global"),
        )
        scope: str = opt(
            "round",
            "'round': d_k over each round's participants (FedDisco's code); 'all': once "
            "over all K clients (ASD's code)",
            choices=("round", "all"),
        )

    def setup(self):
        e = self.engine
        self.counts = e.label_hist.detach().cpu().double().numpy()  # [K, C], host (weights are host values)
        C = self.counts.shape[1]
        self.q = np.full(C, 1.0 / C) if self.opts.target == "uniform" else self.counts.sum(0) / self.counts.sum()
        self.fixed = None
        if self.opts.scope == "all":
            self.fixed = self.disco_weights(np.arange(e.num_clients), e.client_sizes)

    def disco_weights(self, ids: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Normalised FedDisco weights of clients ``ids`` (sizes ``sizes``)."""
        o = self.opts
        n = sizes / sizes.sum() if self.engine.aggregate_weights == "size" else np.full(len(ids), 1 / len(ids))
        p = self.counts[ids] / self.counts[ids].sum(1, keepdims=True)
        d = discrepancy(p, self.q, o.distance)
        d = d / d.sum() if d.sum() > 0 else np.zeros_like(d)
        w = np.maximum(n - o.a * d + o.b, 0.0)
        if not w.sum() > 0:
            raise ValueError(
                f"feddisco.a: every weight n_k - a d_k + b is <= 0 (a = {o.a}, b = {o.b}); lower "
                f"feddisco.a or raise feddisco.b"
            )
        return w / w.sum()

    def aggregation_weights(self, ids, sizes, local_steps):
        if self.fixed is not None:
            w = self.fixed[ids]
            return w / w.sum()
        return self.disco_weights(ids, sizes.astype(np.float64))
