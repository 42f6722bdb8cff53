"""Drop-in fused distillation losses (``torch.nn.Module``s), thin wrappers over :func:`fedfast.ops.distill`.

Every module (:class:`LinearKDLoss` included) takes ``reduction="mean"|"sum"|"none"|"segment"``,
``ignore_index=-100``, ``backend=None``
(auto by device, or ``FEDFAST_BACKEND``) and ``validate=None`` (see :mod:`fedfast.ops._validate`), and
every ``forward`` takes ``segments=None`` (an int tensor [R] of sorted client ids: "mean" is taken within
each client's rows and the client means are summed) and ``num_segments=None``. Student logits [R, C]
need grad; fp32, bf16 and fp16 inputs all work, with fp32 accumulation (float64 in float64).

Gradients (every module): ``detach_teacher=True`` (default): the teacher is a fixed target, and no gradient reaches
it even when it requires grad. ``detach_teacher=False``: the teacher receives the gradient of the distillation term
(mutual / online distillation). The default backward is fused and first-order: differentiating its gradient
again (after ``create_graph=True``) raises a RuntimeError saying so. ``double_backward=True``: any order of
derivative. Both non-default options compute the loss with PyTorch's autograd formulas
(:mod:`fedfast.ops.distill_reference`), slower than the fused op; ``torch.jit.trace`` and ``torch.func``
transforms take that path automatically. :class:`LinearKDLoss` (the output layer fused in) refuses both options by
name (its point is never forming the logits); under ``torch.func`` it runs its chunks per model, and
``create_graph=True`` gives it the right first derivative and refuses a second one when taken.

The modules (each formula in its docstring, the authors' flags mapped in docs/kernels.md): :class:`KDLoss`
(Hinton KD; RepDistiller's ``DistillKL`` alone with ``ce_weight=0``, no target needed), :class:`NTDLoss` (FedNTD),
:class:`ASDLoss` (ASD's entropy-weighted KD), :class:`GKDLoss` (FedGKD, and FedGKD-VOTE with several teachers),
:class:`CADLoss` (FedCAD), :class:`ADCLoss` (FedADC+), :class:`LinearKDLoss` (any of the KD/NTD forms with the
output layer fused in, for large vocabularies).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import ops
from .ops import _validate
from .ops._rows import class_table
from .ops.distill import _fast_lane
from .ops.distill_options import DistillTerms, check_options, distill_with_options

_OPTION_DOC = """
    Liger-Kernel's options (the formula in :mod:`fedfast.ops.distill_options`): ``jsd_beta`` (the divergence: 0 the
    forward KL of the papers, 1 the reverse KL ``KL(q || p)``, between them the generalised Jensen-Shannon divergence,
    Liger's ``beta``), ``label_smoothing`` and ``class_weight`` [C] on the hard term (``F.cross_entropy``'s: "mean"
    divides it by the summed weights of the rows' labels), ``softcap`` / ``teacher_softcap`` (logits capped to
    ``c * tanh(z / c)``, Gemma 2's), ``teacher_vocab`` ("drop" or "pad": a teacher with more classes than the student,
    refused without it) and ``return_terms=True``: a :class:`~fedfast.ops.distill_options.DistillTerms`
    ``(loss, ce, kd)`` with ``loss = ce_weight * ce + kd_weight * kd`` (``kd`` with the ``s``; the terms are values,
    without gradient). Any of them computes the loss with PyTorch's formulas rather than the fused kernel."""


