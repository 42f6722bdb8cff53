"""Fused all-client optimizer step over a flat ``[n, P]`` parameter buffer, in place.

Formulas and order (a proximal term, a per-client loss term, clipping, coupled weight decay, corrections, SGD
momentum, a step offset, masking): :mod:`fedfast.ops.client_step_reference`. The terms are generic; each method
says in its own file which of its quantities fills which. Backends: ``cpu`` (C++), ``cuda``
(kernels/client_step.cu), ``triton`` and ``reference``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _backend
from .client_step_reference import client_step_reference, delta_norms_reference


def _per_client(name, v, n, dev):
    if isinstance(v, (int, float)):  # a fill kernel, not a host-to-GPU copy (which would sync every step)
        return torch.full((1,), float(v), dtype=torch.float32, device=dev)
    t = torch.as_tensor(v, dtype=torch.float32, device=dev).reshape(-1)
    if t.numel() not in (1, n):
        raise ValueError(f"{name}: expected a scalar or one value per client ({n}), got {t.numel()} values")
    return t


def _vec_scale(name, scale, vec, vec_name, n, dev):
    """A vector term's per-client scale as [n] fp32 (None: 1 for every client)."""
    if scale is None:
        return None
    if vec is None:
        raise ValueError(f"{name}: given without {vec_name}")
    return _per_client(name, scale, n, dev).expand(n).contiguous()


