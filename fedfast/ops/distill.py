"""The fused distillation row op: loss and d(loss)/d(student) in one pass, on four backends.

Formula and papers: see :mod:`fedfast.ops.distill_reference` (the spec). This module registers the op
with ``torch.library`` (fake impls for ``torch.compile``, autograd whose backward only scales the
gradient stored in forward), dispatches to a backend, validates inputs and applies the reduction.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _backend, _validate
from .distill_reference import distill_rows_reference

_KINDS = ("full", "not_true")


def _loss_dtype(student: Tensor) -> torch.dtype:
    return torch.float64 if student.dtype == torch.float64 else torch.float32


def _backend_rows(backend, student, teacher, target, teacher_negent, class_alpha, row_weight, rho, segments,
                  tau, ce_weight, kd_weight, ignore_index, not_true, soft_ce):
    if backend == "reference":
        return distill_rows_reference(student, teacher, target, tau=tau, ce_weight=ce_weight, kd_weight=kd_weight,
                                      not_true=not_true, soft_ce=soft_ce, ignore_index=ignore_index,
                                      class_alpha=class_alpha, row_weight=row_weight, rho=rho, segments=segments,
                                      teacher_negent=teacher_negent)
    args = (student, teacher, target, teacher_negent, class_alpha, row_weight, rho, segments,
            float(tau), float(ce_weight), float(kd_weight), int(ignore_index), bool(not_true), bool(soft_ce))
    if backend == "cpu":
        return tuple(_backend.cpu_ext().distill_rows(*args))
    if backend == "cuda":
        return tuple(_backend.cuda_ext().distill_rows(*args))
    if backend == "triton":
        from ..triton.distill import distill_rows_triton
        return distill_rows_triton(*args)
    raise ValueError(f"unknown backend {backend!r}")


@torch.library.custom_op("fedfast::distill_rows", mutates_args=())
def distill_rows_op(student: Tensor, teacher: Tensor, target: Tensor, teacher_negent: Optional[Tensor],
                    class_alpha: Optional[Tensor], row_weight: Optional[Tensor], rho: Optional[Tensor],
                    segments: Optional[Tensor], tau: float, ce_weight: float, kd_weight: float, ignore_index: int,
                    not_true: bool, soft_ce: bool, backend: str) -> tuple[Tensor, Tensor]:
    loss, grad = _backend_rows(backend, student, teacher, target, teacher_negent, class_alpha, row_weight, rho,
                               segments, tau, ce_weight, kd_weight, ignore_index, not_true, soft_ce)
    return loss, grad


@distill_rows_op.register_fake
def _(student, teacher, target, teacher_negent, class_alpha, row_weight, rho, segments, tau, ce_weight, kd_weight,
      ignore_index, not_true, soft_ce, backend):
    return student.new_empty(student.shape[0], dtype=_loss_dtype(student)), torch.empty_like(student)


@torch.library.custom_op("fedfast::scale_rows", mutates_args=())
def scale_rows_op(grad: Tensor, grad_loss: Tensor, backend: str) -> Tensor:
    """``grad_loss[:, None] * grad`` computed in fp32 (fp64 for fp64) and stored in ``grad.dtype``."""
    if backend == "triton":
        from ..triton.distill import scale_rows_triton
        return scale_rows_triton(grad, grad_loss)
    if backend == "cuda":
        return _backend.cuda_ext().scale_rows(grad, grad_loss)
    if grad.dtype in (torch.float32, torch.float64):
        return grad * grad_loss.to(grad.dtype)[:, None]
    return (grad.float() * grad_loss.float()[:, None]).to(grad.dtype)


@scale_rows_op.register_fake
def _(grad, grad_loss, backend):
    return torch.empty_like(grad)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.backend = inputs[-1]


def _backward(ctx, grad_loss, grad_grad):
    (grad,) = ctx.saved_tensors
    g = scale_rows_op(grad, grad_loss.contiguous(), ctx.backend)
    return (g,) + (None,) * 14


distill_rows_op.register_autograd(_backward, setup_context=_setup_context)


def _as_table(name: str, x, C: int, device, n_seg_rows: int | None) -> Tensor:
    """A per-class table as a contiguous fp32 [S, C] tensor on ``device``."""
    t = torch.as_tensor(x, device=device)
    if not t.is_floating_point():
        t = t.float()
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.shape[1] != C:
        raise ValueError(f"{name}: expected shape [{C}] or [num_segments, {C}], got {tuple(t.shape)}")
    if t.shape[0] > 1 and n_seg_rows is None:
        raise ValueError(f"{name}: a per-segment table [{t.shape[0]}, {C}] needs `segments`")
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32).contiguous()


def valid_rows(target: Tensor, C: int, ignore_index: int) -> Tensor:
    return (target != ignore_index) & (target >= 0) & (target < C)


def segment_counts(segments: Tensor, valid: Tensor) -> Tensor:
    """Per-row count of valid rows in the row's segment, [R] int (no host sync)."""
    R = segments.shape[0]
    seg = segments.long().clamp(0, max(R - 1, 0))
    counts = torch.zeros(R, dtype=torch.int32, device=segments.device).index_add_(0, seg, valid.to(torch.int32))
    return counts[seg]