class _Options:
    """The options above, checked at construction (``class_weight`` a buffer, as ``nn.CrossEntropyLoss``'s)."""

    def _init_options(
        self, jsd_beta, label_smoothing, class_weight, softcap, teacher_softcap, teacher_vocab, return_terms
    ):
        beta, eps, cap, tcap, tv = check_options(
            jsd_beta, label_smoothing, class_weight, softcap, teacher_softcap, teacher_vocab
        )
        if not isinstance(return_terms, bool):
            raise TypeError(f"return_terms: expected True or False, got {return_terms!r}")
        self.jsd_beta, self.label_smoothing = beta, eps
        self.softcap, self.teacher_softcap = cap or None, tcap or None
        self.teacher_vocab, self.return_terms = tv, return_terms
        self.register_buffer("class_weight", class_weight)

    def _options_on(self) -> bool:
        return bool(
            self.jsd_beta
            or self.label_smoothing
            or self.class_weight is not None
            or self.softcap
            or self.teacher_softcap
            or self.teacher_vocab
            or self.return_terms
        )

    def _option_kwargs(self) -> dict:
        return dict(
            jsd_beta=self.jsd_beta,
            label_smoothing=self.label_smoothing,
            class_weight=self.class_weight,
            softcap=self.softcap,
            teacher_softcap=self.teacher_softcap,
            teacher_vocab=self.teacher_vocab,
            return_terms=self.return_terms,
        )

    def _with_options(self, student, teacher, target, not_true, ce_weight, kd_weight, segments, num_segments):
        return distill_with_options(
            student,
            teacher,
            target,
            tau=self.tau,
            ce_weight=ce_weight,
            kd_weight=kd_weight,
            not_true=not_true,
            reduction=self.reduction,
            ignore_index=self.ignore_index,
            segments=segments,
            num_segments=num_segments,
            backend=self.backend,
            validate=self.validate,
            detach_teacher=self.detach_teacher,
            **self._option_kwargs(),
        )

    def _terms(self, out, s: float):
        """``kd`` with the ``s`` of the loss (``loss = ce_weight * ce + kd_weight * kd``)."""
        return DistillTerms(out.loss, out.ce, out.kd * s) if self.return_terms else out

    def _options_repr(self) -> list[str]:
        defaults = (
            ("jsd_beta", 0.0),
            ("label_smoothing", 0.0),
            ("softcap", None),
            ("teacher_softcap", None),
            ("teacher_vocab", None),
            ("return_terms", False),
        )
        out = [f"{k}={getattr(self, k)!r}" for k, d in defaults if getattr(self, k) != d]
        return out + (["class_weight=[...]"] if self.class_weight is not None else [])


class _DistillBase(nn.Module):
    def __init__(
        self,
        tau: float,
        reduction: str,
        ignore_index: int,
        backend: str | None,
        validate: str | None,
        detach_teacher: bool = True,
        double_backward: bool = False,
    ):
        super().__init__()
        tau = _validate.check_tau("tau", tau)
        if reduction not in ("mean", "sum", "none", "segment"):
            raise ValueError(f"reduction: must be 'mean', 'sum', 'none' or 'segment', got {reduction!r}")
        self.tau, self.reduction, self.ignore_index = tau, reduction, int(ignore_index)
        self.backend, self.validate = backend, validate
        for name, v in (("detach_teacher", detach_teacher), ("double_backward", double_backward)):
            if not isinstance(v, bool):
                raise TypeError(f"{name}: expected True or False, got {v!r}")
        self.detach_teacher, self.double_backward = detach_teacher, double_backward

    def _fast(self, student, teacher, target, segments, ce_weight, kd_weight, kind, prior=None, entropy_tau=1.0):
        """The common eager call straight to :func:`fedfast.ops.distill`'s fast lane (None: the general path)."""
        if (
            segments is None
            and self.backend is None
            and self.validate is None
            and self.detach_teacher is True
            and self.double_backward is False
            and (self.reduction == "mean" or self.reduction == "sum")
        ):
            return _fast_lane(
                student,
                teacher,
                target,
                self.tau,
                ce_weight,
                kd_weight,
                kind,
                self.reduction,
                self.ignore_index,
                prior,
                entropy_tau,
            )
        return None

    def _common(self, segments, num_segments):
        return dict(
            tau=self.tau,
            reduction=self.reduction,
            ignore_index=self.ignore_index,
            segments=segments,
            num_segments=num_segments,
            backend=self.backend,
            validate=self.validate,
            detach_teacher=self.detach_teacher,
            double_backward=self.double_backward,
        )

    def extra_repr(self) -> str:
        keys = [
            k
            for k in ("tau", "ce_weight", "kd_weight", "beta", "lam", "gamma", "not_true", "entropy_tau", "tau_squared")
            if hasattr(self, k)
        ]
        extra = [
            f"{k}={getattr(self, k)}"
            for k, d in (("detach_teacher", True), ("double_backward", False))
            if getattr(self, k) != d
        ]
        if isinstance(self, _Options):
            extra += self._options_repr()
        return ", ".join([f"{k}={getattr(self, k)}" for k in keys] + [f"reduction={self.reduction!r}"] + extra)


