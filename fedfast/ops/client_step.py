"""Fused all-client optimizer step over a flat ``[n, P]`` parameter buffer, in place.

Formulas and order (a proximal term, a per-client loss term, clipping, coupled weight decay, corrections, SGD
momentum, a step offset, masking): :mod:`fedfast.ops.client_step_reference`. The terms are generic; each method
says in its own file which of its quantities fills which. Backends: ``cpu`` (C++), ``cuda``
(kernels/client_step.cu), ``triton`` and ``reference``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from . import _backend
from ._door import Backends, OpArgs
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


def step_rows(theta) -> tuple:
    """``(n, P, device)`` of a step's parameter rows; TypeError naming ``theta`` unless contiguous fp32 [n, P]."""
    if not (isinstance(theta, Tensor) and theta.dim() == 2 and theta.dtype == torch.float32 and theta.is_contiguous()):
        raise TypeError("theta: expected a contiguous fp32 [n, P] tensor (it is updated in place)")
    return (*theta.shape, theta.device)


def check_terms(prox_mu, anchor, max_norm) -> None:
    """A proximal term has its anchor; a clipping norm is > 0."""
    if prox_mu and anchor is None:
        raise ValueError("anchor: a proximal term (prox_mu > 0) needs its anchor")
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"max_norm: must be > 0, got {max_norm}")


def check_shapes(**given) -> None:
    """``name=(tensor or None, shape)``: ValueError naming the first tensor given with another shape."""
    for name, (t, shp) in given.items():
        if t is not None and t.shape != shp:
            raise ValueError(f"{name}: expected shape {shp}, got {tuple(t.shape)}")


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
    n, P, dev = step_rows(theta)
    pieces = grad_pieces(grad, n, P)
    check_shapes(
        momentum_buf=(momentum_buf, (n, P)),
        anchor=(anchor, (P,)),
        loss_rows=(loss_rows, (n, P)),
        corr_vec=(corr_vec, (P,)),
        corr_rows=(corr_rows, (n, P)),
        step_vec=(step_vec, (P,)),
        active=(active, (n,)),
    )
    check_terms(prox_mu, anchor, max_norm)
    if momentum_buf is not None and not (momentum_buf.dtype == torch.float32 and momentum_buf.is_contiguous()):
        raise TypeError("momentum_buf: expected a contiguous fp32 tensor (it is updated in place)")
    if not isinstance(corr_rows_coef, (int, float)):
        raise TypeError(f"corr_rows_coef: expected a Python number, got {type(corr_rows_coef).__name__}")
    delta_args(delta_from, delta_norm, n, P, dev)
    args = ClientStepArgs(
        theta=theta,
        grad=pieces if pieces is not None else grad,
        lr=_per_client("lr", lr, n, dev),
        momentum=float(momentum),
        buf=momentum_buf,
        wd=_per_client("weight_decay", weight_decay, n, dev),
        prox_mu=float(prox_mu),
        anchor=anchor,
        loss_rows=loss_rows,
        corr_vec=corr_vec,
        corr_vec_scale=_vec_scale("corr_vec_scale", corr_vec_scale, corr_vec, "corr_vec", n, dev),
        corr_rows=corr_rows,
        corr_rows_coef=float(corr_rows_coef),
        step_vec=step_vec,
        step_vec_scale=_vec_scale("step_vec_scale", step_vec_scale, step_vec, "step_vec", n, dev),
        max_norm=float(max_norm) if max_norm is not None else 0.0,
        active=active,
        delta_from=delta_from,
        delta_norm=delta_norm,
    )
    CLIENT_STEP(_backend.resolve(backend, dev.type), args)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientStepArgs(OpArgs):
    """:func:`client_step`'s checked arguments, ``FEDFAST_CLIENT_STEP``'s order (``csrc/op_signatures.h``):
    ``grad`` one [n, P] tensor or the per-parameter pieces (a list), ``lr`` / ``wd`` [1] or [n] fp32, the vector
    scales [n] or None, ``max_norm`` 0 for none."""

    SIGNATURE: ClassVar[str] = "FEDFAST_CLIENT_STEP"
    theta: Tensor
    grad: Tensor | list
    lr: Tensor
    momentum: float
    buf: Tensor | None
    wd: Tensor
    prox_mu: float
    anchor: Tensor | None
    loss_rows: Tensor | None
    corr_vec: Tensor | None
    corr_vec_scale: Tensor | None
    corr_rows: Tensor | None
    corr_rows_coef: float
    step_vec: Tensor | None
    step_vec_scale: Tensor | None
    max_norm: float
    active: Tensor | None
    delta_from: Tensor | None
    delta_norm: Tensor | None


