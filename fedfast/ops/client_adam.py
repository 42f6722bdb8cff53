"""Fused all-client Adam / AdamW step over a flat ``[n, P]`` parameter buffer, in place.

Formulas and order (a proximal term, per-client loss rows, clipping, L2 or decoupled weight decay, bias correction
by each client's own step count, masking): :mod:`fedfast.ops.client_adam_reference`. Backends: ``cpu`` (C++),
``triton`` (fedfast/triton/client_adam.py), ``cuda`` (kernels/client_adam.cu) and ``reference``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from . import _backend
from ._door import Backends, OpArgs
from .client_adam_reference import client_adam_reference
from .client_step import (
    _per_client,
    check_shapes,
    check_terms,
    concat_grad,
    delta_args,
    delta_norms_after,
    grad_pieces,
    step_rows,
    write_rows,
)


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
    n, P, dev = step_rows(theta)
    pieces = grad_pieces(grad, n, P)
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not (isinstance(t, Tensor) and t.shape == (n, P) and t.dtype == torch.float32 and t.is_contiguous()):
            raise TypeError(f"{name}: expected a contiguous fp32 ({n}, {P}) tensor (it is updated in place)")
    check_shapes(anchor=(anchor, (P,)), loss_rows=(loss_rows, (n, P)), active=(active, (n,)))
    check_terms(prox_mu, anchor, max_norm)
    b1, b2 = (float(b) for b in betas)
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"betas: each must be in [0, 1), got {tuple(betas)}")
    if not eps > 0:
        raise ValueError(f"eps: must be > 0, got {eps}")
    lr_t = _per_client("lr", lr, n, dev)
    wd_t = _per_client("weight_decay", weight_decay, n, dev)
    step_t = _per_client("step", step, n, dev).expand(n).contiguous()
    delta_args(delta_from, delta_norm, n, P, dev)
    args = ClientAdamArgs(
        theta=theta,
        grad=pieces if pieces is not None else grad,
        exp_avg=exp_avg,
        exp_avg_sq=exp_avg_sq,
        step=step_t,
        lr=lr_t,
        beta1=b1,
        beta2=b2,
        eps=float(eps),
        wd=wd_t,
        decoupled=bool(decoupled),
        prox_mu=float(prox_mu),
        anchor=anchor,
        loss_rows=loss_rows,
        max_norm=float(max_norm) if max_norm is not None else 0.0,
        active=active,
        delta_from=delta_from,
        delta_norm=delta_norm,
    )
    CLIENT_ADAM(_backend.resolve(backend, dev.type), args)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientAdamArgs(OpArgs):
    """:func:`client_adam`'s checked arguments, ``FEDFAST_CLIENT_ADAM``'s order (``csrc/op_signatures.h``): ``grad``
    one [n, P] tensor or the per-parameter pieces (a list), ``step`` [n], ``lr`` / ``wd`` [1] or [n] fp32,
    ``max_norm`` 0 for none."""

    SIGNATURE: ClassVar[str] = "FEDFAST_CLIENT_ADAM"
    theta: Tensor
    grad: Tensor | list
    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: Tensor
    lr: Tensor
    beta1: float
    beta2: float
    eps: float
    wd: Tensor
    decoupled: bool
    prox_mu: float
    anchor: Tensor | None
    loss_rows: Tensor | None
    max_norm: float
    active: Tensor | None
    delta_from: Tensor | None
    delta_norm: Tensor | None


def _listed(a: ClientAdamArgs) -> ClientAdamArgs:
    """The compiled backends take the gradient as a list (one [n, P] tensor is a list of one)."""
    return a if isinstance(a.grad, list) else a.replace(grad=[a.grad])


def _adam_cpu(a: ClientAdamArgs) -> None:
    _backend.cpu_ext().client_adam(*_listed(a).values())


def _adam_cuda(a: ClientAdamArgs) -> None:
    """The CUDA binding's step leaves the update norms to one pass after it."""
    _backend.cuda_ext().client_adam(*_listed(a).replace(delta_from=None, delta_norm=None).values())
    if a.delta_norm is not None:
        delta_norms_after(a.theta, a.delta_from, a.delta_norm, a.active)


def _adam_triton(a: ClientAdamArgs) -> None:
    from ..triton.client_adam import client_adam_triton

    client_adam_triton(*_listed(a).values())


def _adam_reference(a: ClientAdamArgs) -> None:
    n = a.theta.shape[0]
    new, m, v = client_adam_reference(
        a.theta,
        concat_grad(a.grad, a.theta),
        a.exp_avg,
        a.exp_avg_sq,
        a.step,
        lr=a.lr if a.lr.numel() == n else float(a.lr),
        betas=(a.beta1, a.beta2),
        eps=a.eps,
        weight_decay=a.wd if a.wd.numel() == n else float(a.wd),
        decoupled=a.decoupled,
        prox_mu=a.prox_mu,
        anchor=a.anchor,
        loss_rows=a.loss_rows,
        max_norm=a.max_norm or None,
        active=a.active,
    )
    write_rows(a, new)
    a.exp_avg.copy_(m)
    a.exp_avg_sq.copy_(v)


CLIENT_ADAM = Backends("client_adam", reference=_adam_reference, cpu=_adam_cpu, cuda=_adam_cuda, triton=_adam_triton)