class KDLoss(_Options, _DistillBase):
    """Hinton KD: ``ce_weight * CE(z, y) + kd_weight * s * KL(softmax(t/tau) || softmax(z/tau))``, ``s = tau^2``
    if ``tau_squared`` else 1 (Hinton et al. 2015; FedNTD Eq. 3 without the (1-beta)). FedGKD with one
    averaged teacher is ``KDLoss(tau=1, kd_weight=gamma/2)``. With ``ce_weight=0`` the target may be omitted:
    ``KDLoss(tau=T, ce_weight=0, kd_weight=1)(z, t)`` is RepDistiller's ``DistillKL(T)(z, t)`` (every row counts).
    """

    def __init__(
        self,
        tau: float = 4.0,
        ce_weight: float = 1.0,
        kd_weight: float = 1.0,
        tau_squared: bool = True,
        reduction: str = "mean",
        ignore_index: int = -100,
        backend=None,
        validate=None,
        detach_teacher: bool = True,
        double_backward: bool = False,
        jsd_beta: float = 0.0,
        label_smoothing: float = 0.0,
        class_weight: Tensor | None = None,
        softcap: float | None = None,
        teacher_softcap: float | None = None,
        teacher_vocab: str | None = None,
        return_terms: bool = False,
    ):
        super().__init__(tau, reduction, ignore_index, backend, validate, detach_teacher, double_backward)
        self.ce_weight, self.kd_weight, self.tau_squared = (
            _validate.real("ce_weight", ce_weight),
            _validate.real("kd_weight", kd_weight),
            bool(tau_squared),
        )
        self._init_options(
            jsd_beta, label_smoothing, class_weight, softcap, teacher_softcap, teacher_vocab, return_terms
        )

    def forward(
        self,
        student: Tensor,
        teacher: Tensor,
        target: Tensor | None = None,
        segments: Tensor | None = None,
        num_segments: int | None = None,
    ) -> Tensor:
        s = self.tau**2 if self.tau_squared else 1.0
        if target is None:  # the KD term alone (DistillKL): every row is a row of the mean
            if self.ce_weight != 0:
                raise ValueError(
                    f"target: KDLoss's cross-entropy (ce_weight={self.ce_weight:g}) needs the labels; "
                    f"without them use ce_weight=0 (the KD term alone, RepDistiller's DistillKL)"
                )
            if not isinstance(student, Tensor) or student.dim() != 2:
                _validate.check_logits("student", student)
            target = torch.zeros(student.shape[0], dtype=torch.long, device=student.device)
        if self._options_on():
            return self._terms(
                self._with_options(
                    student, teacher, target, False, self.ce_weight, self.kd_weight * s, segments, num_segments
                ),
                s,
            )
        out = self._fast(student, teacher, target, segments, self.ce_weight, self.kd_weight * s, "full")
        if out is not None:
            return out
        return ops.distill(
            student,
            teacher,
            target,
            kind="full",
            ce_weight=self.ce_weight,
            kd_weight=self.kd_weight * s,
            **self._common(segments, num_segments),
        )


