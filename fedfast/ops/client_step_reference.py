"""Pure-PyTorch reference of the fused all-client optimizer step (the spec of :func:`fedfast.ops.client_step`).

For every client row k (parameters ``theta`` [n, P], loss gradients ``grad`` [n, P]), in this order:

    1. loss gradient     g = grad + mu (theta - a) + L_k                      proximal term; per-client loss term
    2. clipping          g = g * min(1, max_norm / (||g||_2 + 1e-6))            torch.nn.utils.clip_grad_norm_
    3. corrections       g = g + wd_k theta + (s_k v + r C_k)                   coupled weight decay; corrections
    4. momentum          buf = momentum * buf + g ; g = buf                     torch.optim.SGD (dampening 0)
    5. update            theta = theta - lr_k (g + o_k u)                        a step offset outside momentum

The terms, in the language of the step (the kernels know no method):

* ``prox_mu`` and ``anchor`` a [P]: a proximal pull toward a shared point;
* ``loss_rows`` L [n, P]: a per-client term of the loss gradient, clipped with it;
* ``corr_vec`` v [P] with ``corr_vec_scale`` s [n] (or a scalar; default 1) and ``corr_rows`` C [n, P] with
  ``corr_rows_coef`` r (a scalar; default 1): a gradient correction after clipping that enters the momentum
  buffer;
* ``step_vec`` u [P] with ``step_vec_scale`` o [n] (or a scalar; default 1): added to the step after momentum, so
  never accumulated.

Which of its quantities a method puts in which term is written in its own file under ``fedfast/methods/``
(``step_terms``) and tabulated in docs/methods.md.

The buffer is zeroed at the round start, as torch.optim.SGD's first step; no Nesterov. Rows with
``active[k] == False`` are left unchanged (parameters and momentum). ``lr`` and ``weight_decay`` may be per
client ([n]). Each method states its own terms in its file under ``fedfast/methods/``.

``delta_norm`` (an output [n], with ``delta_from`` [P]): each active row's ``||theta'_k - delta_from||`` after the
update (:func:`delta_norms_reference`), DP-FedAvg's update norm when this is a client's last step; the kernels add it
up in the step's own pass over the row.

A step offset applied before each gradient evaluation instead (a Nesterov ordering) equals the heavy-ball step on
the shifted sequence with one half-step ``theta -= lr * u`` before the first step and ``theta += lr * u`` after the
last (``drift_shift_``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _per_row(v, n, acc, device):
    if isinstance(v, Tensor):
        return v.to(device=device, dtype=acc).reshape(-1, 1)
    return torch.full((n, 1), float(v), dtype=acc, device=device)


def clipped_loss_grad(
    th: Tensor, g: Tensor, prox_mu: float, anchor: Tensor | None, loss_rows: Tensor | None, max_norm: float | None
) -> Tensor:
    """Steps 1-2: the loss gradient with the proximal term and the per-client loss term, clipped per client as
    ``clip_grad_norm_`` (``max_norm / (total_norm + 1e-6)``), in ``th``'s dtype."""
    if prox_mu:
        g = g + prox_mu * (th - anchor.to(th.dtype))
    if loss_rows is not None:
        g = g + loss_rows.to(th.dtype)
    if max_norm is not None:
        g = g * torch.clamp(max_norm / (g.norm(dim=1, keepdim=True) + 1e-6), max=1.0)
    return g


def _scaled_vec(v: Tensor, scale, n: int, acc, device) -> Tensor:
    d = v.to(acc)[None, :]
    return d if scale is None else _per_row(scale, n, acc, device) * d


def client_step_reference(
    theta: Tensor,
    grad: Tensor,
    *,
    lr,
    momentum: float = 0.0,
    momentum_buf: Tensor | None = None,
    weight_decay=0.0,
    prox_mu: float = 0.0,
    anchor: Tensor | None = None,
    loss_rows: Tensor | None = None,
    corr_vec: Tensor | None = None,
    corr_vec_scale=None,
    corr_rows: Tensor | None = None,
    corr_rows_coef: float = 1.0,
    step_vec: Tensor | None = None,
    step_vec_scale=None,
    max_norm: float | None = None,
    active: Tensor | None = None,
):
    """Returns ``(theta', momentum_buf')`` as new tensors (``momentum_buf'`` is None without momentum)."""
    acc = torch.float64 if theta.dtype == torch.float64 else torch.float32
    n = theta.shape[0]
    th = theta.to(acc)
    g = clipped_loss_grad(th, grad.to(acc), prox_mu, anchor, loss_rows, max_norm)
    g = g + _per_row(weight_decay, n, acc, th.device) * th
    corr = None
    if corr_vec is not None:
        corr = _scaled_vec(corr_vec, corr_vec_scale, n, acc, th.device)
    if corr_rows is not None:
        cr = float(corr_rows_coef) * corr_rows.to(acc)
        corr = cr if corr is None else corr + cr
    if corr is not None:
        g = g + corr
    buf = None
    if momentum_buf is not None:
        buf = momentum * momentum_buf.to(acc) + g
        g = buf
    if step_vec is not None:
        g = g + _scaled_vec(step_vec, step_vec_scale, n, acc, th.device)
    new = th - _per_row(lr, n, acc, th.device) * g
    if active is not None:
        keep = ~active.to(torch.bool).reshape(-1, 1)
        new = torch.where(keep, th, new)
        if buf is not None:
            buf = torch.where(keep, momentum_buf.to(acc), buf)
    return new, buf


def delta_norms_reference(new: Tensor, delta_from: Tensor, delta_norm: Tensor, active: Tensor | None = None) -> None:
    """``delta_norm[k] = ||new_k - delta_from||`` for the active rows, in place (fp32 rows: summed in float64)."""
    acc = torch.float64
    d = torch.linalg.vector_norm(new.to(acc) - delta_from.to(acc), dim=1).to(delta_norm.dtype)
    if active is not None:
        d = torch.where(active.to(torch.bool), d, delta_norm)
    delta_norm.copy_(d)
