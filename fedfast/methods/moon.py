"""MOON (Li, He and Song, "Model-Contrastive Federated Learning", CVPR 2021).

Client loss per minibatch: ``CE(z, y) + mu * l_con`` with the model-contrastive term::

    l_con = -log( e^{cos(r, r_g)/T} / (e^{cos(r, r_g)/T} + e^{cos(r, r_prev)/T}) )

``r`` is the representation of the local model: the input of the model's last ``nn.Linear``. MOON's paper and
code put a projection head before the classifier (``projection_dim = 256``, the default: the model is built with
:func:`fedfast.models.with_projection_head`, ``Linear(F, F) -> ReLU -> Linear(F, 256) -> Linear(256, C)``) and
contrast its output, as FedGKD's and FedADC's MOON rows do; FedNTD's code has no head and contrasts the 512-d
output of ``linear_1`` after ReLU, the classifier's input (``projection_dim = 0``; its presets set it). ``r_g``
is that of the frozen global model and ``r_prev`` that of the client's own model after its previous
participation (the initial global model before its first). The reference models run in eval mode (no dropout),
as a teacher. State: one previous local model per client (``[K, P]`` rows; ``[K, P + B]`` with its buffers for a
BatchNorm model that keeps running statistics, which the previous model normalises with in eval mode). Defaults
``mu = 1``, ``T = 0.5`` (FedNTD Table 5, searched over {0.1, 0.5, 1}; MOON's paper uses mu = 5 on CIFAR-10).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.head import with_projection_head
from .base import StateSpec
from .fedavg import FedAvg
from .hooks import cross_entropy, weighted_mean_rows
from .options import opt
from .registry import register
from .round import Collected


@register("moon")
class MOON(FedAvg):
    """MOON (Li et al. 2021): CE + mu * -log(e^{cos(r, r_g)/T} / (e^{cos(r, r_g)/T} + e^{cos(r, r_prev)/T})), r the
    input of the classifier; r_g from the global model, r_prev from the client's previous local model."""

    paper = "Li, He and Song, Model-Contrastive Federated Learning, CVPR 2021"
    needs_features = True
    accepts_asd = False
    caveats = (
        "On an MLP (a model whose only layers with parameters are Linear), mu = 1 falls far behind FedAvg. "
        "Under FedNTD's MNIST protocol with the 784-200-200-10 MLP (examples/study/moon-defaults.toml, 40 "
        "rounds, 2 seeds) MOON ended at 68.1 % against FedAvg's 87.9 %. Without the projection head it ended "
        "at 70.1 %, with the head and mu = 0 at 87.0 %, and with mu = 0.1 at 84.5 %. Set moon.mu = 0.1 for "
        "MLPs; the papers' mu = 1 and 5 are for the CNNs and ResNets their presets run."
    )

    @dataclass
    class Options:
        mu: float = opt(1.0, "weight of the contrastive term (FedNTD Table 5, from {0.1, 0.5, 1})", check=">=0")
        tau: float = opt(0.5, "temperature T (FedNTD Table 5; MOON paper 0.5)", check=">0")
        projection_dim: int = opt(
            256,
            "output of the projection head before the classifier (MOON's paper and "
            "code: 256; 0: no head, as FedNTD's code)",
            check=">=0",
        )

    def prepare_model(self, model, seed=0):
        d = self.opts.projection_dim
        return with_projection_head(model, d, seed, classifier=self.classifier_name) if d else model

    def check_settings(self, config, model):
        linear_only = all(
            isinstance(m, torch.nn.Linear) for m in model.modules() if any(True for _ in m.parameters(recurse=False))
        )
        if linear_only and self.opts.mu > 0.1:
            return [
                f"mu = {self.opts.mu:g} on an MLP: MOON fell far behind FedAvg in fedfast's check (68 % against "
                f"88 % on MNIST shards after 40 rounds); set moon.mu = 0.1 (fedfast methods moon)"
            ]
        return []

    def client_state_spec(self, e):
        if e.num_buffers:  # previous local models with their buffers (BatchNorm's running statistics)
            return StateSpec(cols=e.num_params + e.num_buffers, fill=torch.cat([e.global_flat, e.global_buffers]))
        return StateSpec(fill=e.global_flat)  # previous local models

    def chunk_start(self, ctx, lo, hi):
        return ctx.rows[lo:hi]  # the chunk's clients' previous local models (and their buffers)

    def loss(self, ctx, b):
        e, o, n, P = self.engine, self.opts, b.num_clients, self.engine.num_params
        prev = ctx.chunk[:n]
        with torch.no_grad(), e.eval_mode():  # frozen references, each on its client's own batch
            rg, _ = e.forward_each(e.global_flat, b.x, features=True, valid=b.bn_valid)
            rp, _ = e.forward_clients(
                prev[:, :P], b.x, features=True, valid=b.bn_valid, buffers=prev[:, P:] if e.num_buffers else None
            )
        r = b.features.reshape(-1, b.features.shape[-1])
        sims = (
            torch.stack(
                [
                    F.cosine_similarity(r, rg.reshape(r.shape), dim=-1),
                    F.cosine_similarity(r, rp.reshape(r.shape), dim=-1),
                ],
                1,
            )
            / o.tau
        )
        lcon = torch.logsumexp(sims, 1) - sims[:, 0]
        return cross_entropy(b, e.backend) + o.mu * weighted_mean_rows(lcon, b.valid)

    def collect(self, ctx, out, lo, hi):
        e, n = self.engine, hi - lo
        # the clients' new local models (and their buffers) as their rows
        return Collected(
            rows=torch.cat([e.client_params(n), e.client_buffers(n)], 1) if e.num_buffers else e.client_params(n)
        )