class NTDLoss(_Options, _DistillBase):
    """FedNTD (Lee et al. 2022, Eq. 10-11): ``CE(z, y) + beta * s * KL(pt || qt)`` where pt, qt are the
    tau-softmaxes over the C-1 not-true classes (column y removed from teacher and student before the
    softmax), ``s = tau^2`` if ``tau_squared`` (official code HEAD) else 1 (paper). No (1-beta) on CE.
    ``beta`` is FedNTD's weight of the KD term; the divergence's mixing weight is ``jsd_beta``.
    """

    def __init__(
        self,
        tau: float = 1.0,
        beta: float = 1.0,
        tau_squared: bool = True,
        reduction: str = "mean",
        ignore_index: int = -100,
        backend=None,
        validate=None,
        detach_teacher: bool = True,
        double_backward: bool = False,
        jsd_beta: float = 0.0,
        label_smoothing: float = 0.0,
        class_weight: Tensor | None = None,
        softcap: float | None = None,
        teacher_softcap: float | None = None,
        teacher_vocab: str | None = None,
        return_terms: bool = False,
    ):
        super().__init__(tau, reduction, ignore_index, backend, validate, detach_teacher, double_backward)
        self.beta, self.tau_squared = _validate.real("beta", beta), bool(tau_squared)
        self._init_options(
            jsd_beta, label_smoothing, class_weight, softcap, teacher_softcap, teacher_vocab, return_terms
        )

    def forward(
        self,
        student: Tensor,
        teacher: Tensor,
        target: Tensor,
        segments: Tensor | None = None,
        num_segments: int | None = None,
    ) -> Tensor:
        s = self.tau**2 if self.tau_squared else 1.0
        if self._options_on():
            return self._terms(
                self._with_options(student, teacher, target, True, 1.0, self.beta * s, segments, num_segments), s
            )
        out = self._fast(student, teacher, target, segments, 1.0, self.beta * s, "not_true")
        if out is not None:
            return out
        return ops.distill(
            student, teacher, target, kind="not_true", kd_weight=self.beta * s, **self._common(segments, num_segments)
        )


KDLoss.__doc__ += _OPTION_DOC + " ``teacher`` may then be [R, Ct] with Ct > C (``teacher_vocab``).\n"
NTDLoss.__doc__ += _OPTION_DOC + " (NTDLoss's ``ce_weight`` in the identity is 1.)\n"


class ASDLoss(_DistillBase):
    """ASD (Yashwanth et al., Eq. 2-11, official-code scaling): ``CE_mean + lam * sum_i alpha_i KL_i`` with
    ``alpha_i ∝ exp(-H(softmax(t_i/entropy_tau))) / class_prior[y_i]`` normalised to sum 1 within each
    segment (client minibatch). ``entropy_tau=1.0`` (default) is the official code's: the entropy of the plain
    teacher softmax, whatever the KD temperature ``tau``. ``not_true=True`` is FedNTD+ASD (KL over the not-true
    classes; weights from the full teacher softmax). No tau^2 (paper); ``tau_squared=True`` multiplies the KD term
    by tau^2.
    ``class_prior`` is the client's label distribution, [C] or [num_segments, C].

    With ``reduction="none"`` row i returns ``CE_i + lam * n_seg * alpha_i * KL_i`` (its segment mean is
    the paper's loss); "sum" sums those rows."""

    def __init__(
        self,
        tau: float = 2.0,
        lam: float = 10.0,
        not_true: bool = False,
        entropy_tau: float = 1.0,
        tau_squared: bool = False,
        reduction: str = "mean",
        ignore_index: int = -100,
        backend=None,
        validate=None,
        detach_teacher: bool = True,
        double_backward: bool = False,
    ):
        super().__init__(tau, reduction, ignore_index, backend, validate, detach_teacher, double_backward)
        self.lam, self.not_true, self.tau_squared = _validate.real("lam", lam), bool(not_true), bool(tau_squared)
        if entropy_tau is None:
            raise ValueError(
                "entropy_tau: give the temperature of the teacher entropy in the ASD weights (the "
                "official code: 1.0, the default; None used to mean tau)"
            )
        self.entropy_tau = _validate.check_tau("entropy_tau", entropy_tau)

    def forward(
        self,
        student: Tensor,
        teacher: Tensor,
        target: Tensor,
        class_prior,
        segments: Tensor | None = None,
        num_segments: int | None = None,
    ) -> Tensor:
        s = self.tau**2 if self.tau_squared else 1.0
        kind = "not_true" if self.not_true else "full"
        out = self._fast(student, teacher, target, segments, 1.0, self.lam * s, kind, class_prior, self.entropy_tau)
        if out is not None:
            return out
        return ops.distill(
            student,
            teacher,
            target,
            kind="not_true" if self.not_true else "full",
            kd_weight=self.lam * s,
            class_prior=class_prior,
            entropy_tau=self.entropy_tau,
            **self._common(segments, num_segments),
        )


