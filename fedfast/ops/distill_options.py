"""The options Liger-Kernel's distillation users expect, beside the papers' loss: one per-row formula, given twice.

The loss of a row with student logits ``z`` [V], teacher logits ``t`` [Vt] and label ``y``::

    L = ce_weight * hard + kd_weight * soft
    u = softcap * tanh(z / softcap)                (``softcap``; else u = z: Gemma 2's logit cap)
    hard = F.cross_entropy(u, y, weight=class_weight, label_smoothing=eps)   (per row, reduction "none")
         = (1 - eps) w_y (-log p_y) + (eps / V) sum_c w_c (-log p_c),   p = softmax(u)
    soft = D_beta(P || Q),  P = softmax(t' / tau),  Q = softmax(u / tau)   (t' = t, capped by ``teacher_softcap``)

with ``D_beta`` Liger-Kernel's generalised Jensen-Shannon divergence (``jsd_beta``, Liger's ``beta``; Agarwal et al.
2024, "On-policy distillation of language models"): ``beta = 0`` the forward KL ``KL(P || Q)`` (the papers' KD),
``beta = 1`` the reverse KL ``KL(Q || P)``, and between them ``beta KL(P || M) + (1 - beta) KL(Q || M)`` with
``M = beta P + (1 - beta) Q``. FedNTD's not-true form (``not_true``) takes ``P`` and ``Q`` over the classes other
than ``y``. A teacher with more classes than the student (``Vt > V``: a vocabulary padded for speed) needs
``teacher_vocab``: ``"drop"`` (the teacher's columns past ``V`` are dropped before its softmax: its distribution
over the student's classes) or ``"pad"`` (Liger's rule: the student's scaled logits padded with zeros to ``Vt``,
the hard term over the student's ``V``).

Reductions: ``"mean"`` divides the hard term by the summed class weights of the rows' labels (``F.cross_entropy``'s
rule; the row count without ``class_weight``) and the soft term by the row count (Liger's), per segment with
``segments``; rows labelled ``ignore_index`` count in neither. So each row carries two scales, ``scale[0]`` for the
hard term and ``scale[1]`` for the soft one (:func:`option_scales`).

:func:`option_rows` is the formula in PyTorch ops (differentiable to any order, float64 in float64): the plain losses
(:class:`fedfast.nn.KDLoss`, :class:`fedfast.nn.NTDLoss`) compute it with autograd, and it is the reference the
tests hold the chunked form to. :func:`option_rows_grad` gives the rows and their gradient in the logits in closed
form in one pass (no autograd graph per chunk): what :func:`fedfast.ops.linear_distill` runs per chunk.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _backend, _validate
from ._rows import valid_rows
from .distill import _reduce

TEACHER_VOCAB = ("drop", "pad")


def check_options(
    jsd_beta, label_smoothing, class_weight, softcap, teacher_softcap, teacher_vocab
) -> tuple[float, float, float, float, str | None]:
    """The options checked by name: ``(jsd_beta, label_smoothing, softcap, teacher_softcap, teacher_vocab)`` with a
    cap of 0.0 meaning none."""
    beta = _validate.real("jsd_beta", jsd_beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(
            f"jsd_beta: the generalised JSD's beta lies in [0, 1] (0 forward KL, 1 reverse KL), got {beta}"
        )
    eps = _validate.real("label_smoothing", label_smoothing)
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"label_smoothing: lies in [0, 1], got {eps}")
    caps = []
    for name, c in (("softcap", softcap), ("teacher_softcap", teacher_softcap)):
        if c is None:
            caps.append(0.0)
            continue
        c = _validate.real(name, c)
        if not c > 0:
            raise ValueError(f"{name}: a positive cap (logits become cap * tanh(logits / cap)) or None, got {c}")
        caps.append(c)
    if class_weight is not None and (
        not isinstance(class_weight, Tensor) or class_weight.dim() != 1 or not class_weight.is_floating_point()
    ):
        raise ValueError(
            "class_weight: a floating [V] tensor of per-class weights on the hard term (F.cross_entropy's weight), "
            f"got {tuple(class_weight.shape) if isinstance(class_weight, Tensor) else type(class_weight).__name__}"
        )
    if teacher_vocab is not None and teacher_vocab not in TEACHER_VOCAB:
        raise ValueError(f"teacher_vocab: one of {TEACHER_VOCAB} or None, got {teacher_vocab!r}")
    return beta, eps, caps[0], caps[1], teacher_vocab


def check_class_weight(class_weight: Tensor | None, V: int, dev, mode: str) -> Tensor | None:
    """``class_weight`` of shape [V] on the logits' device, finite and >= 0 (checked as the mode says)."""
    if class_weight is None:
        return None
    if tuple(class_weight.shape) != (V,):
        raise ValueError(
            f"class_weight: expected shape ({V},) (one weight per student class), got {tuple(class_weight.shape)}"
        )
    if class_weight.device != dev:
        raise ValueError(f"class_weight: on {class_weight.device}, the logits are on {dev}")
    bad = ~(torch.isfinite(class_weight) & (class_weight >= 0)).all()
    return _validate.guard(class_weight, "class_weight", bad, "class weights must be finite and >= 0", mode)


