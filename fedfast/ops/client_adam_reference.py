"""Pure-PyTorch reference of the fused all-client Adam / AdamW step (the spec of :func:`fedfast.ops.client_adam`).

For every client row k (parameters ``theta`` [n, P], loss gradients ``grad`` [n, P], moments ``exp_avg`` /
``exp_avg_sq`` [n, P], step count ``t_k`` = this client's steps so far, this one included), in this order:

    1. loss gradient    g = grad + mu (theta - anchor) + loss_rows               proximal; per-client loss term
    2. clipping         g = g * min(1, max_norm / (||g||_2 + 1e-6))  (per client) torch.nn.utils.clip_grad_norm_
    3. weight decay     Adam:  g = g + wd_k theta                                torch.optim.Adam (L2)
                        AdamW: theta = theta (1 - lr_k wd_k)                     torch.optim.AdamW (decoupled)
    4. moments          m = m + (1 - b1) (g - m) ;  v = b2 v + (1 - b2) g^2
    5. update           theta = theta - lr_k / (1 - b1^t_k) * m / (sqrt(v) / sqrt(1 - b2^t_k) + eps)

This is ``torch.optim.Adam`` / ``AdamW`` (``amsgrad=False``, ``maximize=False``) applied to each client's own
parameters with its own step count: a client's moments start at zero and its bias correction at t = 1 when its
optimizer is made (every round, as the engine's SGD momentum). Rows with ``active[k] == False`` are left
unchanged (parameters and moments; their step count is the caller's).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .client_step_reference import _per_row, clipped_loss_grad


def client_adam_reference(
    theta: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step,
    *,
    lr,
    betas=(0.9, 0.999),
    eps: float = 1e-8,
    weight_decay=0.0,
    decoupled: bool = False,
    prox_mu: float = 0.0,
    anchor: Tensor | None = None,
    loss_rows: Tensor | None = None,
    max_norm: float | None = None,
    active: Tensor | None = None,
):
    """Returns ``(theta', exp_avg', exp_avg_sq')`` as new tensors. ``step``: [n] (or a scalar) step counts."""
    acc = torch.float64 if theta.dtype == torch.float64 else torch.float32
    n = theta.shape[0]
    b1, b2 = betas
    th = theta.to(acc)
    g = clipped_loss_grad(th, grad.to(acc), prox_mu, anchor, loss_rows, max_norm)
    wd, lr_k = _per_row(weight_decay, n, acc, th.device), _per_row(lr, n, acc, th.device)
    new = th
    if decoupled:
        new = th * (1 - lr_k * wd)
    else:
        g = g + wd * th
    m = exp_avg.to(acc) + (1 - b1) * (g - exp_avg.to(acc))
    v = b2 * exp_avg_sq.to(acc) + (1 - b2) * g * g
    t = _per_row(step, n, torch.float64, th.device)
    bc1, bc2 = (1 - b1**t).to(acc), (1 - b2**t).to(acc)
    new = new - lr_k / bc1 * m / (v.sqrt() / bc2.sqrt() + eps)
    if active is not None:
        keep = ~active.to(torch.bool).reshape(-1, 1)
        new = torch.where(keep, th, new)
        m = torch.where(keep, exp_avg.to(acc), m)
        v = torch.where(keep, exp_avg_sq.to(acc), v)
    return new, m, v