class GKDLoss(_DistillBase):
    """FedGKD (Yao et al., Eq. 3-5): ``CE + (gamma/2) * s * sum_m w_m KL(softmax(t_m/tau) || softmax(z/tau))``.

    ``teachers`` is [R, C] (the parameter-averaged teacher, M=1) or [M, R, C] with ``teacher_weights`` [M]
    (FedGKD-VOTE: pass ``softmax(-M * val_loss)``; default uniform 1/M). ``s = tau^2`` if ``tau_squared``.
    """

    def __init__(
        self,
        tau: float = 1.0,
        gamma: float = 0.2,
        tau_squared: bool = True,
        reduction: str = "mean",
        ignore_index: int = -100,
        backend=None,
        validate=None,
        detach_teacher: bool = True,
        double_backward: bool = False,
    ):
        super().__init__(tau, reduction, ignore_index, backend, validate, detach_teacher, double_backward)
        self.gamma, self.tau_squared = _validate.real("gamma", gamma), bool(tau_squared)

    def forward(
        self,
        student: Tensor,
        teachers: Tensor | None,
        target: Tensor,
        teacher_weights=None,
        segments: Tensor | None = None,
        num_segments: int | None = None,
        mixture=None,
    ) -> Tensor:
        """``mixture``: instead of ``teachers``, the M teachers' mixture ``(P [R, C], negent [R])`` precomputed by
        :func:`fedfast.ops.teacher_mixture` at this ``tau`` (exact in loss and gradient)."""
        s = self.tau**2 if self.tau_squared else 1.0
        if teacher_weights is None and mixture is None:
            out = self._fast(student, teachers, target, segments, 1.0, self.gamma / 2 * s, "full")
            if out is not None:
                return out
        return ops.distill(
            student,
            teachers,
            target,
            kind="full",
            kd_weight=self.gamma / 2 * s,
            teacher_weights=teacher_weights,
            mixture=mixture,
            **self._common(segments, num_segments),
        )


class CADLoss(_DistillBase):
    """FedCAD (He et al., Eq. 2-5): per row ``(1 - a_y) CE(z, y) + a_y * s * softCE(softmax(t/tau), softmax(z/tau))``
    with ``a = class_alpha`` [C] in [0, 1] (server-estimated per-class weights), ``s = tau^2`` if
    ``tau_squared`` (default off, as in the paper). softCE = -sum_c p_c log q_c (= KL + H(p))."""

    def __init__(
        self,
        tau: float = 2.0,
        tau_squared: bool = False,
        reduction: str = "mean",
        ignore_index: int = -100,
        backend=None,
        validate=None,
        detach_teacher: bool = True,
        double_backward: bool = False,
    ):
        super().__init__(tau, reduction, ignore_index, backend, validate, detach_teacher, double_backward)
        self.tau_squared = bool(tau_squared)

    def forward(
        self,
        student: Tensor,
        teacher: Tensor,
        target: Tensor,
        class_alpha,
        segments: Tensor | None = None,
        num_segments: int | None = None,
    ) -> Tensor:
        s = self.tau**2 if self.tau_squared else 1.0
        return ops.distill(
            student,
            teacher,
            target,
            kind="full",
            soft_ce=True,
            kd_weight=s,
            class_alpha=class_alpha,
            **self._common(segments, num_segments),
        )


def confidence_from_freq(class_freq, C: int, device, segments: Tensor | None = None):
    """FedADC+ confidence ``rho_c = gamma_c / max_c gamma_c`` per row of a label histogram [C] or [S, C]."""
    f = class_table("class_freq", class_freq, C, device, segments)
    mx = f.amax(dim=1, keepdim=True)
    return f / mx.clamp_min(torch.finfo(f.dtype).tiny), f, mx