def grad_pieces(grad, n: int, P: int) -> list | None:
    """Validate a step's gradient: the per-parameter pieces ``[n, *shape_p]`` (a list, returned) or one
    ``[n, P]`` tensor (None returned); ValueError naming ``grad`` otherwise."""
    if isinstance(grad, (list, tuple)):  # per-parameter gradients [n, *shape_p], in the columns' order
        pieces = list(grad)
        bad = [i for i, g in enumerate(pieces) if not (isinstance(g, Tensor) and g.dim() >= 1 and g.shape[0] == n)]
        if bad:
            raise ValueError(f"grad: piece {bad[0]} is not a tensor with {n} rows")
        cols = sum(g.numel() // n if n else 0 for g in pieces)
        if cols != P:
            raise ValueError(f"grad: the pieces have {cols} columns per row, theta has {P}")
        return pieces
    if not isinstance(grad, Tensor) or grad.shape != (n, P):
        raise ValueError(
            f"grad: expected shape ({n}, {P}) or a list of per-parameter pieces, got "
            f"{tuple(grad.shape) if isinstance(grad, Tensor) else type(grad).__name__}"
        )
    return None


def delta_args(delta_from, delta_norm, n: int, P: int, dev) -> bool:
    """Validate the step's update-norm output (``delta_norm`` [n] fp32, written, with ``delta_from`` [P]); whether
    it is asked for."""
    if (delta_from is None) != (delta_norm is None):
        raise ValueError(
            "delta_from/delta_norm: give both (the point the norms are measured from and the [n] output) or neither"
        )
    if delta_norm is None:
        return False
    if not (
        isinstance(delta_norm, Tensor)
        and delta_norm.shape == (n,)
        and delta_norm.dtype == torch.float32
        and delta_norm.is_contiguous()
        and delta_norm.device == dev
    ):
        raise TypeError(f"delta_norm: expected a contiguous fp32 ({n},) tensor on {dev} (it is written in place)")
    if not (isinstance(delta_from, Tensor) and delta_from.shape == (P,) and delta_from.is_floating_point()):
        raise ValueError(f"delta_from: expected a float tensor of shape ({P},)")
    return True


def delta_norms_after(theta: Tensor, delta_from: Tensor, delta_norm: Tensor, active: Tensor | None) -> None:
    """The CUDA backends' update norms: one pass over the rows just written (Triton's, else the reference's)."""
    if _backend.available("triton", theta.device.type):
        from ..triton.update_norms import update_norms_triton

        d = update_norms_triton(theta, torch.arange(theta.shape[0], device=theta.device), delta_from)
        delta_norm.copy_(d if active is None else torch.where(active.to(torch.bool), d, delta_norm))
    else:
        delta_norms_reference(theta, delta_from, delta_norm, active)


def client_step(
    theta: Tensor,
    grad: "Tensor | list[Tensor]",
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
    delta_from: Tensor | None = None,
    delta_norm: Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Update ``theta`` [n, P] (fp32, contiguous) and ``momentum_buf`` [n, P] in place.

    ``grad``: [n, P], or the per-parameter gradients ``[n, *shape_p]`` in the columns' order (what
    ``torch.autograd.grad`` returns for per-parameter leaves): the CPU and Triton kernels read fp32 pieces in
    place, so the caller need not concatenate them (a full [n, P] copy per step); the other backends
    concatenate.

    ``lr`` and ``weight_decay``: scalars or per client [n]. ``prox_mu`` with ``anchor`` [P]: a proximal term.
    ``loss_rows`` [n, P]: a per-client loss-gradient term (clipped with the gradient). ``corr_vec`` [P] times
    ``corr_vec_scale`` (scalar or [n], default 1) plus ``corr_rows_coef`` times ``corr_rows`` [n, P]: a
    correction after clipping, inside momentum. ``step_vec`` [P] times ``step_vec_scale`` (scalar or [n],
    default 1): a step offset outside momentum. ``max_norm``: per-client gradient-norm clipping. ``active`` [n]
    bool: rows that take this step (others are untouched, momentum included). ``delta_norm`` [n] fp32 (written)
    with ``delta_from`` [P]: each active row's ``||theta'_k - delta_from||`` after the step, added up in the step's
    own pass on the ``cpu`` and ``triton`` backends (DP-FedAvg's update norms at a client's last step; ``cuda``: one
    pass after it). The formulas: :mod:`fedfast.ops.client_step_reference`.
    """
    if not (isinstance(theta, Tensor) and theta.dim() == 2 and theta.dtype == torch.float32 and theta.is_contiguous()):
        raise TypeError("theta: expected a contiguous fp32 [n, P] tensor (it is updated in place)")
    n, P = theta.shape
    dev = theta.device
    pieces = grad_pieces(grad, n, P)
    for name, t, shp in (
        ("momentum_buf", momentum_buf, (n, P)),
        ("anchor", anchor, (P,)),
        ("loss_rows", loss_rows, (n, P)),
        ("corr_vec", corr_vec, (P,)),
        ("corr_rows", corr_rows, (n, P)),
        ("step_vec", step_vec, (P,)),
        ("active", active, (n,)),
    ):
        if t is not None and t.shape != shp:
            raise ValueError(f"{name}: expected shape {shp}, got {tuple(t.shape)}")
    if prox_mu and anchor is None:
        raise ValueError("anchor: a proximal term (prox_mu > 0) needs its anchor")
    if momentum_buf is not None and not (momentum_buf.dtype == torch.float32 and momentum_buf.is_contiguous()):
        raise TypeError("momentum_buf: expected a contiguous fp32 tensor (it is updated in place)")
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"max_norm: must be > 0, got {max_norm}")
    lr_t = _per_client("lr", lr, n, dev)
    cs_t = _vec_scale("corr_vec_scale", corr_vec_scale, corr_vec, "corr_vec", n, dev)
    ss_t = _vec_scale("step_vec_scale", step_vec_scale, step_vec, "step_vec", n, dev)
    if not isinstance(corr_rows_coef, (int, float)):
        raise TypeError(f"corr_rows_coef: expected a Python number, got {type(corr_rows_coef).__name__}")
    rc = float(corr_rows_coef)
    wd_t = _per_client("weight_decay", weight_decay, n, dev)
    delta = delta_args(delta_from, delta_norm, n, P, dev)
    be = _backend.resolve(backend, dev.type)
    if be in ("cpu", "cuda"):  # a list: the C++ kernel reads the pieces in place, the CUDA binding concatenates
        grad = pieces if pieces is not None else [grad]
    elif pieces is not None and not (be == "triton" and all(g.dtype == torch.float32 for g in pieces)):
        grad = torch.cat([g.reshape(n, -1) for g in pieces], 1) if pieces else theta.new_zeros(n, 0)
    # triton: fp32 pieces are read in place through a block table (fedfast/triton/client_step.py)

    # the compiled backends' one argument order (C++ CPU, CUDA, Triton)
    args = (
        theta,
        grad,
        lr_t,
        float(momentum),
        momentum_buf,
        wd_t,
        float(prox_mu),
        anchor,
        loss_rows,
        corr_vec,
        cs_t,
        corr_rows,
        rc,
        step_vec,
        ss_t,
        float(max_norm) if max_norm is not None else 0.0,
        active,
        delta_from if be != "cuda" else None,
        delta_norm if be != "cuda" else None,
    )
    if be == "triton":
        from ..triton.client_step import client_step_triton

        client_step_triton(*args)
        return
    if be in ("cpu", "cuda"):
        (_backend.cpu_ext() if be == "cpu" else _backend.cuda_ext()).client_step(*args)
        if delta and be == "cuda":
            delta_norms_after(theta, delta_from, delta_norm, active)
        return
    new, buf = client_step_reference(
        theta,
        grad,
        lr=lr_t if lr_t.numel() == n else float(lr_t),
        momentum=momentum,
        momentum_buf=momentum_buf,
        weight_decay=wd_t if wd_t.numel() == n else float(wd_t),
        prox_mu=prox_mu,
        anchor=anchor,
        loss_rows=loss_rows,
        corr_vec=corr_vec,
        corr_vec_scale=cs_t,
        corr_rows=corr_rows,
        corr_rows_coef=rc,
        step_vec=step_vec,
        step_vec_scale=ss_t,
        max_norm=max_norm,
        active=active,
    )
    if delta:
        delta_norms_reference(new, delta_from, delta_norm, active)
    theta.copy_(new)
    if momentum_buf is not None:
        momentum_buf.copy_(buf)


def drift_shift_(theta: Tensor, drift: Tensor, lr, sign: float = -1.0) -> None:
    """``theta += sign * lr * drift`` for every row: a step offset applied before each gradient evaluation
    (a Nesterov ordering) is the heavy-ball step on the sequence shifted by one half-step of that ``step_vec``
    (``sign=-1`` before the first step, ``+1`` after the last)."""
    lr_t = _per_client("lr", lr, theta.shape[0], theta.device).reshape(-1, 1)
    theta.add_(sign * lr_t * drift.to(theta.dtype)[None, :])