def check_teacher_vocab(V: int, Vt: int, teacher_vocab: str | None, name: str = "teacher") -> None:
    if Vt < V:
        raise ValueError(f"{name}: expected the student's {V} classes (or more, with teacher_vocab), got {Vt}")
    if Vt > V and teacher_vocab is None:
        raise ValueError(
            f"{name}: {Vt} classes against the student's {V}. For a teacher vocabulary padded past the student's, "
            "pass teacher_vocab='drop' (its extra columns dropped before its softmax) or 'pad' (Liger-Kernel's rule: "
            "the student's logits padded with zeros)"
        )


def option_scales(
    target: Tensor,
    V: int,
    ignore_index: int,
    segments: Tensor | None,
    limit: int,
    class_weight: Tensor | None,
    mean: bool,
    acc,
) -> Tensor:
    """Each row's reduction weights ``[2, R]`` (hard, soft): for a mean, ``1 / sum w_y`` over the rows of the row's
    segment for the hard term (the hard rows carry their own ``w_y``) and ``1 / n`` for the soft one; 1 otherwise; 0
    on rows without a class (``ignore_index``, or out of range where checks are off). Tensor ops, no host sync."""
    R, dev = target.shape[0], target.device
    valid = valid_rows(target, V, ignore_index)
    vf = valid.to(acc)
    if not mean:
        return torch.stack([vf, vf])
    wy = vf if class_weight is None else torch.where(valid, class_weight.to(acc)[target.clamp(0, V - 1)], 0.0)
    num = torch.stack([wy, vf])
    if segments is None:
        den = num.sum(1, keepdim=True).expand(2, R)
    else:
        # segment ids lie in [0, limit) (num_segments, else R): sums over that many slots, no host sync
        seg = segments.long().clamp(0, max(limit, 1) - 1)
        den = torch.zeros(2, max(limit, 1), dtype=acc, device=dev).index_add(1, seg, num)[:, seg]
    # a segment of ignored rows (or of zero-weight labels) contributes nothing (F.cross_entropy gives NaN there)
    return torch.where(valid, 1.0 / torch.where(den > 0, den, 1.0), 0.0)


def _not_true_index(y: Tensor, C: int) -> Tensor:
    """[n, C-1] column indices of each row's classes other than ``y``."""
    k = torch.arange(C - 1, device=y.device)
    return k + (k[None, :] >= y[:, None]).to(k.dtype)


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(1)`` without the product's temporary (a batched dot)."""
    return torch.einsum("ij,ij->i", a, b)


def _cap(x: Tensor, c: float) -> Tensor:
    return x if not c else c * torch.tanh(x / c)


def divergence_reference(logP: Tensor, logQ: Tensor, beta: float) -> Tensor:
    """D_beta per row from log-probabilities ``logP`` (teacher) and ``logQ`` (student), in PyTorch ops (xlogy: a
    teacher probability of 0 adds 0)."""
    P, Q = logP.exp(), logQ.exp()
    if beta == 0.0:
        return (torch.special.xlogy(P, P) - P * logQ).sum(-1)
    if beta == 1.0:
        return (Q * (logQ - logP)).sum(-1)
    logM = torch.logsumexp(torch.stack([logQ + math.log(1 - beta), logP + math.log(beta)]), dim=0)
    return beta * (torch.special.xlogy(P, P) - P * logM).sum(-1) + (1 - beta) * (Q * (logQ - logM)).sum(-1)