class ADCLoss(_DistillBase):
    """FedADC+ (Ozfatura et al., Eq. 6-9): ``(1 - lam) CE + lam * s * KL(phat || softmax(z/tau))`` with the
    self-confidence target ``phat_c = (1 - rho_c) p_c`` (c != y), ``phat_y = p_y + sum_{c != y} rho_c p_c``,
    ``p = softmax(t/tau)``, ``rho = class_freq / max(class_freq)`` per client; ``s = tau^2`` (CS-KD)."""

    def __init__(
        self,
        tau: float = 4.0,
        lam: float = 0.35,
        tau_squared: bool = True,
        reduction: str = "mean",
        ignore_index: int = -100,
        backend=None,
        validate=None,
        detach_teacher: bool = True,
        double_backward: bool = False,
    ):
        super().__init__(tau, reduction, ignore_index, backend, validate, detach_teacher, double_backward)
        lam = _validate.real("lam", lam)
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam: must lie in [0, 1], got {lam!r}")
        self.lam, self.tau_squared = lam, bool(tau_squared)

    def forward(
        self,
        student: Tensor,
        teacher: Tensor,
        target: Tensor,
        class_freq,
        segments: Tensor | None = None,
        num_segments: int | None = None,
    ) -> Tensor:
        _validate.check_logits("student", student)
        rho, f, mx = confidence_from_freq(class_freq, student.shape[1], student.device, segments)
        mode = _validate.mode_for(student.device, self.validate)
        if mode != "off":
            _validate.check(
                "class_freq",
                ((f < 0) | ~torch.isfinite(f)).any() | ~(mx > 0).all(),
                "label histogram must be finite, >= 0 and not all zero",
                mode,
            )
        s = self.tau**2 if self.tau_squared else 1.0
        return ops.distill(
            student,
            teacher,
            target,
            kind="full",
            ce_weight=1.0 - self.lam,
            kd_weight=self.lam * s,
            rho=rho,
            **self._common(segments, num_segments),
        )


