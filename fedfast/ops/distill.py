"""The fused distillation row op: loss and d(loss)/d(student) in one pass, on four backends.

Formula and papers: see :mod:`fedfast.ops.distill_reference` (the spec). This module registers the op
with ``torch.library`` (fake impls for ``torch.compile``, autograd whose backward only scales the
gradient stored in forward), dispatches to a backend, validates inputs and applies the reduction.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Optional

import torch
from torch import Tensor

from . import _backend, _validate
from ._door import Backends, OpArgs, extension
from ._rows import class_table, segment_counts, valid_rows
from .asd_weights import PRIOR_MESSAGE, asd_autograd_row_weights, asd_row_weights
from .distill_reference import distill_reference, distill_rows_reference, teacher_mixture_reference
from .teacher_mixture import mixture_weights, teacher_mixture

_KINDS = ("full", "not_true")


def _loss_dtype(student: Tensor) -> torch.dtype:
    return torch.float64 if student.dtype == torch.float64 else torch.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillRowsArgs(OpArgs):
    """The fused rows' arguments, ``FEDFAST_DISTILL_ROWS``' order (``csrc/op_signatures.h``): the student [R, C]
    and the teacher (logits [R, C]; with ``teacher_negent`` [R] probabilities; with ``mix_weights`` [M] M teachers'
    logits [M, R, C]), the targets [R] and the optional tables, and the scalars. ``mix_weights``, ``class_prior`` /
    ``entropy_tau`` (ASD's weights in the same call) and ``in_place`` (the gradient over ``student``) are the CPU
    kernel's own."""

    SIGNATURE: ClassVar[str] = "FEDFAST_DISTILL_ROWS"
    student: Tensor
    teacher: Tensor
    target: Tensor
    teacher_negent: Tensor | None = None
    mix_weights: Tensor | None = None
    class_alpha: Tensor | None = None
    row_weight: Tensor | None = None
    class_prior: Tensor | None = None
    entropy_tau: float = 1.0
    rho: Tensor | None = None
    segments: Tensor | None = None
    row_scale: Tensor | None = None
    tau: float = 1.0
    ce_weight: float = 1.0
    kd_weight: float = 1.0
    ignore_index: int = -100
    not_true: bool = False
    soft_ce: bool = False
    in_place: bool = False


def _rows_reference(a: DistillRowsArgs):
    if a.mix_weights is not None or a.class_prior is not None or a.in_place:
        raise ValueError("backend: mix_weights, class_prior and in_place are the cpu kernel's (the reference has none)")
    loss, grad = distill_rows_reference(
        a.student,
        a.teacher,
        a.target,
        tau=a.tau,
        ce_weight=a.ce_weight,
        kd_weight=a.kd_weight,
        not_true=a.not_true,
        soft_ce=a.soft_ce,
        ignore_index=a.ignore_index,
        class_alpha=a.class_alpha,
        row_weight=a.row_weight,
        rho=a.rho,
        segments=a.segments,
        teacher_negent=a.teacher_negent,
        row_scale=a.row_scale,
    )
    return loss, grad, 0


def _rows_triton(a: DistillRowsArgs):
    from ..triton.distill import distill_rows_triton

    return distill_rows_triton(*a.values())


DISTILL_ROWS = Backends(
    "distill_rows",
    reference=_rows_reference,
    cpu=extension("cpu", "distill_rows"),
    cuda=extension("cuda", "distill_rows"),
    triton=_rows_triton,
)


def _backend_rows(backend: str, args: DistillRowsArgs, mode: str = "off"):
    """(loss rows, d(loss)/d(student)) of ``args`` on ``backend``; ASD's prior check (the kernel's status, with
    ``args.class_prior``) raises unless ``mode`` is "off"."""
    loss, grad, status = DISTILL_ROWS(backend, args)
    if status and args.class_prior is not None and mode != "off":
        raise ValueError(f"class_prior: {PRIOR_MESSAGE}")
    return loss, grad


@torch.library.custom_op("fedfast::distill_rows", mutates_args=())
def distill_rows_op(
    student: Tensor,
    teacher: Tensor,
    target: Tensor,
    teacher_negent: Optional[Tensor],
    class_alpha: Optional[Tensor],
    row_weight: Optional[Tensor],
    rho: Optional[Tensor],
    segments: Optional[Tensor],
    row_scale: Optional[Tensor],
    tau: float,
    ce_weight: float,
    kd_weight: float,
    ignore_index: int,
    not_true: bool,
    soft_ce: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    args = DistillRowsArgs(
        student=student,
        teacher=teacher,
        target=target,
        teacher_negent=teacher_negent,
        class_alpha=class_alpha,
        row_weight=row_weight,
        rho=rho,
        segments=segments,
        row_scale=row_scale,
        tau=tau,
        ce_weight=ce_weight,
        kd_weight=kd_weight,
        ignore_index=ignore_index,
        not_true=not_true,
        soft_ce=soft_ce,
    )
    return _backend_rows(backend, args)


@distill_rows_op.register_fake
def _(
    student,
    teacher,
    target,
    teacher_negent,
    class_alpha,
    row_weight,
    rho,
    segments,
    row_scale,
    tau,
    ce_weight,
    kd_weight,
    ignore_index,
    not_true,
    soft_ce,
    backend,
):
    return student.new_empty(student.shape[0], dtype=_loss_dtype(student)), torch.empty_like(student)


def scale_rows(grad: Tensor, grad_loss: Tensor, backend: str) -> Tensor:
    """Backward of the row op: ``grad_loss[:, None] * grad`` in fp32 (fp64 for fp64), stored in ``grad.dtype``.
    Bytes: 2*R*C*g + 4R."""
    return SCALE_ROWS(backend, ScaleRowsArgs(grad, grad_loss))


@dataclasses.dataclass(frozen=True)
class ScaleRowsArgs(OpArgs):
    """:func:`scale_rows`' arguments, ``FEDFAST_SCALE_ROWS``' order (``csrc/op_signatures.h``)."""

    SIGNATURE: ClassVar[str] = "FEDFAST_SCALE_ROWS"
    grad: Tensor
    grad_loss: Tensor


def _scale_torch(a: ScaleRowsArgs) -> Tensor:
    """PyTorch (the reference's and the cpu backend's: one elementwise product)."""
    if a.grad.dtype in (torch.float32, torch.float64):
        return a.grad * a.grad_loss.to(a.grad.dtype)[:, None]
    return (a.grad.float() * a.grad_loss.float()[:, None]).to(a.grad.dtype)


def _scale_triton(a: ScaleRowsArgs) -> Tensor:
    from ..triton.distill import scale_rows_triton

    return scale_rows_triton(*a.values())


SCALE_ROWS = Backends(
    "scale_rows", reference=_scale_torch, cpu=_scale_torch, triton=_scale_triton, cuda=extension("cuda", "scale_rows")
)


@torch.library.custom_op("fedfast::scale_rows", mutates_args=())
def scale_rows_op(grad: Tensor, grad_loss: Tensor, backend: str) -> Tensor:
    return scale_rows(grad, grad_loss, backend)


@scale_rows_op.register_fake
def _(grad, grad_loss, backend):
    return torch.empty_like(grad)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.backend = inputs[-1]


FIRST_ORDER = (
    "fedfast's fused distillation backward is first-order: it scales d(loss)/d(student) stored in the "
    "forward, so a gradient of this gradient (create_graph=True: gradient penalties, Hessian-vector "
    "products) would be wrong. Pass double_backward=True (fedfast.nn losses, fedfast.ops.distill) to "
    "compute the loss with PyTorch's autograd formulas instead"
)


class _FirstOrderOnly(torch.autograd.Function):
    """The identity on a first-order gradient, whose own backward raises :data:`FIRST_ORDER`: ``create_graph=True``
    still gives the right first derivative, and only differentiating it again fails (with the reason)."""

    @staticmethod
    def forward(ctx, g, student):
        return g.view_as(g)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(FIRST_ORDER)


def _first_order(g: Tensor, anchor: Tensor) -> Tensor:
    """``g``, tied in the graph to ``anchor`` (the op's own saved output, whose graph leads back to the student and
    holds no logits-sized buffer) when a backward builds one (``create_graph=True``: grad mode is on inside the
    backward exactly then), so that a second derivative through the student's producers reaches the raising node."""
    return _FirstOrderOnly.apply(g, anchor) if torch.is_grad_enabled() else g


def _backward(ctx, grad_loss, grad_grad):
    if torch.is_grad_enabled():  # compiled: refused when the backward builds a graph (create_graph=True)
        raise RuntimeError(FIRST_ORDER)
    (grad,) = ctx.saved_tensors
    g = scale_rows_op(grad, grad_loss.contiguous(), ctx.backend)
    return (g,) + (None,) * 15


distill_rows_op.register_autograd(_backward, setup_context=_setup_context)


def _scale_stored(grad: Tensor, grad_loss: Tensor, backend: str) -> Tensor:
    """The backward of the eager path: the stored gradient times ``grad_loss`` (0-d for a summed loss, else [R]).
    In place when this backward is the stored gradient's last use (the graph is not kept: no ``retain_graph``,
    no ``create_graph``) and it is in the accumulation dtype, so the gradient handed on is the one logits-sized
    buffer the forward wrote; otherwise a scaled copy (:func:`scale_rows`)."""
    if grad.dtype in (torch.float32, torch.float64) and not torch._C._autograd._get_current_graph_task_keep_graph():
        gl = grad_loss.to(grad.dtype)
        return grad.mul_(gl if gl.dim() == 0 else gl[:, None])
    if grad_loss.dim() == 0:
        grad_loss = grad_loss.expand(grad.shape[0])
    return scale_rows(grad, grad_loss.contiguous(), backend)


class _DistillRowsFn(torch.autograd.Function):
    """Eager fast path: the same backend calls as ``fedfast::distill_rows`` without the Python dispatch cost of
    ``torch.library.custom_op`` (~0.1 ms per call); used when not compiling. One output: the loss rows, or their
    sum (``total``), so autograd keeps no node for the reduction. ``rest``: ``(DistillRowsArgs, backend, total,
    mode)`` as one tuple (autograd inspects each positional argument of ``apply``; the record's student and teacher
    are ``student`` and ``teacher``)."""

    @staticmethod
    def forward(ctx, student, teacher, rest):
        args, backend, total, mode = rest
        loss, grad = _backend_rows(backend, args, mode)
        out = loss.sum() if total else loss
        # The output is saved as the anchor of a second derivative (see _first_order): no logits-sized buffer.
        ctx.save_for_backward(grad, out)
        ctx.backend = backend
        return out

    @staticmethod
    def backward(ctx, grad_loss):
        grad, out = ctx.saved_tensors
        return _first_order(_scale_stored(grad, grad_loss, ctx.backend), out), None, None


# autograd.Function.apply less its Python prologue (functorch's dead-wrapper unwrapping, the setup_context probe):
# for callers that have checked that no torch.func transform is running and no input is wrapped (plain_eager)
try:
    _apply_plain = super(torch.autograd.Function, _DistillRowsFn).apply
except AttributeError:  # pragma: no cover - a torch whose Function has no C-level apply
    _apply_plain = _DistillRowsFn.apply


def distill_rows(args: DistillRowsArgs, backend: str, total: bool = False, mode: str = "off"):
    """The loss rows [R] of ``args`` (their sum with ``total``), differentiable in ``args.student``: the custom op
    while ``torch.compile`` traces, the autograd.Function fast path in eager mode (the record's cpu-only fields:
    eager cpu only; ``mode``: ASD's prior check, see :func:`_backend_rows`)."""
    if torch.compiler.is_compiling():
        loss_rows, _ = distill_rows_op(
            args.student,
            args.teacher,
            args.target,
            args.teacher_negent,
            args.class_alpha,
            args.row_weight,
            args.rho,
            args.segments,
            args.row_scale,
            args.tau,
            args.ce_weight,
            args.kd_weight,
            args.ignore_index,
            args.not_true,
            args.soft_ce,
            backend,
        )
        return loss_rows.sum() if total else loss_rows
    return _DistillRowsFn.apply(args.student, args.teacher, (args, backend, bool(total), mode))


def row_scale_torch(
    target: Tensor, C: int, ignore_index: int, segments: Tensor | None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Reduction weights with tensor ops (no host sync): 1/#valid rows, or 1/#valid rows of the row's segment."""
    valid = valid_rows(target, C, ignore_index)
    if segments is None:
        n = valid.sum().clamp_min(1).to(dtype)
        return torch.ones(target.shape[0], dtype=dtype, device=target.device) / n
    return 1.0 / segment_counts(segments, valid).clamp_min(1).to(dtype)


_REDUCTIONS = ("mean", "sum", "none", "segment")


def _teacher_logits(teacher, mixture, rho, teacher_weights, R: int, C: int, dev) -> Tensor:
    """The teacher as [M, R, C] logits (a precomputed mixture's P as one teacher), checked against the student."""
    if mixture is not None:
        if teacher is not None:
            raise ValueError("mixture: pass either teacher logits or a precomputed mixture, not both")
        if not (
            isinstance(mixture, (tuple, list)) and len(mixture) == 2 and all(isinstance(t, Tensor) for t in mixture)
        ):
            raise TypeError("mixture: expected a (P [R, C], negent [R]) pair of tensors")
        if mixture[0].shape != (R, C) or mixture[1].shape != (R,):
            raise ValueError(
                f"mixture: expected P [{R}, {C}] and negent [{R}], got {tuple(mixture[0].shape)} and "
                f"{tuple(mixture[1].shape)}"
            )
        if mixture[0].device != dev or mixture[1].device != dev:
            raise ValueError(f"mixture: must be on {dev}")
        if rho is not None or teacher_weights is not None:
            raise ValueError("mixture: cannot be combined with rho or teacher_weights")
        teacher = mixture[0][None]
    elif not isinstance(teacher, Tensor):
        raise TypeError(f"teacher: expected a torch.Tensor, got {type(teacher).__name__}")
    if teacher.dim() == 2:
        teacher = teacher[None]
    _validate.check_logits("teacher", teacher, ndim=3)
    if teacher.shape[1:] != (R, C):
        raise ValueError(f"teacher: expected [{R}, {C}] or [M, {R}, {C}] to match student, got {tuple(teacher.shape)}")
    if teacher.device != dev:
        raise ValueError(f"teacher: on {teacher.device}, student is on {dev}")
    return teacher


def device_row_scale(
    be: str,
    target: Tensor,
    segments: Tensor | None,
    C: int,
    ignore_index: int,
    smode: int,
    limit: int,
    status: Tensor | None,
):
    """The rows' reduction weights (fp32 [R]; None for ``smode`` 0) and, with ``status``, the deferred target and
    segment checks (``status``: the deferred flags, [0] target and [1] segments as in ``_validate._CHECKS``), in one
    launch on a GPU backend (the op's table), as ``(True, weights)``; ``(False, None)`` when the backend has no
    such kernel (a CUDA extension built before it)."""
    got = ROW_SCALE(be, row_scale_args(target, segments, C, ignore_index, smode, limit, status))
    return (False, None) if got is None else (True, got[0])


def row_scale_args(target, segments, C: int, ignore_index: int, mode: int, limit: int, status) -> RowScaleArgs:
    """The row-scale op's record (its fields by keyword; the scalars as the kernels take them)."""
    return RowScaleArgs(
        target=target,
        segments=segments,
        C=int(C),
        ignore_index=int(ignore_index),
        mode=int(mode),
        limit=int(limit),
        status=status,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowScaleArgs(OpArgs):
    """The rows' bookkeeping op's arguments, ``FEDFAST_ROW_SCALE``'s order (``csrc/op_signatures.h``): ``mode`` 0
    checks only, 1 one mean over the valid rows, 2 one mean per segment; ``status`` a GPU's deferred flags."""

    SIGNATURE: ClassVar[str] = "FEDFAST_ROW_SCALE"
    target: Tensor
    segments: Tensor | None
    C: int
    ignore_index: int
    mode: int
    limit: int
    status: Tensor | None


def _row_scale_reference(a: RowScaleArgs):
    """PyTorch: the weights (:func:`row_scale_torch`) and the checks - ORed into ``status`` on the device when it is
    given (no host sync), else returned as the C++ pass returns them (bit 0 a target, bit 1 the segments)."""
    mode = 1 if a.mode == 2 and a.segments is None else a.mode
    y = a.target
    bad_t = ((y != a.ignore_index) & ((y < 0) | (y >= a.C))).any()
    bad_s = torch.zeros((), dtype=torch.bool, device=y.device)
    if a.segments is not None and a.segments.numel():
        sg = a.segments
        bad_s = ((sg < 0) | (sg >= a.limit)).any() | (sg[1:] < sg[:-1]).any()
    rs = None if mode == 0 else row_scale_torch(y, a.C, a.ignore_index, a.segments if mode == 2 else None)
    if a.status is not None:
        a.status[0:1].bitwise_or_(bad_t.to(torch.int32).reshape(1))
        a.status[1:2].bitwise_or_(bad_s.to(torch.int32).reshape(1))
        return rs, 0
    return rs, int(bad_t) | (int(bad_s) << 1)


def _row_scale_triton(a: RowScaleArgs):
    from ..triton.row_scale import row_scale_triton

    return row_scale_triton(*a.values())


def _row_scale_cuda(a: RowScaleArgs):
    """The CUDA extension's kernel; None for an extension built before it (the caller falls back)."""
    fn = getattr(_backend.cuda_ext(), "row_scale", None)
    return None if fn is None else fn(*a.values())


ROW_SCALE = Backends(
    "row_scale",
    reference=_row_scale_reference,
    cpu=extension("cpu", "row_scale"),
    triton=_row_scale_triton,
    cuda=_row_scale_cuda,
)


def _rows(student, target, segments, be: str, mode: str, reduction: str, ignore_index: int, num_segments):
    """Targets and segments checked, and each row's reduction weight (1/n of its client for "mean"/"segment";
    None otherwise): the cpu backend validates and computes them in one C++ pass, the GPU backends in one launch
    (deferred checks) where the tensor ops would cost 9-33 launches of host time."""
    R, C = student.shape
    dev = student.device
    compiling = torch.compiler.is_compiling()
    # The cpu backend validates targets/segments and computes the reduction weights in one C++ pass.
    fast = be == "cpu" and mode != "defer" and not compiling
    # The GPU backends: one kernel for the weights and the deferred checks (eager mode's checks stay on the host).
    gpu = be in ("triton", "cuda") and mode in ("defer", "off") and student.dtype != torch.float64 and not compiling
    _validate.check_target(target, R, C, ignore_index, dev, "off" if fast or gpu else mode)
    if segments is not None:
        _validate.check_segments(segments, R, dev, "off" if fast or gpu else mode, num_segments)
        segments = segments.contiguous()
    target, segments = _validate.in_graph(target.contiguous(), segments, C, ignore_index, num_segments, mode)
    need_scale = reduction in ("mean", "segment")
    row_scale = None
    limit = num_segments if num_segments is not None else R
    if fast:
        smode = (2 if segments is not None else 1) if need_scale else 0
        rs, status = ROW_SCALE(be, row_scale_args(target, segments, C, ignore_index, smode, limit, None))
        if status and mode == "eager":
            if status & 1:
                raise ValueError(f"target: class indices must lie in [0, {C}) or equal ignore_index={ignore_index}")
            raise ValueError(f"segments: client ids must be sorted (contiguous per client) and lie in [0, {limit})")
        row_scale = rs if need_scale else None
        if need_scale and student.dtype == torch.float64:  # the C++ pass computes 1/n in float32
            row_scale = row_scale_torch(target, C, ignore_index, segments, torch.float64)
        return target, segments, row_scale
    if gpu:
        status = _validate.status(dev) if mode == "defer" and R else None
        if need_scale or status is not None:
            smode = (2 if segments is not None else 1) if need_scale else 0
            done, rs = device_row_scale(be, target, segments, C, ignore_index, smode, limit, status)
            if done:
                return target, segments, rs
            # an extension without the kernel: the tensor ops, with the checks they replace
            _validate.check_target(target, R, C, ignore_index, dev, mode)
            if segments is not None:
                _validate.check_segments(segments, R, dev, mode, num_segments)
    if need_scale:
        row_scale = row_scale_torch(target, C, ignore_index, segments, _loss_dtype(student))
    return target, segments, row_scale


def _teacher_input(
    student, teacher, target, mixture, rho, teacher_weights, tau, kind: str, ignore_index: int, be: str, mode: str
):
    """What the fused rows read as the teacher: one teacher's logits, or M teachers' (or a precomputed) mixture
    ``P`` with its negative entropy, and None; on the cpu backend in eager mode the M teachers [M, R, C] themselves,
    no negentropy, and their weights [M] (the op mixes each row)."""
    dev = student.device
    teacher = teacher.detach()
    negent = None
    M = teacher.shape[0]
    if mixture is not None:
        dt = _loss_dtype(student)
        teacher_in, negent = mixture[0].detach().to(dt), mixture[1].detach().to(dt).contiguous()
    elif M > 1 or teacher_weights is not None:
        if rho is not None:
            raise ValueError("rho: the FedADC+ target takes a single teacher, got M > 1 teachers")
        tw = torch.full((M,), 1.0 / M, device=dev) if teacher_weights is None else teacher_weights
        if be == "cpu" and _backend.plain_eager(student, teacher):  # mixed inside the row op: no [R, C] mixture
            return teacher.contiguous(), None, mixture_weights(tw, M, dev, teacher.dtype, mode)
        P, negent = teacher_mixture(
            teacher,
            tw,
            target,
            tau=tau,
            not_true=(kind == "not_true"),
            ignore_index=ignore_index,
            backend=be,
            validate=mode,
        )
        teacher_in = P
    else:
        teacher_in = teacher[0]
    if teacher_in.stride(-1) != 1:
        teacher_in = teacher_in.contiguous()
    return teacher_in, negent, None


def _reduce(loss_rows: Tensor, reduction: str, segments, num_segments):
    """The loss rows reduced: "none" as they are, "mean" summed (each row carries 1/n of its client already),
    "segment" summed per client."""
    dev = loss_rows.device
    if reduction == "none":
        return loss_rows
    if reduction != "segment":
        return loss_rows.sum()  # "mean": rows carry 1/n (or 1/n_segment) already
    if segments is None:
        return loss_rows.sum().reshape(1)
    S = _validate.segment_count(segments, num_segments)
    return torch.zeros(S, dtype=loss_rows.dtype, device=dev).index_add(0, segments.long().clamp(0, S - 1), loss_rows)


def _row_tables(class_alpha, rho, row_weight, segments, R: int, C: int, dev, acc: torch.dtype, mode: str):
    """FedCAD's per-class weights (checked in [0, 1]), FedADC+'s confidences and ASD's row weights as the row op
    reads them (contiguous, on ``dev``; ``row_weight`` in the loss dtype ``acc``); None stays None."""
    if class_alpha is not None:
        class_alpha = class_table("class_alpha", class_alpha, C, dev, None)[0].contiguous()
        if mode != "off":
            class_alpha = _validate.guard(
                class_alpha,
                "class_alpha",
                ((class_alpha < 0) | (class_alpha > 1) | class_alpha.isnan()).any(),
                "per-class weights must lie in [0, 1]",
                mode,
            )
    if rho is not None:
        rho = class_table("rho", rho, C, dev, segments)
    if row_weight is not None:
        if row_weight.shape != (R,):
            raise ValueError(f"row_weight: expected shape ({R},), got {tuple(row_weight.shape)}")
        row_weight = row_weight.to(device=dev, dtype=acc).contiguous()
    return class_alpha, rho, row_weight


def autograd_reason(student, teacher, detach_teacher: bool, double_backward: bool) -> str:
    """Why this call computes the loss with PyTorch's autograd formulas rather than the fused first-order op
    ("" when it does not): double backward or a teacher that receives gradients asked for, ``torch.jit.trace``
    (which cannot record the fused op's stored gradient) or a ``torch.func`` transform."""
    if double_backward:
        return "double_backward=True"
    if not detach_teacher:
        return "detach_teacher=False"
    if torch.compiler.is_compiling():  # the custom op, with its fake kernel and registered autograd
        return ""
    if torch.jit.is_tracing():
        return "torch.jit.trace"
    if _backend.functorch_active(student, teacher):
        return "a torch.func transform"
    if _backend.forward_ad_active(student, teacher):
        return "forward-mode AD"
    return ""


def _distill_autograd(why: str, c: DistillCall, mode: str):
    """The loss as plain differentiable PyTorch ops (:func:`distill_reference`): any order of derivative, gradients
    into the teacher unless ``detach_teacher``, traceable and transformable; slower than the fused op."""
    student, target, segments, ignore_index, num_segments = (
        c.student,
        c.target,
        c.segments,
        c.ignore_index,
        c.num_segments,
    )
    mixture, rho, teacher_weights, tau, kind = c.mixture, c.rho, c.teacher_weights, c.tau, c.kind
    backend = c.backend
    if backend not in (None, "reference"):
        raise ValueError(
            f"backend: {backend!r} computes the fused first-order gradient; {why} needs PyTorch's "
            f"autograd formulas (leave backend unset, or 'reference')"
        )
    R, C = student.shape
    dev = student.device
    teacher = _teacher_logits(c.teacher, mixture, rho, teacher_weights, R, C, dev)
    if _backend.functorch_wrapped(target, segments):
        mode = "off"  # a batched (vmapped) label cannot be checked on the host
    _validate.check_target(target, R, C, ignore_index, dev, mode)
    if segments is not None:
        _validate.check_segments(segments, R, dev, mode, num_segments)
    target, segments = _validate.in_graph(target, segments, C, ignore_index, num_segments, mode)
    acc = _loss_dtype(student)
    fix = (lambda t: t.detach()) if c.detach_teacher else (lambda t: t)
    negent = None
    M = teacher.shape[0]
    if mixture is not None:
        teacher_in, negent = fix(mixture[0]).to(acc), fix(mixture[1]).to(acc)
    elif M > 1 or teacher_weights is not None:
        if rho is not None:
            raise ValueError("rho: the FedADC+ target takes a single teacher, got M > 1 teachers")
        tw = torch.full((M,), 1.0 / M, device=dev) if teacher_weights is None else teacher_weights
        tw = mixture_weights(tw, M, dev, teacher.dtype, mode)  # checked as the fused path does (a graph op traced)
        teacher_in, negent = teacher_mixture_reference(
            fix(teacher), tw, target, tau=tau, not_true=(kind == "not_true"), ignore_index=ignore_index
        )
    else:
        teacher_in = fix(teacher[0])
    class_alpha, rho, row_weight = _row_tables(c.class_alpha, rho, c.row_weight, segments, R, C, dev, acc, mode)
    reduction = c.reduction
    row_scale = row_scale_torch(target, C, ignore_index, segments, acc) if reduction in ("mean", "segment") else None
    loss_rows = distill_reference(
        student,
        teacher_in,
        target,
        tau=tau,
        ce_weight=c.ce_weight,
        kd_weight=c.kd_weight,
        not_true=kind == "not_true",
        soft_ce=c.soft_ce,
        ignore_index=ignore_index,
        class_alpha=class_alpha,
        row_weight=row_weight,
        rho=rho,
        segments=segments,
        teacher_negent=negent,
        row_scale=row_scale,
    )
    return _reduce(loss_rows, reduction, segments, num_segments)


def _fast_lane(
    student, teacher, target, tau, ce_weight, kd_weight, kind: str, reduction: str, ignore_index, prior, entropy_tau
):
    """The loss of the common eager call, or None when the call needs :func:`distill`'s general path (which then
    checks and names whatever is unusual): contiguous fp32 CPU logits of one shape, int64 labels, finite float
    options, ASD's prior (if any) one fp32 [C] table, no ``FEDFAST_BACKEND`` / ``FEDFAST_VALIDATE``, no compile,
    trace or transform. The same C++ calls as the general path (the labels checked and the reduction weights formed
    in one pass, then the fused rows with ASD's weights), without its ~0.1 ms of Python at small shapes."""
    if (
        torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or not (type(student) is Tensor and type(teacher) is Tensor and type(target) is Tensor)
    ):  # (first: what torch.compile or jit.trace traces stops here)
        return None
    if not (type(tau) is float and type(ce_weight) is float and type(kd_weight) is float and type(ignore_index) is int):
        return None
    if (
        student.dtype != torch.float32
        or teacher.dtype != torch.float32
        or target.dtype != torch.int64
        or student.device.type != "cpu"
        or teacher.device.type != "cpu"
        or target.device.type != "cpu"
        or student.dim() != 2
        or teacher.shape != student.shape
        or target.shape != student.shape[:1]
        or student.shape[0] == 0
        or student.shape[1] < 2
        or not (student.is_contiguous() and teacher.is_contiguous() and target.is_contiguous())
        or not (tau > 0 and math.isfinite(tau) and math.isfinite(ce_weight) and math.isfinite(kd_weight))
    ):
        return None
    if _backend.env_overrides() or not _backend.plain_eager(student, teacher):
        return None
    ext = _backend.cpu_ext()
    if ext is None:
        return None
    R, C = student.shape
    if prior is not None:
        if not (
            type(prior) is Tensor
            and prior.dtype == torch.float32
            and prior.device.type == "cpu"
            and prior.shape == (C,)
            and prior.is_contiguous()
            and type(entropy_tau) is float
            and entropy_tau > 0
            and math.isfinite(entropy_tau)
        ):
            return None
    mean = reduction == "mean"
    rs, status = ext.row_scale(target, None, C, ignore_index, 1 if mean else 0, R, None)
    if status:
        raise ValueError(f"target: class indices must lie in [0, {C}) or equal ignore_index={ignore_index}")
    teacher = teacher.detach()
    args = DistillRowsArgs(
        student=student,
        teacher=teacher,
        target=target,
        class_prior=None if prior is None else prior[None],
        entropy_tau=entropy_tau if prior is not None else 1.0,
        row_scale=rs if mean else None,
        tau=tau,
        ce_weight=ce_weight,
        kd_weight=kd_weight,
        ignore_index=ignore_index,
        not_true=kind == "not_true",
    )
    return _apply_plain(student, teacher, (args, "cpu", True, "eager"))


def distill(
    student: Tensor,
    teacher: Tensor,
    target: Tensor,
    *,
    tau: float = 1.0,
    ce_weight: float = 1.0,
    kd_weight: float = 1.0,
    kind: str = "full",
    soft_ce: bool = False,
    class_alpha=None,
    row_weight: Tensor | None = None,
    rho=None,
    teacher_weights=None,
    segments: Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    num_segments: int | None = None,
    backend: str | None = None,
    validate: str | None = None,
    mixture=None,
    detach_teacher: bool = True,
    double_backward: bool = False,
    class_prior=None,
    entropy_tau: float = 1.0,
) -> Tensor:
    """Fused CE + distillation loss (see :mod:`fedfast.ops.distill_reference` for the formula).

    (The common eager call: one teacher's fp32 logits on the CPU, a mean or a sum, no per-class or per-row tables
    and no settings in the environment, goes straight to the C++ kernel: :func:`_fast_lane`.)

    ``student`` [R, C] logits (grad flows); ``teacher`` [R, C] logits, or [M, R, C] with
    ``teacher_weights`` [M] (default uniform) for a weighted sum of M KL terms (FedGKD-VOTE, reduced to
    one target mixture exactly); ``target`` [R] int. ``kind``: ``"full"`` or ``"not_true"`` (FedNTD).
    ``class_alpha`` [C]: FedCAD per-class weights; ``rho`` [C] or [S, C]: FedADC+ confidences;
    ``row_weight`` [R]: extra per-row KD weight. ``class_prior`` [C] or [S, C] (the client's label distribution):
    ASD's row weights ``n_seg * alpha_i`` from the teacher's entropy at ``entropy_tau`` (official code: 1.0) and
    this prior (:func:`fedfast.ops.asd_row_weights`), computed in the same C++ call on the cpu backend; excludes
    ``row_weight``. ``segments`` [R] sorted client ids: "mean" is
    taken within each segment and the means are summed; ``reduction="segment"`` returns per-segment
    means (``num_segments`` avoids one host sync). ``validate``: see :mod:`fedfast.ops._validate`.
    ``mixture``: a precomputed ``(P [R, C], negent [R])`` from :func:`fedfast.ops.teacher_mixture` (the
    engine computes it once per round for VOTE); then ``teacher`` must be None.

    Gradients. By default the teacher is a fixed target (``detach_teacher=True``: no gradient reaches it, even
    when it requires grad) and the backward is first-order: the fused op stores d(loss)/d(student) in the forward
    and the backward scales it, so asking for a gradient of that gradient (``create_graph=True``) raises. With
    ``detach_teacher=False`` (mutual or online distillation: the teacher learns too) or ``double_backward=True``
    (gradient penalties, Hessian-vector products) the loss is computed with PyTorch's autograd formulas (the
    reference formulas, any device, slower); ``torch.jit.trace``, ``torch.func`` transforms (``jvp`` too) and
    dual tensors of ``torch.autograd.forward_ad`` take that path too.
    """
    if (
        class_alpha is None
        and row_weight is None
        and rho is None
        and teacher_weights is None
        and segments is None
        and mixture is None
        and soft_ce is False
        and detach_teacher is True
        and double_backward is False
        and backend is None
        and validate is None
        and (reduction == "mean" or reduction == "sum")
        and (kind == "full" or kind == "not_true")
    ):
        out = _fast_lane(
            student, teacher, target, tau, ce_weight, kd_weight, kind, reduction, ignore_index, class_prior, entropy_tau
        )
        if out is not None:
            return out
    c = DistillCall(
        student=student,
        teacher=teacher,
        target=target,
        tau=tau,
        ce_weight=ce_weight,
        kd_weight=kd_weight,
        kind=kind,
        soft_ce=soft_ce,
        class_alpha=class_alpha,
        row_weight=row_weight,
        rho=rho,
        teacher_weights=teacher_weights,
        segments=segments,
        reduction=reduction,
        ignore_index=ignore_index,
        num_segments=num_segments,
        backend=backend,
        mixture=mixture,
        detach_teacher=detach_teacher,
    )
    return _distill(c, validate, double_backward, class_prior, entropy_tau)


def _distill(c: DistillCall, validate, double_backward: bool, class_prior, entropy_tau) -> Tensor:
    """:func:`distill`'s general path: the arguments checked, then PyTorch's formulas or the fused rows."""
    _validate.check_logits("student", c.student)
    if c.kind not in _KINDS:
        raise ValueError(f"kind: must be one of {_KINDS}, got {c.kind!r}")
    if c.reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: must be one of {_REDUCTIONS}, got {c.reduction!r}")
    c = dataclasses.replace(
        c,
        tau=_validate.check_tau("tau", c.tau),
        ce_weight=_validate.real("ce_weight", c.ce_weight),
        kd_weight=_validate.real("kd_weight", c.kd_weight),
    )
    R, C = c.student.shape
    if C < 2:
        raise ValueError(f"student: needs at least 2 classes, got C={C}")
    dev = c.student.device
    mode = _validate.mode_for(dev, validate)
    teacher = c.teacher if c.mixture is None else c.mixture[0]
    why = autograd_reason(c.student, teacher, c.detach_teacher, double_backward)
    be = None if why else _backend.resolve_for(c.backend, dev.type, c.student.dtype)
    asd = None
    if class_prior is not None:
        c, asd = _asd_terms(c, why, be, mode, class_prior, entropy_tau, validate)
    return _distill_autograd(why, c, mode) if why else _fused(c, be, mode, asd)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillCall:
    """:func:`distill`'s arguments after its first checks (``tau``, the weights and ``kind`` / ``reduction`` valid),
    as its two paths read them: the fused rows (:func:`_fused`) and PyTorch's formulas (:func:`_distill_autograd`)."""

    student: Tensor
    teacher: Tensor | None
    target: Tensor
    tau: float
    ce_weight: float
    kd_weight: float
    kind: str
    soft_ce: bool
    class_alpha: object
    row_weight: Tensor | None
    rho: object
    teacher_weights: object
    segments: Tensor | None
    reduction: str
    ignore_index: int
    num_segments: int | None
    backend: str | None
    mixture: object
    detach_teacher: bool


def _asd_terms(c: DistillCall, why: str, be, mode: str, class_prior, entropy_tau, validate):
    """ASD's KD row weights from the teacher and ``class_prior``: ``(c with row_weight, None)``, or, on the eager cpu
    path, ``(c, (prior table, entropy_tau, mode))`` for the C++ rows to compute them in the same call."""
    R, C = c.student.shape
    entropy_tau = _validate.check_tau("entropy_tau", entropy_tau)
    teacher = c.teacher
    if c.row_weight is not None:
        raise ValueError("class_prior: ASD computes the KD row weights; pass row_weight or class_prior, not both")
    if (
        c.mixture is not None
        or c.teacher_weights is not None
        or not isinstance(teacher, Tensor)
        or (teacher.dim() == 3 and teacher.shape[0] != 1)
    ):
        raise ValueError("class_prior: ASD's weights need a single teacher's logits [R, C]")
    t2 = teacher if teacher.dim() == 2 else teacher[0]
    if t2.shape != c.student.shape:
        raise ValueError(f"teacher: expected [{R}, {C}] to match student, got {tuple(teacher.shape)}")
    if why:  # PyTorch's formulas: differentiable in the teacher (detach_teacher=False), transformable (vmap)
        w = asd_autograd_row_weights(
            t2 if not c.detach_teacher else t2.detach(),
            c.target,
            class_prior,
            c.segments,
            entropy_tau,
            c.ignore_index,
            mode,
        )
        return dataclasses.replace(c, row_weight=w), None
    if be == "cpu" and mode != "defer" and _backend.plain_eager(c.student, t2):
        return c, (class_table("class_prior", class_prior, C, c.student.device, c.segments), float(entropy_tau), mode)
    w = asd_row_weights(
        t2,
        c.target,
        class_prior,
        c.segments,
        entropy_tau=entropy_tau,
        ignore_index=c.ignore_index,
        backend=c.backend,
        validate=validate,
    )
    return dataclasses.replace(c, row_weight=w), None


def _fused(c: DistillCall, be: str, mode: str, asd):
    """The loss through the fused first-order rows on backend ``be`` (``asd``: the cpu kernel's ASD terms)."""
    student = c.student
    R, C = student.shape
    dev = student.device
    teacher = _teacher_logits(c.teacher, c.mixture, c.rho, c.teacher_weights, R, C, dev)
    target, segments, row_scale = _rows(
        student, c.target, c.segments, be, mode, c.reduction, c.ignore_index, c.num_segments
    )
    teacher_in, negent, mix_weights = _teacher_input(
        student, teacher, target, c.mixture, c.rho, c.teacher_weights, c.tau, c.kind, c.ignore_index, be, mode
    )
    class_alpha, rho, row_weight = _row_tables(
        c.class_alpha, c.rho, c.row_weight, segments, R, C, dev, _loss_dtype(student), mode
    )
    reduction = c.reduction
    total = reduction in ("mean", "sum") or (reduction == "segment" and segments is None)
    prior, entropy_tau, asd_mode = asd if asd is not None else (None, 1.0, "off")
    args = DistillRowsArgs(
        student=student if student.stride(-1) == 1 else student.contiguous(),
        teacher=teacher_in,
        target=target,
        teacher_negent=negent,
        mix_weights=mix_weights,
        class_alpha=class_alpha,
        row_weight=row_weight,
        class_prior=prior,
        entropy_tau=float(entropy_tau),
        rho=rho,
        segments=segments,
        row_scale=row_scale,
        tau=float(c.tau),
        ce_weight=float(c.ce_weight),
        kd_weight=float(c.kd_weight),
        ignore_index=int(c.ignore_index),
        not_true=c.kind == "not_true",
        soft_ce=bool(c.soft_ce),
    )
    loss = distill_rows(args, be, total=total, mode=asd_mode)
    if total:  # "mean": rows carry 1/n (or 1/n_segment) already
        return loss.reshape(1) if reduction == "segment" else loss
    return _reduce(loss, reduction, segments, c.num_segments)