def option_rows(
    student: Tensor,
    teacher: Tensor,
    target: Tensor,
    *,
    tau: float,
    not_true: bool = False,
    ignore_index: int = -100,
    class_weight: Tensor | None = None,
    jsd_beta: float = 0.0,
    label_smoothing: float = 0.0,
    softcap: float = 0.0,
    teacher_softcap: float = 0.0,
    teacher_vocab: str | None = None,
) -> tuple[Tensor, Tensor]:
    """``(hard [R], soft [R])`` of the module's formula in PyTorch ops (``F.cross_entropy`` for the hard term),
    differentiable in both logits to any order; 0 on ignored (or out-of-range) rows. fp32 (float64 for float64
    logits)."""
    acc = torch.float64 if student.dtype == torch.float64 else torch.float32
    R, V = student.shape
    valid = valid_rows(target, V, ignore_index)
    y = torch.where(valid, target, 0).long()
    u = _cap(student.to(acc), softcap)
    t = _cap(teacher.to(acc), teacher_softcap)
    cw = None if class_weight is None else class_weight.to(acc)
    hard = F.cross_entropy(u, y, weight=cw, label_smoothing=label_smoothing, reduction="none")
    s, r = u / tau, t / tau
    if t.shape[-1] > V:
        if teacher_vocab == "pad":
            s = torch.cat([s, s.new_zeros(R, t.shape[-1] - V)], dim=1)
        else:
            r = r[:, :V]
    if not_true:
        idx = _not_true_index(y, s.shape[1])
        s, r = s.gather(1, idx), r.gather(1, idx)
    soft = divergence_reference(torch.log_softmax(r, 1), torch.log_softmax(s, 1), jsd_beta)
    zero = hard.new_zeros(())
    return torch.where(valid, hard, zero), torch.where(valid, soft, zero)


def _hard_rows(u: Tensor, yc: Tensor, eps: float, w: Tensor | None) -> tuple:
    """``(log p, p, w_y, hard [n])`` of the capped logits ``u``: the (class-weighted, label-smoothed) cross-entropy
    rows, unscaled and not yet masked."""
    V = u.shape[1]
    logp = torch.log_softmax(u, 1)
    p = logp.exp()
    wy = 1.0 if w is None else w[yc[:, 0]]
    hard = -(1 - eps) * wy * logp.gather(1, yc)[:, 0]
    if eps:
        hard = hard - (eps / V) * ((logp * w).sum(1) if w is not None else logp.sum(1))
    return logp, p, wy, hard


def _soft_rows(u, logp, p, tf, yc, *, tau: float, not_true: bool, teacher_vocab, beta: float, need_grad: bool):
    """``(soft [n], dD/ds or None, its factor, the not-true columns or None, whether the student was padded to the
    teacher's vocabulary, the columns C)``: the divergence rows between the student's ``u / tau`` and the teacher's
    ``tf / tau`` (forward KL, reverse KL or JSD(beta)); chunk-sized temporaries freed as soon as they are spent
    (peak: about six)."""
    n, V = u.shape
    acc = u.dtype
    Vt = tf.shape[1]
    pad = Vt > V and teacher_vocab == "pad"
    r = tf[:, :V] if Vt > V and not pad else tf
    s = u if tau == 1.0 else u / tau
    if tau != 1.0:
        r = r / tau
    if pad:
        s = torch.cat([s, s.new_zeros(n, Vt - V)], dim=1)
    C = s.shape[1]
    idx = _not_true_index(yc[:, 0], C) if not_true else None
    if idx is not None:
        s, r = s.gather(1, idx), r.gather(1, idx)
    logQ = logp if s is u else torch.log_softmax(s, 1)  # tau 1, every class: the hard term's log-softmax
    del s
    logP = torch.log_softmax(r, 1)
    del r, tf
    Q, P = (p if logQ is logp else logQ.exp()), logP.exp()
    if beta != 1.0:
        # a teacher probability of 0 (logit -inf) adds 0 to P log(P / .): log P clamped to the dtype's floor
        logP.clamp_min_(torch.finfo(acc).min)
    if beta == 0.0:
        soft = _rowdot(P, logP) - _rowdot(P, logQ)
        gs = torch.sub(Q, P, out=logP) if need_grad else None
        return soft, gs, 1.0, idx, pad, C
    if beta == 1.0:
        d = logQ - logP
        soft = _rowdot(Q, d)
        gs = d.sub_(soft[:, None]).mul_(Q) if need_grad else None
        return soft, gs, 1.0, idx, pad, C
    # log M from M = (1 - beta) Q + beta P (one lerp; floored at the smallest normal, where both terms vanish)
    logM = torch.lerp(Q, P, beta).clamp_min_(torch.finfo(acc).tiny).log_()
    kl_p = _rowdot(P, logP) - _rowdot(P, logM)
    del logP, P
    d = torch.sub(logQ, logM, out=logM)
    kl_q = _rowdot(Q, d)
    soft = beta * kl_p + (1 - beta) * kl_q
    gs = d.sub_(kl_q[:, None]).mul_(Q) if need_grad else None
    return soft, gs, 1 - beta, idx, pad, C