class LinearKDLoss(_Options, nn.Module):
    """The output layer fused with KD (or FedNTD's not-true KD), in row chunks, for large vocabularies:
    ``ce_weight * CE(z, y) + kd_weight * s * KL(softmax(t/tau) || softmax(z/tau))`` with ``z = h @ W.T + b``
    (``s = tau^2`` if ``tau_squared``; ``not_true=True``: the KL over the C-1 not-true classes), without the
    ``[R, V]`` logits or their gradient ever existing whole (:func:`fedfast.ops.linear_distill`).

    ``forward(hidden [..., H], weight [V, H], target [...], teacher_logits=None, *, bias=None, teacher_hidden=None,
    teacher_weight=None, teacher_bias=None, segments=None, num_segments=None)``: the teacher as logits ``[..., V]``,
    or as its hidden states ``[..., Ht]`` and output layer; ``hidden`` may carry any leading dimensions (a language
    model's ``[B, T, H]`` with ``[B, T]`` labels, ``ignore_index`` for padding). Options as the other modules':
    ``reduction`` "mean" | "sum" | "none" | "segment" (with ``segments``: each segment's mean, summed for "mean"),
    ``ignore_index``, ``backend``, ``validate``. Composes with ``torch.compile(fullgraph=True)``, ``torch.export``,
    ``torch.jit.trace``, ``torch.func.grad`` and ``vmap``; no gradient work under ``torch.no_grad()``; the
    weight's gradient is written once (``W.grad`` is the tensor the chunks accumulate into). Two options the other
    modules take are refused by name here: a teacher that receives gradients (``detach_teacher=False``) and second
    derivatives (``double_backward=True``), and forward-mode AD (``torch.func.jvp``) raises a NotImplementedError
    naming it; use the unfused layer with :class:`KDLoss` for those. A weight whose dtype differs from its hidden
    states' (an fp32 head on bf16 states) is cast to theirs, student and teacher alike. Under ``torch.autocast`` it
    computes what ``F.linear`` and the loss compute there (logits in the autocast dtype, the loss in fp32, fp32
    gradients for fp32 parameters). ``chunk_rows``: rows per chunk (default a quarter)."""

    def __init__(
        self,
        tau: float = 4.0,
        ce_weight: float = 1.0,
        kd_weight: float = 1.0,
        tau_squared: bool = True,
        not_true: bool = False,
        reduction: str = "mean",
        ignore_index: int = -100,
        chunk_rows: int | None = None,
        backend=None,
        validate=None,
        detach_teacher: bool = True,
        double_backward: bool = False,
        jsd_beta: float = 0.0,
        label_smoothing: float = 0.0,
        class_weight: Tensor | None = None,
        softcap: float | None = None,
        teacher_softcap: float | None = None,
        teacher_vocab: str | None = None,
        return_terms: bool = False,
    ):
        super().__init__()
        tau = _validate.check_tau("tau", tau)
        if reduction not in ("mean", "sum", "none", "segment"):
            raise ValueError(f"reduction: must be 'mean', 'sum', 'none' or 'segment', got {reduction!r}")
        if chunk_rows is not None and (
            isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1
        ):
            raise ValueError(f"chunk_rows: a positive int or None, got {chunk_rows!r}")
        for name, v in (("detach_teacher", detach_teacher), ("double_backward", double_backward)):
            if not isinstance(v, bool):
                raise TypeError(f"{name}: expected True or False, got {v!r}")
        if not detach_teacher:
            raise ValueError(
                "detach_teacher: LinearKDLoss's teacher is a fixed target (its logits, or its hidden "
                "states and head, get no gradient); for mutual distillation use the unfused layer with "
                "KDLoss(detach_teacher=False)"
            )
        if double_backward:
            raise ValueError(
                "double_backward: LinearKDLoss's fused backward is first-order (its gradients are formed "
                "in the forward); for a second derivative use the unfused layer with "
                "KDLoss(double_backward=True)"
            )
        self.tau, self.ce_weight, self.kd_weight = (
            tau,
            _validate.real("ce_weight", ce_weight),
            _validate.real("kd_weight", kd_weight),
        )
        self.tau_squared, self.not_true, self.reduction = bool(tau_squared), bool(not_true), reduction
        self.ignore_index, self.chunk_rows, self.backend, self.validate = (
            int(ignore_index),
            chunk_rows,
            backend,
            validate,
        )
        self._init_options(
            jsd_beta, label_smoothing, class_weight, softcap, teacher_softcap, teacher_vocab, return_terms
        )

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        target: Tensor,
        teacher_logits: Tensor | None = None,
        *,
        bias: Tensor | None = None,
        teacher_hidden: Tensor | None = None,
        teacher_weight: Tensor | None = None,
        teacher_bias: Tensor | None = None,
        segments: Tensor | None = None,
        num_segments: int | None = None,
    ) -> Tensor:
        s = self.tau**2 if self.tau_squared else 1.0
        out = ops.linear_distill(
            hidden,
            weight,
            target,
            teacher_logits,
            bias=bias,
            teacher_hidden=teacher_hidden,
            teacher_weight=teacher_weight,
            teacher_bias=teacher_bias,
            tau=self.tau,
            ce_weight=self.ce_weight,
            kd_weight=self.kd_weight * s,
            kind="not_true" if self.not_true else "full",
            reduction=self.reduction,
            ignore_index=self.ignore_index,
            segments=segments,
            num_segments=num_segments,
            chunk_rows=self.chunk_rows,
            backend=self.backend,
            validate=self.validate,
            **self._option_kwargs(),
        )
        return self._terms(out, s)

    def extra_repr(self) -> str:
        return ", ".join(
            [
                f"tau={self.tau}, ce_weight={self.ce_weight}, kd_weight={self.kd_weight}, "
                f"tau_squared={self.tau_squared}, not_true={self.not_true}, reduction={self.reduction!r}, "
                f"chunk_rows={self.chunk_rows}"
            ]
            + self._options_repr()
        )


LinearKDLoss.__doc__ += _OPTION_DOC + (
    " Here the teacher's head may have more rows than the student's (``teacher_vocab``); the options' chunks are "
    "computed by closed-form PyTorch rows (:func:`fedfast.ops.distill_options.option_rows_grad`).\n"
)

__all__ = [
    "KDLoss",
    "NTDLoss",
    "ASDLoss",
    "GKDLoss",
    "CADLoss",
    "ADCLoss",
    "LinearKDLoss",
    "DistillTerms",
    "confidence_from_freq",
]
