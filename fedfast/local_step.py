"""The pieces of one local step that vary by setting, as small strategy objects instead of branches in the engine's
training loop:

* the **client optimiser** (:class:`SGD`, :class:`Adam`; :func:`client_optimizer` picks one from its
  :class:`OptimizerSettings`): its per-client state over the chunk's stack rows, made once per Simulation and reset
  at every chunk's start (each client's optimiser is fresh every round, as a ``torch.optim`` optimiser made per
  client and round), and its fused step over the active clients' rows;
* the **gradient** of a step (:class:`PlainGradient`, :class:`SAMGradient`): the loss's gradient at the clients'
  weights, or SAM's (Foret et al. 2021): at ``w + rho g / (||g|| + eps)`` per client, applied at ``w``.

Each says how many parameter-sized rows per client it keeps (``rows``), which the engine's memory budget counts.
"""

from __future__ import annotations

import dataclasses

import torch

from . import ops
from ._settings import Settings

SAM_EPS = 1e-12  # added to ||g|| in the SAM perturbation rho g / (||g|| + eps) (ASD's code: 1e-16, FedSpeed's 1e-7)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSettings(Settings):
    """The client optimiser's settings (:class:`fedfast.SimConfig`'s of the same names): which one, its step
    size, momentum, coupled or decoupled weight decay, Adam's betas and eps, and the gradient clipping."""

    client_optimizer: str
    lr: float
    momentum: float
    weight_decay: float
    adam_betas: tuple
    adam_eps: float
    max_grad_norm: float | None


class SGD:
    """torch.optim.SGD per client (dampening 0, no Nesterov; coupled weight decay), fused over the rows: the
    momentum buffer [chunk, P] (with momentum)."""

    def __init__(self, settings: OptimizerSettings, params: torch.Tensor):
        self.momentum = settings.momentum
        self.buf = torch.zeros_like(params) if settings.momentum else None

    @staticmethod
    def rows(settings: OptimizerSettings) -> int:
        return 1 if settings.momentum else 0

    def reset(self, n: int) -> None:
        if self.buf is not None:
            self.buf[:n].zero_()

    def step(self, theta: torch.Tensor, grad, n_act: int, kw: dict) -> None:
        ops.client_step(
            theta[:n_act],
            grad,
            momentum=self.momentum,
            momentum_buf=self.buf[:n_act] if self.buf is not None else None,
            **kw,
        )


class Adam:
    """torch.optim.Adam / AdamW per client, fused over the rows: the moments [chunk, P] and each client's own step
    count (as its own optimiser would keep)."""

    def __init__(self, settings: OptimizerSettings, params: torch.Tensor):
        self.betas, self.eps = settings.adam_betas, settings.adam_eps
        self.decoupled = settings.client_optimizer == "adamw"
        self.m, self.v = torch.zeros_like(params), torch.zeros_like(params)
        self.t = torch.zeros(params.shape[0], device=params.device)

    @staticmethod
    def rows(settings: OptimizerSettings) -> int:
        return 2

    def reset(self, n: int) -> None:
        for t in (self.m, self.v, self.t):
            t[:n].zero_()

    def step(self, theta: torch.Tensor, grad, n_act: int, kw: dict) -> None:
        self.t[:n_act] += 1
        ops.client_adam(
            theta[:n_act],
            grad,
            self.m[:n_act],
            self.v[:n_act],
            self.t[:n_act],
            betas=self.betas,
            eps=self.eps,
            decoupled=self.decoupled,
            **kw,
        )


OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": Adam}


def client_optimizer(settings: OptimizerSettings, params: torch.Tensor):
    """The configured client optimiser over the stack's rows ``params`` [chunk, P]."""
    settings = OptimizerSettings.given(settings)
    return OPTIMIZERS[settings.client_optimizer](settings, params)


class PlainGradient:
    """The loss's gradient at the clients' weights."""

    rows = 0

    def gradient(self, stack, loss, pv, n_act: int, second_loss, out):
        return stack.flat_grad(loss, pv, out)


class SAMGradient:
    """SAM's gradient: per client, the loss's gradient g at w, then the gradient at ``w + rho g / (||g|| + eps)``
    (``second_loss(params)`` evaluates the step's loss there), applied at w. Keeps the first gradient and the
    perturbed weights [chunk, P]."""

    rows = 2

    def __init__(self, params: torch.Tensor):
        self.g1, self.w1 = torch.empty_like(params), torch.empty_like(params)
        self.rho = 0.0

    def gradient(self, stack, loss, pv, n_act: int, second_loss, out):
        g1, w1 = self.g1[:n_act], self.w1[:n_act]
        stack.flat_grad(loss, pv, g1)
        scale = self.rho / (g1.norm(dim=1, keepdim=True) + SAM_EPS)
        torch.addcmul(stack.params[:n_act], scale, g1, out=w1)
        pv2 = stack.leaves_of(w1)
        return stack.flat_grad(second_loss(pv2), pv2, out)
