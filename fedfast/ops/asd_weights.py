"""ASD per-sample weights (Yashwanth et al., "Adaptive Self-Distillation", Eq. 9-11).

``alphahat_i = exp(-H(softmax(t_i / entropy_tau))) / prior[s_i, y_i]`` (H: entropy of the full teacher
softmax, natural log; ``prior`` the client's label distribution, row ``s_i = segments[i]``), then
``alpha_i = alphahat_i / sum_{j in segment(i)} alphahat_j`` (normalised within each client's minibatch,
Eq. 20). The KD row weight handed to the fused loss is ``n_seg(i) * alpha_i`` so that the segment mean of
``CE_i + lam * n_seg * alpha_i * KL_i`` is the paper's ``CE_mean + lam * sum_i alpha_i KL_i``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from . import _backend, _validate
from ._door import Backends, OpArgs, extension
from ._rows import class_table, segment_counts, valid_rows
from .distill_reference import asd_weights_reference


def _asd_weights_rows(
    teacher: Tensor,
    target: Tensor,
    class_prior: Tensor,
    segments: Tensor | None,
    entropy_tau: float,
    ignore_index: int,
    backend: str,
) -> Tensor:
    """The op's door: its record and one table call (the custom op's body too)."""
    args = AsdWeightsArgs(
        teacher=teacher,
        target=target,
        class_prior=class_prior,
        segments=segments,
        entropy_tau=float(entropy_tau),
        ignore_index=int(ignore_index),
    )
    return ASD_WEIGHTS(backend, args)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AsdWeightsArgs(OpArgs):
    """:func:`asd_weights`' arguments, ``FEDFAST_ASD_WEIGHTS``' order (``csrc/op_signatures.h``)."""

    SIGNATURE: ClassVar[str] = "FEDFAST_ASD_WEIGHTS"
    teacher: Tensor
    target: Tensor
    class_prior: Tensor
    segments: Tensor | None
    entropy_tau: float
    ignore_index: int


def _weights_reference(a: AsdWeightsArgs) -> Tensor:
    return asd_weights_reference(
        a.teacher, a.target, a.class_prior, a.segments, entropy_tau=a.entropy_tau, ignore_index=a.ignore_index
    )


def _weights_triton(a: AsdWeightsArgs) -> Tensor:
    from ..triton.asd_weights import asd_weights_triton

    return asd_weights_triton(*a.values())


ASD_WEIGHTS = Backends(
    "asd_weights",
    reference=_weights_reference,
    cpu=extension("cpu", "asd_weights"),
    triton=_weights_triton,
    cuda=extension("cuda", "asd_weights"),
)


# The op for torch.compile; eager calls go to the backend directly (a custom op's Python dispatch costs ~0.1 ms).
asd_weights_op = torch.library.custom_op("fedfast::asd_weights", mutates_args=())(_asd_weights_rows)


@asd_weights_op.register_fake
def _(teacher, target, class_prior, segments, entropy_tau, ignore_index, backend):
    dt = torch.float64 if teacher.dtype == torch.float64 else torch.float32
    return teacher.new_empty((teacher.shape[0],), dtype=dt)


def asd_weights(
    teacher: Tensor,
    target: Tensor,
    class_prior,
    segments: Tensor | None = None,
    *,
    entropy_tau: float = 1.0,
    ignore_index: int = -100,
    backend: str | None = None,
    validate: str | None = None,
) -> Tensor:
    """Un-normalised ASD weights ``alphahat`` [R] (0 on ignored rows). ``class_prior`` [C] or [S, C]."""
    _validate.check_logits("teacher", teacher)
    entropy_tau = _validate.check_tau("entropy_tau", entropy_tau)
    R, C = teacher.shape
    dev = teacher.device
    mode = _validate.mode_for(dev, validate)
    _validate.check_target(target, R, C, ignore_index, dev, mode)
    if segments is not None:
        _validate.check_segments(segments, R, dev, mode, None)
        segments = segments.contiguous()
    prior = class_table("class_prior", class_prior, C, dev, segments)
    prior = _check_prior(prior, target, segments, C, ignore_index, mode)
    be = _backend.resolve_for(backend, dev.type, teacher.dtype)
    op = _asd_weights_rows if _backend.plain_eager(teacher, target, segments) else asd_weights_op
    return op(
        teacher.detach().contiguous(), target.contiguous(), prior, segments, float(entropy_tau), int(ignore_index), be
    )


def _check_prior(prior: Tensor, target: Tensor, segments, C: int, ignore_index: int, mode: str) -> Tensor:
    """``prior`` after its value check (in a traced graph, through the checking op: use the returned tensor)."""
    if mode != "off":
        S = prior.shape[0]
        valid = valid_rows(target, C, ignore_index)
        s = torch.zeros_like(target) if (segments is None or S == 1) else segments.long().clamp(0, S - 1)
        py = prior[s.long(), torch.where(valid, target, torch.zeros_like(target)).long()]
        bad = (valid & ~(py > 0)).any() | (prior < 0).any() | ~torch.isfinite(prior).all()
        prior = _validate.guard(prior, "class_prior", bad, PRIOR_MESSAGE, mode)
    return prior


PRIOR_MESSAGE = "must be finite, >= 0 and > 0 for every class present in target"


def asd_row_weights(
    teacher: Tensor,
    target: Tensor,
    class_prior,
    segments: Tensor | None = None,
    *,
    entropy_tau: float = 1.0,
    ignore_index: int = -100,
    backend: str | None = None,
    validate: str | None = None,
) -> Tensor:
    """ASD's KD row weights ``n_seg(i) * alpha_i`` [R] (:func:`asd_weights` normalised by :func:`asd_row_weight`),
    the ``row_weight`` of :func:`fedfast.ops.distill`. On the cpu backend in eager mode one C++ pass computes the
    weights, their per-segment normalisation and the ``class_prior`` check."""
    _validate.check_logits("teacher", teacher)
    entropy_tau = _validate.check_tau("entropy_tau", entropy_tau)
    R, C = teacher.shape
    dev = teacher.device
    be = _backend.resolve_for(backend, dev.type, teacher.dtype)
    mode = _validate.mode_for(dev, validate)
    if be != "cpu" or mode == "defer" or not _backend.plain_eager(teacher, target, segments):
        ahat = asd_weights(
            teacher,
            target,
            class_prior,
            segments,
            entropy_tau=entropy_tau,
            ignore_index=ignore_index,
            backend=backend,
            validate=validate,
        )
        return asd_row_weight(ahat, target, C, segments, ignore_index)
    _validate.check_target(target, R, C, ignore_index, dev, "off")  # types and shapes; values in the C++ pass
    if segments is not None:
        _validate.check_segments(segments, R, dev, "off", None)
    prior = class_table("class_prior", class_prior, C, dev, segments)
    rw, status = _backend.cpu_ext().asd_row_weight(
        teacher.detach(), target, prior, segments, float(entropy_tau), int(ignore_index)
    )
    if status and mode != "off":
        if status & 2:
            raise ValueError(f"target: class indices must lie in [0, {C}) or equal ignore_index={ignore_index}")
        if status & 4:
            raise ValueError(f"segments: client ids must be sorted (contiguous per client) and lie in [0, {R})")
        raise ValueError(f"class_prior: {PRIOR_MESSAGE}")
    return rw


def asd_autograd_row_weights(
    teacher: Tensor,
    target: Tensor,
    class_prior,
    segments: Tensor | None,
    entropy_tau: float,
    ignore_index: int,
    mode: str,
) -> Tensor:
    """ASD's row weights ``n_seg(i) * alpha_i`` with PyTorch's formulas (:func:`asd_weights_reference`, then
    :func:`asd_row_weight`): differentiable in ``teacher`` (mutual distillation, ``detach_teacher=False``: the
    gradient reaches the teacher through the weights too) and transformable (``torch.func``). ``class_prior``
    checked as :func:`asd_weights` checks it (``mode``)."""
    R, C = teacher.shape
    if _backend.functorch_wrapped(target, segments):
        mode = "off"  # a batched label cannot be checked on the host
    _validate.check_target(target, R, C, ignore_index, teacher.device, mode)
    prior = class_table("class_prior", class_prior, C, teacher.device, segments)
    prior = _check_prior(prior, target, segments, C, ignore_index, mode)
    ahat = asd_weights_reference(teacher, target, prior, segments, entropy_tau=entropy_tau, ignore_index=ignore_index)
    return asd_row_weight(ahat, target, C, segments, ignore_index)


def asd_row_weight(
    alphahat: Tensor, target: Tensor, C: int, segments: Tensor | None = None, ignore_index: int = -100
) -> Tensor:
    """``n_seg(i) * alpha_i`` with ``alpha`` normalised to sum 1 over each segment's valid rows (no host sync)."""
    valid = valid_rows(target, C, ignore_index)
    R = alphahat.shape[0]
    if segments is None:
        total = alphahat.sum()
        n = valid.sum().to(alphahat.dtype)
        return torch.where(
            valid, alphahat * n / total.clamp_min(torch.finfo(alphahat.dtype).tiny), torch.zeros_like(alphahat)
        )
    seg = segments.long().clamp(0, max(R - 1, 0))
    sums = torch.zeros(R, dtype=alphahat.dtype, device=alphahat.device).index_add(0, seg, alphahat)[seg]
    n = segment_counts(segments, valid).to(alphahat.dtype)
    return torch.where(
        valid, alphahat * n / sums.clamp_min(torch.finfo(alphahat.dtype).tiny), torch.zeros_like(alphahat)
    )
