"""Fused all-client Adam / AdamW step over a flat ``[n, P]`` parameter buffer, in place.

Formulas and order (a proximal term, per-client loss rows, clipping, L2 or decoupled weight decay, bias correction
by each client's own step count, masking): :mod:`fedfast.ops.client_adam_reference`. Backends: ``cpu`` (C++),
``triton`` (fedfast/triton/client_adam.py), ``cuda`` (kernels/client_adam.cu) and ``reference``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _backend
from .client_adam_reference import client_adam_reference
from .client_step import _per_client, delta_args, delta_norms_after, grad_pieces
from .client_step_reference import delta_norms_reference


def client_adam(
    theta: Tensor,
    grad: "Tensor | list[Tensor]",
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
    delta_from: Tensor | None = None,
    delta_norm: Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Update ``theta``, ``exp_avg`` and ``exp_avg_sq`` [n, P] (fp32, contiguous) in place.

    ``grad``: [n, P] or the per-parameter pieces ``[n, *shape_p]`` in column order (read in place on ``cpu``).
    ``step``: [n] (or a scalar) each client's step count including this step (>= 1). ``lr`` and
    ``weight_decay``: scalars or per client [n]. ``decoupled``: AdamW's weight decay, else Adam's L2.
    ``anchor`` [P] with ``prox_mu``: a proximal term. ``loss_rows`` [n, P]: a per-client loss-gradient term
    (clipped with it). ``max_norm``: per-client gradient-norm clipping. ``active`` [n] bool: rows that take this
    step. ``delta_norm`` [n] fp32 (written) with ``delta_from`` [P]: each active row's ``||theta'_k - delta_from||``
    after the step (as :func:`fedfast.ops.client_step`'s)."""
    if not (isinstance(theta, Tensor) and theta.dim() == 2 and theta.dtype == torch.float32 and theta.is_contiguous()):
        raise TypeError("theta: expected a contiguous fp32 [n, P] tensor (it is updated in place)")
    n, P = theta.shape
    dev = theta.device
    pieces = grad_pieces(grad, n, P)
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not (isinstance(t, Tensor) and t.shape == (n, P) and t.dtype == torch.float32 and t.is_contiguous()):
            raise TypeError(f"{name}: expected a contiguous fp32 ({n}, {P}) tensor (it is updated in place)")
    for name, t, shp in (("anchor", anchor, (P,)), ("loss_rows", loss_rows, (n, P)), ("active", active, (n,))):
        if t is not None and t.shape != shp:
            raise ValueError(f"{name}: expected shape {shp}, got {tuple(t.shape)}")
    if prox_mu and anchor is None:
        raise ValueError("anchor: a proximal term (prox_mu > 0) needs its anchor")
    b1, b2 = (float(b) for b in betas)
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"betas: each must be in [0, 1), got {tuple(betas)}")
    if not eps > 0:
        raise ValueError(f"eps: must be > 0, got {eps}")
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"max_norm: must be > 0, got {max_norm}")
    lr_t = _per_client("lr", lr, n, dev)
    wd_t = _per_client("weight_decay", weight_decay, n, dev)
    step_t = _per_client("step", step, n, dev).expand(n).contiguous()
    delta = delta_args(delta_from, delta_norm, n, P, dev)
    be = _backend.resolve(backend, dev.type)
    if be != "reference":  # every compiled backend takes FEDFAST_CLIENT_ADAM's arguments (csrc/op_signatures.h)
        on_device = be == "cuda" and delta  # the CUDA binding's step leaves the norms to a pass after it
        args = (
            theta,
            pieces if pieces is not None else [grad],
            exp_avg,
            exp_avg_sq,
            step_t,
            lr_t,
            b1,
            b2,
            float(eps),
            wd_t,
            bool(decoupled),
            float(prox_mu),
            anchor,
            loss_rows,
            float(max_norm) if max_norm is not None else 0.0,
            active,
            None if on_device else delta_from,
            None if on_device else delta_norm,
        )
        if be == "triton":
            from ..triton.client_adam import client_adam_triton

            client_adam_triton(*args)
        else:
            (_backend.cpu_ext() if be == "cpu" else _backend.cuda_ext()).client_adam(*args)
        if on_device:
            delta_norms_after(theta, delta_from, delta_norm, active)
        return
    g = torch.cat([p.reshape(n, -1) for p in pieces], 1) if pieces is not None else grad
    new, m, v = client_adam_reference(
        theta,
        g,
        exp_avg,
        exp_avg_sq,
        step_t,
        lr=lr_t if lr_t.numel() == n else float(lr_t),
        betas=(b1, b2),
        eps=eps,
        weight_decay=wd_t if wd_t.numel() == n else float(wd_t),
        decoupled=decoupled,
        prox_mu=prox_mu,
        anchor=anchor,
        loss_rows=loss_rows,
        max_norm=max_norm,
        active=active,
    )
    if delta:
        delta_norms_reference(new, delta_from, delta_norm, active)
    theta.copy_(new)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
