"""FedSAM and FedSpeed: client steps with a sharpness-aware (SAM) perturbation (Foret et al., ICLR 2021).

**The SAM step** (the engine's, used by any method whose ``sam_rho`` is > 0). Per local step and client k::

    g   = grad L_k(w)                                 (the client's minibatch loss with all its terms, e.g. ASD's)
    e   = rho g / (||g|| + 1e-12)                     (per client)
    w  <- step(w, grad L_k(w + e))                    (clipping, the method's terms, weight decay, momentum at w)

Two forward/backward passes per step, all clients batched in each, the perturbation per client's own norm. The
loss of the first pass is the reported train loss.

**FedSAM** (Qu et al., "Generalized Federated Learning via Sharpness Aware Minimization", ICML 2022): FedAvg whose
clients take SAM steps. Qu et al. released no code; ``rho = 0.1`` is FL-Simulator's default (woodenchild95/
FL-Simulator @617ee01, ``train.py --rho``, the FedSpeed authors' codebase, whose FedSAM client is
``client/fedsam.py``: ESAM's first step without clipping, then clipping at 10 and SGD). ASD's code
(vcl-iisc/fed-adaptive-self-distillation @6cb4b68, ``train_model_sam``) clips before the perturbation too, which
does not change ``e`` (a rescaled gradient has the same direction); its rho is a search parameter (0.03 on
Tiny-ImageNet IID, others unreported).

**FedSpeed** (Sun et al., "FedSpeed: Larger Local Interval, Less Communication Round, and Higher Generalization
Accuracy", ICLR 2023), as FL-Simulator runs it (``client/fedspeed.py``, ``server/FedSpeed.py``): FedDyn's form
with a constant coefficient and SAM steps. Client k starts from the server model ``w_t`` and minimises::

    L_k(w) + lam <w, h_k - w_t> + (lam / 2) ||w||^2          (SAM gradient of L_k; weight decay lam + wd)

then ``h_k += w_k - w_t``; the server keeps ``hbar = (1/N) sum_k h_k`` and sets
``w_{t+1} = mean_{k in S} w_k + hbar`` (the prox-correction term of the paper). ``lam = 0.1``, ``rho = 0.1`` and
clipping at 10 are FL-Simulator's defaults; it evaluates ``w_{t+1}`` (``evaluated = "cloud"``).

ASD's code (``train_fed_speed``, ``train_model_speed``), whose Tables 2 and 13 report FedSpeed and FedSpeed+ASD,
differs in three ways, each an option: the coefficient is ``alpha / (number of minibatches)`` (``alpha_scaling =
"minibatches"``, with ASD's FedDyn alpha); it evaluates the mean of every client's latest local model, clients
never sampled counting with ``w_0`` (``evaluated = "all_clients"``, which keeps each client's latest model:
2 x [K, P] rows); and its perturbation is a no-op (``p.add(e_w)`` is not in place, so the second pass recomputes
the gradient at ``w``), which ``rho = 0`` reproduces. The ASD presets set all three.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import StateSpec
from .fedavg import FedAvg
from .feddyn import FedDyn
from .options import opt
from .registry import register
from .round import Collected

_SIM = "woodenchild95/FL-Simulator @617ee01"


@register("fedsam")
class FedSAM(FedAvg):
    """FedSAM (Qu et al. 2022): FedAvg with SAM client steps, w <- w - lr grad L(w + rho g/||g||)."""

    sam = True
    paper = "Qu et al., Generalized Federated Learning via Sharpness Aware Minimization, ICML 2022"
    max_grad_norm, max_grad_norm_source = 10.0, f"{_SIM}, client/client.py: max_norm = 10"

    @dataclass
    class Options:
        rho: float = opt(0.1, f"SAM radius rho ({_SIM}, train.py --rho 0.1; Qu et al. released no code)", check=">=0")

    def sam_rho(self, ctx):
        return self.opts.rho


@register("fedspeed")
class FedSpeed(FedDyn):
    """FedSpeed (Sun et al. 2023): SAM client steps on L + lam <w, h_k - w_t> + lam/2 ||w||^2; h_k += w_k - w_t;
    w_{t+1} = mean of the participants + mean over all clients of h."""

    sam = True
    paper = (
        "Sun et al., FedSpeed: Larger Local Interval, Less Communication Round, and Higher Generalization "
        "Accuracy, ICLR 2023"
    )
    max_grad_norm, max_grad_norm_source = 10.0, f"{_SIM}, client/client.py: max_norm = 10"
    sgd_only = "its prox-correction enters the SAM step as SGD weight decay lam + wd (FL-Simulator's code)"
    state = ("hbar", "avg", "wsum")

    @dataclass
    class Options:
        lam: float = opt(0.1, f"prox-correction coefficient lambda ({_SIM}, train.py --lamb 0.1)", check=">=0")
        rho: float = opt(0.1, f"SAM radius rho ({_SIM}, train.py --rho 0.1; ASD's code: a no-op, rho = 0)", check=">=0")
        alpha_scaling: str = opt(
            "none",
            "lam_k = lam / s_k: 'none' (FL-Simulator), 'minibatches' (ASD's code) or 'mean_size' (FedDyn's)",
            choices=("none", "minibatches", "mean_size"),
        )
        evaluated: str = opt(
            "cloud",
            "the reported model: 'cloud' w_{t+1} (FL-Simulator), 'average' (the "
            "participants' mean, as FedDyn) or 'all_clients' (ASD's code)",
            choices=("cloud", "average", "all_clients"),
        )

    def coefficient(self):
        return self.opts.lam, self.opts.alpha_scaling

    def upload_spec(self):
        if self.opts.evaluated == "all_clients":
            raise ValueError(
                "fedspeed.evaluated: 'all_clients' reports the mean of every client's latest local model, each "
                "unclipped and unnoised; a private run reports 'cloud' or 'average'"
            )
        return super().upload_spec()

    def sam_rho(self, ctx):
        return self.opts.rho

    def client_state_spec(self, e):
        if self.opts.evaluated == "all_clients":  # [h_k | the client's latest local model (w_0 before it trains)]
            return StateSpec(rows=2, fill=torch.cat([torch.zeros_like(e.global_flat), e.global_flat]))
        return super().client_state_spec(e)  # h_k

    def setup(self):
        super().setup()
        e = self.engine
        self.wsum = e.global_flat * e.num_clients if self.opts.evaluated == "all_clients" else None

    def round_start(self, ctx):
        sums = super().round_start(ctx) or {}  # FedDyn's (none today), kept
        if self.wsum is not None:  # the clients' changes of the models' sum
            sums = {**sums, "wsum": torch.zeros_like(self.wsum)}
        return sums or None

    def collect(self, ctx, out, lo, hi):
        got = super().collect(ctx, out, lo, hi)  # h_k' and hbar's increment
        if self.wsum is None:
            return got
        P = self.engine.num_params
        w = self.engine.client_params(hi - lo)
        return Collected(
            rows=torch.cat([got.rows, w], 1), increment=got.increment, sums={"wsum": (w - ctx.rows[lo:hi, P:]).sum(0)}
        )

    def server(self, ctx, avg):
        if self.wsum is not None:
            self.wsum = self.wsum + ctx.sums["wsum"]
        return super().server(ctx, avg)

    def evaluated(self, global_flat):
        ev = self.opts.evaluated
        if ev == "cloud":
            return global_flat
        if ev == "average":
            return self.avg
        return self.wsum / self.engine.num_clients