def reduce_rows(loss_rows: Tensor, target: Tensor, C: int, ignore_index: int, reduction: str,
                segments: Tensor | None, num_segments: int | None) -> Tensor:
    """Apply ``reduction`` to per-row losses: mean over valid rows (within each segment, segment means
    summed), sum, none, or segment (the [num_segments] vector of per-segment means)."""
    if reduction == "none":
        return loss_rows
    if reduction == "sum":
        return loss_rows.sum()
    valid = valid_rows(target, C, ignore_index)
    if segments is None:
        if reduction == "segment":
            reduction, segments = "segment", torch.zeros_like(target)
            num_segments = 1
        else:
            return loss_rows.sum() / valid.sum().clamp_min(1).to(loss_rows.dtype)
    per_row = loss_rows / segment_counts(segments, valid).clamp_min(1).to(loss_rows.dtype)
    if reduction == "mean":
        return per_row.sum()
    S = int(num_segments) if num_segments is not None else (int(segments.max()) + 1 if segments.numel() else 1)
    seg = segments.long().clamp(0, S - 1)
    return torch.zeros(S, dtype=loss_rows.dtype, device=loss_rows.device).index_add(0, seg, per_row)


_REDUCTIONS = ("mean", "sum", "none", "segment")


def distill(student: Tensor, teacher: Tensor, target: Tensor, *, tau: float = 1.0, ce_weight: float = 1.0,
            kd_weight: float = 1.0, kind: str = "full", soft_ce: bool = False, class_alpha=None,
            row_weight: Tensor | None = None, rho=None, teacher_weights=None, segments: Tensor | None = None,
            reduction: str = "mean", ignore_index: int = -100, num_segments: int | None = None,
            backend: str | None = None, validate: str | None = None) -> Tensor:
    """Fused CE + distillation loss (see :mod:`fedfast.ops.distill_reference` for the formula).

    ``student`` [R, C] logits (grad flows); ``teacher`` [R, C] logits, or [M, R, C] with
    ``teacher_weights`` [M] (default uniform) for a weighted sum of M KL terms (FedGKD-VOTE, reduced to
    one target mixture exactly); ``target`` [R] int. ``kind``: ``"full"`` or ``"not_true"`` (FedNTD).
    ``class_alpha`` [C]: FedCAD per-class weights; ``rho`` [C] or [S, C]: FedADC+ confidences;
    ``row_weight`` [R]: extra per-row KD weight (ASD). ``segments`` [R] sorted client ids: "mean" is
    taken within each segment and the means are summed; ``reduction="segment"`` returns per-segment
    means (``num_segments`` avoids one host sync). ``validate``: see :mod:`fedfast.ops._validate`.
    """
    _validate.check_logits("student", student)
    if kind not in _KINDS:
        raise ValueError(f"kind: must be one of {_KINDS}, got {kind!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: must be one of {_REDUCTIONS}, got {reduction!r}")
    _validate.check_tau("tau", tau)
    for nm, v in (("ce_weight", ce_weight), ("kd_weight", kd_weight)):
        if not isinstance(v, (int, float)) or v != v or abs(v) == float("inf"):
            raise ValueError(f"{nm}: must be a finite number, got {v!r}")
    R, C = student.shape
    if C < 2:
        raise ValueError(f"student: needs at least 2 classes, got C={C}")
    dev = student.device
    mode = _validate.mode_for(dev, validate)
    if not isinstance(teacher, Tensor):
        raise TypeError(f"teacher: expected a torch.Tensor, got {type(teacher).__name__}")
    if teacher.dim() == 2:
        teacher = teacher[None]
    _validate.check_logits("teacher", teacher, ndim=3)
    if teacher.shape[1:] != (R, C):
        raise ValueError(f"teacher: expected [{R}, {C}] or [M, {R}, {C}] to match student, got "
                         f"{tuple(teacher.shape)}")
    if teacher.device != dev:
        raise ValueError(f"teacher: on {teacher.device}, student is on {dev}")
    _validate.check_target(target, R, C, ignore_index, dev, mode)
    if segments is not None:
        _validate.check_segments(segments, R, dev, mode, num_segments)
        segments = segments.contiguous()
    teacher = teacher.detach()
    be = _backend.resolve(backend, dev.type)
    negent = None
    M = teacher.shape[0]
    if M > 1 or teacher_weights is not None:
        if rho is not None:
            raise ValueError("rho: the FedADC+ target takes a single teacher, got M > 1 teachers")
        from .teacher_mixture import teacher_mixture
        tw = torch.full((M,), 1.0 / M, device=dev) if teacher_weights is None else teacher_weights
        P, negent = teacher_mixture(teacher, tw, target, tau=tau, not_true=(kind == "not_true"),
                                    ignore_index=ignore_index, backend=be, validate=mode)
        teacher_in = P
    else:
        teacher_in = teacher[0]
    if teacher_in.stride(-1) != 1:
        teacher_in = teacher_in.contiguous()
    if class_alpha is not None:
        class_alpha = _as_table("class_alpha", class_alpha, C, dev, None)[0].contiguous()
        if mode != "off":
            _validate.check("class_alpha", ((class_alpha < 0) | (class_alpha > 1) | class_alpha.isnan()).any(),
                            "per-class weights must lie in [0, 1]", mode)
    if rho is not None:
        rho = _as_table("rho", rho, C, dev, segments)
    if row_weight is not None:
        if row_weight.shape != (R,):
            raise ValueError(f"row_weight: expected shape ({R},), got {tuple(row_weight.shape)}")
        row_weight = row_weight.to(device=dev, dtype=_loss_dtype(student)).contiguous()
    s = student if student.stride(-1) == 1 else student.contiguous()
    loss_rows, _ = distill_rows_op(s, teacher_in, target.contiguous(), negent, class_alpha, row_weight, rho,
                                   segments, float(tau), float(ce_weight), float(kd_weight), int(ignore_index),
                                   kind == "not_true", bool(soft_ce), be)
    return reduce_rows(loss_rows, target, C, ignore_index, reduction, segments, num_segments)
