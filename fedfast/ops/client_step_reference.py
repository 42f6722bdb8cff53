"""Pure-PyTorch reference of the fused all-client optimizer step (the spec of :func:`fedfast.ops.client_step`).

For every client row k (parameters ``theta`` [n, P], loss gradients ``grad`` [n, P]), in this order:

    1. loss-side terms   g = grad + mu (theta - anchor)                        FedProx (Li et al.)
                                + dyn_alpha_k (h_k - anchor) ... see below    FedDyn linear term
    2. clipping          g = g * min(1, max_norm / ||g||_2)   (per client)     torch.nn.utils.clip_grad_norm_
    3. optimizer terms   g = g + wd_k * theta + (c - c_k)                      coupled weight decay; SCAFFOLD
    4. momentum          buf = momentum * buf + g  (buf zeroed at the round start, as torch.optim.SGD's
                         first step)                                           SGD, dampening 0, no Nesterov
    5. update            theta = theta - lr_k * (buf + s_k * drift)            FedADC heavy-ball drift
                                                                               s_k drift = beta_l m_t / H_k

FedDyn's client loss (Acar et al.; ASD/FedDyn code) is ``CE + alpha_k <theta, h_k - anchor>`` with SGD weight
decay ``alpha_k + wd``: its gradient term is ``alpha_k (h_k - anchor)`` (``dyn_linear``; pass
``weight_decay = alpha_k + wd``). Rows with ``active[k] == False`` are left unchanged (parameters and
momentum). ``lr`` and ``weight_decay`` may be per client ([n]).

FedADC's Nesterov ("red") ordering applies the drift before each gradient evaluation; it equals the
heavy-ball step on the shifted sequence with one drift half-step ``theta -= lr * drift`` before the first
step and ``theta += lr * drift`` after the last (``drift_shift_``).
"""
from __future__ import annotations

import torch
from torch import Tensor


def _per_row(v, n, acc, device):
    if isinstance(v, Tensor):
        return v.to(device=device, dtype=acc).reshape(-1, 1)
    return torch.full((n, 1), float(v), dtype=acc, device=device)


def clipped_loss_grad(th: Tensor, g: Tensor, prox_mu: float, anchor: Tensor | None, dyn_linear: Tensor | None,
                      max_norm: float | None) -> Tensor:
    """Steps 1-2: the loss-side gradient (FedProx, FedDyn's linear term), clipped per client as
    ``clip_grad_norm_`` (``max_norm / (total_norm + 1e-6)``), in ``th``'s dtype."""
    if prox_mu:
        g = g + prox_mu * (th - anchor.to(th.dtype))
    if dyn_linear is not None:
        g = g + dyn_linear.to(th.dtype)
    if max_norm is not None:
        g = g * torch.clamp(max_norm / (g.norm(dim=1, keepdim=True) + 1e-6), max=1.0)
    return g


def client_step_reference(theta: Tensor, grad: Tensor, *, lr, momentum: float = 0.0, momentum_buf: Tensor | None = None,
                          weight_decay=0.0, prox_mu: float = 0.0, anchor: Tensor | None = None,
                          dyn_linear: Tensor | None = None, scaffold_c: Tensor | None = None,
                          scaffold_ck: Tensor | None = None, drift: Tensor | None = None, drift_scale=None,
                          max_norm: float | None = None, active: Tensor | None = None):
    """Returns ``(theta', momentum_buf')`` as new tensors (``momentum_buf'`` is None without momentum).

    ``dyn_linear`` [n, P] is the FedDyn gradient term ``alpha_k (h_k - anchor)`` precomputed per row."""
    acc = torch.float64 if theta.dtype == torch.float64 else torch.float32
    n = theta.shape[0]
    th = theta.to(acc)
    g = clipped_loss_grad(th, grad.to(acc), prox_mu, anchor, dyn_linear, max_norm)
    g = g + _per_row(weight_decay, n, acc, th.device) * th
    if scaffold_c is not None:
        g = g + (scaffold_c.to(acc) - scaffold_ck.to(acc))
    buf = None
    if momentum_buf is not None:
        buf = momentum * momentum_buf.to(acc) + g
        g = buf
    if drift is not None:
        d = drift.to(acc)[None, :]
        g = g + (d if drift_scale is None else _per_row(drift_scale, n, acc, th.device) * d)
    new = th - _per_row(lr, n, acc, th.device) * g
    if active is not None:
        keep = ~active.to(torch.bool).reshape(-1, 1)
        new = torch.where(keep, th, new)
        if buf is not None:
            buf = torch.where(keep, momentum_buf.to(acc), buf)
    return new, buf