def concat_grad(grad, theta: Tensor) -> Tensor:
    """One [n, P] gradient from the per-parameter pieces (a list), as the backends that do not read pieces need."""
    if not isinstance(grad, list):
        return grad
    n = theta.shape[0]
    return torch.cat([g.reshape(n, -1) for g in grad], 1) if grad else theta.new_zeros(n, 0)


def _step_cpu(a: ClientStepArgs) -> None:
    """The C++ kernel reads the pieces in place (a list; one [n, P] tensor is a list of one)."""
    _backend.cpu_ext().client_step(*(a if isinstance(a.grad, list) else a.replace(grad=[a.grad])).values())


def _step_cuda(a: ClientStepArgs) -> None:
    """The CUDA binding concatenates a list itself; its step leaves the update norms to one pass after it."""
    grad = a.grad if isinstance(a.grad, list) else [a.grad]
    _backend.cuda_ext().client_step(*a.replace(grad=grad, delta_from=None, delta_norm=None).values())
    if a.delta_norm is not None:
        delta_norms_after(a.theta, a.delta_from, a.delta_norm, a.active)


def _step_triton(a: ClientStepArgs) -> None:
    """fp32 pieces are read in place through a block table (fedfast/triton/client_step.py); others concatenated."""
    from ..triton.client_step import client_step_triton

    if isinstance(a.grad, list) and not all(g.dtype == torch.float32 for g in a.grad):
        a = a.replace(grad=concat_grad(a.grad, a.theta))
    client_step_triton(*a.values())


def _step_reference(a: ClientStepArgs) -> None:
    n = a.theta.shape[0]
    new, buf = client_step_reference(
        a.theta,
        concat_grad(a.grad, a.theta),
        lr=a.lr if a.lr.numel() == n else float(a.lr),
        momentum=a.momentum,
        momentum_buf=a.buf,
        weight_decay=a.wd if a.wd.numel() == n else float(a.wd),
        prox_mu=a.prox_mu,
        anchor=a.anchor,
        loss_rows=a.loss_rows,
        corr_vec=a.corr_vec,
        corr_vec_scale=a.corr_vec_scale,
        corr_rows=a.corr_rows,
        corr_rows_coef=a.corr_rows_coef,
        step_vec=a.step_vec,
        step_vec_scale=a.step_vec_scale,
        max_norm=a.max_norm or None,
        active=a.active,
    )
    write_rows(a, new)
    if a.buf is not None:
        a.buf.copy_(buf)


def write_rows(a, new: Tensor) -> None:
    """A reference step's new rows into ``a.theta`` (the update norms first, where the record asks for them)."""
    if a.delta_norm is not None:
        delta_norms_reference(new, a.delta_from, a.delta_norm, a.active)
    a.theta.copy_(new)


CLIENT_STEP = Backends("client_step", reference=_step_reference, cpu=_step_cpu, cuda=_step_cuda, triton=_step_triton)


def drift_shift_(theta: Tensor, drift: Tensor, lr, sign: float = -1.0) -> None:
    """``theta += sign * lr * drift`` for every row: a step offset applied before each gradient evaluation
    (a Nesterov ordering) is the heavy-ball step on the sequence shifted by one half-step of that ``step_vec``
    (``sign=-1`` before the first step, ``+1`` after the last)."""
    lr_t = _per_client("lr", lr, theta.shape[0], theta.device).reshape(-1, 1)
    theta.add_(sign * lr_t * drift.to(theta.dtype)[None, :])