def option_rows_grad(
    z: Tensor,
    t: Tensor,
    y: Tensor,
    scale: Tensor,
    *,
    tau: float,
    ce_weight: float,
    kd_weight: float,
    not_true: bool,
    ignore_index: int,
    class_weight: Tensor | None,
    jsd_beta: float,
    label_smoothing: float,
    softcap: float,
    teacher_softcap: float,
    teacher_vocab: str | None,
    need_grad: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The rows ``(hard [n], soft [n])`` unscaled, and the gradient ``[n, V]`` (in ``z``'s dtype) of
    ``sum_i ce_weight scale[0, i] hard_i + kd_weight scale[1, i] soft_i`` in closed form:

    * hard: ``dH/du = (sum_c q_c) p - q`` with ``q = (1 - eps) w_y onehot(y) + (eps / V) w``;
    * forward KL: ``dD/ds = Q - P``; reverse KL: ``Q (log Q - log P - D)``; JSD(beta): ``dD/dQ_c = (1 - beta)
      (log Q_c - log M_c)``, so ``dD/ds = (1 - beta) Q (log Q - log M - KL(Q || M))``; ``s = u / tau``;
    * the cap: ``du/dz = 1 - tanh(z / cap)^2``.

    Rows labelled ``ignore_index`` (or out of range) give 0 and no gradient (a NaN in them stays out)."""
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    n, V = z.shape
    valid = valid_rows(y, V, ignore_index)  # (an out-of-range label where checks are off: ignored, as the kernels do)
    yc = torch.where(valid, y, 0).long()[:, None]
    zf = z.to(acc)
    if softcap:
        th = torch.tanh(zf / softcap)
        u = softcap * th
    else:
        u = zf
    eps = label_smoothing
    w = None if class_weight is None else class_weight.to(acc)
    logp, p, wy, hard = _hard_rows(u, yc, eps, w)
    tf = _cap(t.to(acc), teacher_softcap)
    soft, gs, gscale, idx, pad, C = _soft_rows(
        u, logp, p, tf, yc, tau=tau, not_true=not_true, teacher_vocab=teacher_vocab, beta=jsd_beta, need_grad=need_grad
    )
    del tf
    zero = hard.new_zeros(())
    hard, soft = torch.where(valid, hard, zero), torch.where(valid, soft, zero)
    if not need_grad:
        return hard, soft, None
    sh = scale[0].to(acc)[:, None] * ce_weight
    ss = scale[1].to(acc)[:, None] * (kd_weight * gscale / tau)
    if idx is not None:
        gs = torch.zeros(n, C, dtype=acc, device=z.device).scatter(1, idx, gs)
    if pad:
        gs = gs[:, :V]
    gs = gs.mul_(ss)
    if eps:  # q = (1 - eps) w_y onehot(y) + (eps / V) w; dH/du = (sum q) p - q
        q = (1 - eps) * torch.zeros_like(u).scatter(1, yc, 1.0 if w is None else wy[:, None])
        q = q + (eps / V) * (w[None, :] if w is not None else 1.0)
        g = gs.addcmul_(q.sum(1, keepdim=True) * sh, p).sub_(q.mul_(sh))
        del q
    else:  # q = w_y onehot(y): w_y (p - onehot)
        a = sh * (wy[:, None] if w is not None else 1.0)
        g = gs.addcmul_(p, a).scatter_add_(1, yc, -a.expand(n, 1))
    del p, logp
    if softcap:
        g = g.mul_((th * th).neg_().add_(1.0))
    g = g.masked_fill_(~valid[:, None], 0.0)
    return hard, soft, g.to(z.dtype)


class DistillTerms(NamedTuple):
    """A loss with its hard and soft terms apart (``return_terms=True``): ``loss = ce_weight * ce + kd_weight * kd``,
    each reduced as the loss is; ``ce`` and ``kd`` are values (no gradient flows through them)."""

    loss: Tensor
    ce: Tensor
    kd: Tensor


def distill_with_options(
    student: Tensor,
    teacher: Tensor,
    target: Tensor,
    *,
    tau: float,
    ce_weight: float,
    kd_weight: float,
    not_true: bool,
    reduction: str,
    ignore_index: int,
    segments: Tensor | None,
    num_segments: int | None,
    backend: str | None,
    validate: str | None,
    detach_teacher: bool,
    jsd_beta: float = 0.0,
    label_smoothing: float = 0.0,
    class_weight: Tensor | None = None,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    teacher_vocab: str | None = None,
    return_terms: bool = False,
):
    """The plain losses (:class:`fedfast.nn.KDLoss`, :class:`fedfast.nn.NTDLoss`) with the options: the formula of
    :func:`option_rows` under autograd (any order of derivative; the teacher learns with ``detach_teacher=False``),
    reduced as :func:`fedfast.ops.distill` reduces; a :class:`DistillTerms` with ``return_terms``."""
    beta, eps, cap, tcap, teacher_vocab = check_options(
        jsd_beta, label_smoothing, class_weight, softcap, teacher_softcap, teacher_vocab
    )
    _validate.check_logits("student", student)
    _validate.check_logits("teacher", teacher)
    R, V = student.shape
    if V < 2:
        raise ValueError(f"student: needs at least 2 classes, got C={V}")
    if teacher.shape[0] != R:
        raise ValueError(f"teacher: expected [{R}, {V}] to match student, got {tuple(teacher.shape)}")
    check_teacher_vocab(V, teacher.shape[1], teacher_vocab)
    if backend not in (None, "reference"):
        raise ValueError(
            f"backend: {backend!r} is a fused kernel of the papers' loss; the options jsd_beta, label_smoothing, "
            "class_weight, softcap, teacher_softcap, teacher_vocab and return_terms are computed by PyTorch's "
            "formulas (leave backend unset, or 'reference')"
        )
    dev = student.device
    mode = _validate.mode_for(dev, validate)
    if _backend.functorch_wrapped(target, segments):
        mode = "off"  # a batched (vmapped) label cannot be checked on the host
    if not isinstance(target, Tensor) or tuple(target.shape) != (R,):
        raise ValueError(f"target: expected shape ({R},), got {getattr(target, 'shape', type(target).__name__)}")
    _validate.check_target(target, R, V, ignore_index, dev, mode)
    if segments is not None:
        _validate.check_segments(segments, R, dev, mode, num_segments)
    target, segments = _validate.in_graph(target, segments, V, ignore_index, num_segments, mode)
    class_weight = check_class_weight(class_weight, V, dev, mode)
    acc = torch.float64 if student.dtype == torch.float64 else torch.float32
    hard, soft = option_rows(
        student,
        teacher.detach() if detach_teacher else teacher,
        target,
        tau=tau,
        not_true=not_true,
        ignore_index=ignore_index,
        class_weight=class_weight,
        jsd_beta=beta,
        label_smoothing=eps,
        softcap=cap,
        teacher_softcap=tcap,
        teacher_vocab=teacher_vocab,
    )
    limit = num_segments if num_segments is not None else R
    sc = option_scales(target, V, ignore_index, segments, limit, class_weight, reduction in ("mean", "segment"), acc)
    ce, kd = sc[0] * hard, sc[1] * soft
    loss = _reduce(ce_weight * ce + kd_weight * kd, reduction, segments, num_segments)
    if not return_terms:
        return loss
    with torch.no_grad():
        return DistillTerms(
            loss, _reduce(ce, reduction, segments, num_segments), _reduce(kd, reduction, segments, num_segments)
        )


__all__ = [
    "divergence_reference",
    "option_rows",
    "option_rows_grad",
    "option_scales",
    "check_options",
    "distill_with_options",
    "DistillTerms",
    "TEACHER_VOCAB",
]
