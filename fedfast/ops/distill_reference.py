"""Pure-PyTorch reference of the fused distillation row op: the executable spec.

Readable, differentiable (``gradcheck`` runs on it) and float64-capable. Every fast backend
(``cpu``, ``triton``, ``cuda``) is tested against these functions.

Row op (one row ``i`` of student logits ``z``, teacher ``t``, label ``y``, temperature ``tau``)::

    CE_i  = logsumexp(z_i) - z_{i,y}                                  (temperature 1)
    q_i   = softmax(z_i / tau)          over the kept classes K_i
    p_i   = softmax(t_i / tau)          over K_i        (or a given mixture distribution P_i)
    K_i   = all C classes, or the C-1 not-true classes {c != y_i} (FedNTD, Lee et al. 2022, Eq. 11)
    D_i   = sum_{c in K_i} p_ic (log p_ic - log q_ic)                 (KL(p || q), forward, teacher first)
            or, with soft_ce, -sum_c p_ic log q_ic                    (FedCAD Eq. 2, He et al.)
    L_i   = a_i * CE_i + b_i * D_i
    a_i   = ce_weight * (1 - alpha[y_i]) if class_alpha else ce_weight        (FedCAD Eq. 5)
    b_i   = kd_weight * (alpha[y_i] if class_alpha else 1) * (row_weight_i or 1)
    (both a_i and b_i are multiplied by row_scale_i, the reduction weight, when given)
    dL_i/dz_i = a_i (softmax(z_i) - e_y) + (b_i / tau) (W q_i - P_i)  on K_i, 0 off K_i

FedADC+ (Ozfatura et al., Eq. 8-9): with ``rho`` [S, C] the target is
``phat_c = (1 - rho_c) p_c`` for ``c != y`` and ``phat_y = p_y + sum_{c != y} rho_c p_c``.
FedGKD-VOTE (Yao et al., Eq. 5): ``teacher_mixture_reference`` turns M teachers with weights w_m into
``P = sum_m w_m p_m`` and ``negent = sum_m w_m sum_c p_mc log p_mc``; then
``D_i = negent_i - sum_c P_ic log q_ic = sum_m w_m KL(p_m || q)`` and ``W = sum_m w_m``.
Rows whose target is ``ignore_index`` (or out of range) give ``L_i = 0`` and zero gradient.

Non-finite logits follow IEEE arithmetic on these formulas: a NaN or +inf in a row of the student, or of the teacher
in a class of ``K_i``, makes ``L_i`` NaN (softmax of such a row is NaN); -inf teacher entries are classes the teacher
excludes (p = 0, no term), and a teacher row that excludes every class of ``K_i`` adds no KD term (``D_i = 0``).
"""

from __future__ import annotations

import torch


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _valid(target: torch.Tensor, C: int, ignore_index: int) -> torch.Tensor:
    return (target != ignore_index) & (target >= 0) & (target < C)


def _xlogy_safe(p: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """p * logp (or any p * log-ratio) with 0 where p == 0 (so -inf logs give 0, and no NaN gradient through the
    unused product); a NaN p (a row with a NaN or +inf logit) stays NaN."""
    zero = p == 0
    return torch.where(zero, torch.zeros_like(p), p * torch.where(zero, torch.zeros_like(logp), logp))


def _log_softmax_excluding(x: torch.Tensor, dim: int) -> torch.Tensor:
    """log_softmax over the entries that are not -inf; a row (slice) of -inf only, every class excluded, is -inf
    throughout (p = 0: no term), where ``torch.log_softmax`` gives NaN. NaN and +inf entries give NaN, as there."""
    none = (x == float("-inf")).all(dim, keepdim=True)
    return torch.log_softmax(x, dim=dim).masked_fill(none, float("-inf"))


def _seg_rows(table: torch.Tensor, segments: torch.Tensor | None, R: int) -> torch.Tensor:
    """Row s of ``table`` [S, C] (or [C]) for each row i (s = segments[i], or 0 when S == 1)."""
    if table.dim() == 1:
        table = table[None]
    if table.shape[0] == 1 or segments is None:
        return table[:1].expand(R, -1)
    return table[segments.long().clamp(0, table.shape[0] - 1)]


def _onehot(y: torch.Tensor, C: int) -> torch.Tensor:
    """[R, C] bool, True at each row's label: a comparison, not ``F.one_hot`` (which reads the labels' maximum on
    the host: data-dependent, so ``torch.func.vmap`` over per-model labels cannot run it)."""
    return y[:, None] == torch.arange(C, device=y.device)


def _setup(student, target, ignore_index, not_true):
    """Accumulation dtype, student in it, valid rows, safe labels, one-hot and the not-true drop mask."""
    acc = _acc(student)
    C = student.shape[1]
    valid = _valid(target, C, ignore_index)
    y = torch.where(valid, target, torch.zeros_like(target)).long()
    onehot = _onehot(y, C)
    drop = onehot if not_true else torch.zeros_like(onehot)
    return acc, student.to(acc), valid, y, onehot, drop


def _log_ratio(xt: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """``log softmax(xt) - log softmax(xq)`` along dim 1 (entries of -inf excluded), as ``(xt - mt) - (xq - mq) - K``
    with ``K = log(st / sq) = log1p((dt - dq) / (C + dq))``, ``d = sum expm1(x - m)`` summed in float64: at a large
    temperature both rows are near uniform and two separately rounded log-sum-exps cancel in ``p (log p - log q)``
    (fp32 relative error 5e-5 at tau = 100, 5e-3 at tau = 1000, where the authors' ``F.kl_div`` has 1e-5 and 2e-3;
    this form keeps 1e-7 and 1e-6). The maxima are constants of the formula (their gradient cancels exactly)."""
    C = xt.shape[1]

    def shifted(x):
        m = x.amax(1, keepdim=True).detach()
        u = x - m.masked_fill(m == float("-inf"), 0.0)
        return u, torch.expm1(u).to(torch.float64).sum(1, keepdim=True)

    (ut, dt), (uq, dq) = shifted(xt), shifted(xq)
    K = torch.log1p((dt - dq) / (C + dq)).to(xt.dtype)
    return (ut - uq) - K


def _target(teacher, acc, tau, drop, onehot, rho, segments, teacher_negent):
    """Teacher target ``P`` [R, C] and ``log P`` (None for a given mixture distribution)."""
    if teacher_negent is not None:
        return teacher.to(acc).masked_fill(drop, 0.0), None
    logp = _log_softmax_excluding((teacher.to(acc) / tau).masked_fill(drop, float("-inf")), 1)
    p = torch.exp(logp)
    if rho is None:
        return p, logp
    r = _seg_rows(rho.to(acc), segments, p.shape[0]).masked_fill(onehot, 0.0)
    p_y = p.masked_fill(~onehot, 0.0).sum(1, keepdim=True)
    P = torch.where(onehot, p_y + (r * p).sum(1, keepdim=True), (1 - r) * p)  # FedADC+ Eq. 8-9
    return P, torch.where(onehot, torch.log(P), torch.log1p(-r) + logp)


def _weights(acc, R, device, y, ce_weight, kd_weight, class_alpha, row_weight, row_scale):
    """Per-row CE weight ``a`` and KD weight ``b`` [R]."""
    a = torch.full((R,), float(ce_weight), dtype=acc, device=device)
    b = torch.full((R,), float(kd_weight), dtype=acc, device=device)
    if class_alpha is not None:
        al = class_alpha.to(acc)[y]
        a, b = a * (1 - al), b * al
    if row_weight is not None:
        b = b * row_weight.to(acc)
    if row_scale is not None:  # reduction weight s_i: L_i -> s_i L_i
        a, b = a * row_scale.to(acc), b * row_scale.to(acc)
    return a, b


def distill_reference(
    student,
    teacher,
    target,
    *,
    tau=1.0,
    ce_weight=1.0,
    kd_weight=1.0,
    not_true=False,
    soft_ce=False,
    ignore_index=-100,
    class_alpha=None,
    row_weight=None,
    rho=None,
    segments=None,
    teacher_negent=None,
    row_scale=None,
):
    """Per-row loss ``L_i`` [R] (see module docstring). Differentiable in ``student``.

    ``teacher`` is [R, C] logits, or - when ``teacher_negent`` [R] is given - a [R, C] target
    distribution (a VOTE mixture). Computation is in float64 for float64 students, else float32.
    """
    acc, z, valid, y, onehot, drop = _setup(student, target, ignore_index, not_true)
    ce = torch.logsumexp(z, dim=1) - z.gather(1, y[:, None]).squeeze(1)
    logq = torch.log_softmax((z / tau).masked_fill(drop, float("-inf")), dim=1)
    P, logP = _target(teacher, acc, tau, drop, onehot, rho, segments, teacher_negent)
    cross = -_xlogy_safe(P, logq).sum(1)
    if soft_ce:
        D = cross
    elif logP is None:  # a given mixture and its negative entropy (FedGKD-VOTE)
        D = cross + teacher_negent.to(acc)
    else:  # KL(P || q) = sum_c P_c (log P_c - log q_c), the log ratio formed before the sum (see _log_ratio)
        lr = _log_ratio(
            (teacher.to(acc) / tau).masked_fill(drop, float("-inf")), (z / tau).masked_fill(drop, float("-inf"))
        )
        if rho is not None:  # FedADC+: log P_c = log(1 - rho_c) + log p_c off the true class, log P_y at it
            r = _seg_rows(rho.to(acc), segments, z.shape[0])
            lr = torch.where(onehot, logP - logq, torch.log1p(-r) + lr)
        D = _xlogy_safe(P, lr).sum(1)
    a, b = _weights(acc, z.shape[0], z.device, y, ce_weight, kd_weight, class_alpha, row_weight, row_scale)
    return torch.where(valid, a * ce + b * D, torch.zeros_like(ce))


def teacher_mixture_reference(teachers, weights, target, *, tau=1.0, not_true=False, ignore_index=-100):
    """FedGKD-VOTE mixture of M teachers [M, R, C] with weights w [M] (Yao et al., Eq. 5).

    Returns ``P`` [R, C] = sum_m w_m softmax(t_m / tau) (over the not-true classes if ``not_true``) and
    ``negent`` [R] = sum_m w_m sum_c p_mc log p_mc, so that
    ``sum_m w_m KL(p_m || q) = negent - sum_c P_c log q_c``. fp32 (fp64 for fp64 teachers).
    """
    acc = _acc(teachers)
    M, R, C = teachers.shape
    valid = _valid(target, C, ignore_index)
    y = torch.where(valid, target, torch.zeros_like(target)).long()
    drop = (_onehot(y, C) & valid[:, None]) if not_true else torch.zeros(R, C, dtype=torch.bool, device=teachers.device)
    logp = _log_softmax_excluding((teachers.to(acc) / tau).masked_fill(drop, float("-inf")), 2)
    p = torch.exp(logp)
    w = weights.to(acc)[:, None, None]
    P = (w * p).sum(0)
    negent = (w * _xlogy_safe(p, logp)).sum(0).sum(1)
    return P, negent


def asd_weights_reference(teacher, target, class_prior, segments=None, *, entropy_tau=1.0, ignore_index=-100):
    """Un-normalised ASD weights (Yashwanth et al., Eq. 10-11), fp32 [R] (fp64 for fp64 teachers).

    ``alphahat_i = exp(-H(softmax(t_i / entropy_tau))) / prior[s_i, y_i]``, H the entropy (natural log) of
    the full teacher softmax; ``prior`` is [S, C] (row s_i = segments[i]) or [1, C]. 0 for ignored rows.
    """
    acc = _acc(teacher)
    R, C = teacher.shape
    valid = _valid(target, C, ignore_index)
    y = torch.where(valid, target, torch.zeros_like(target)).long()
    logp = _log_softmax_excluding(teacher.to(acc) / entropy_tau, 1)
    H = -_xlogy_safe(torch.exp(logp), logp).sum(1)
    prior = _seg_rows(class_prior.to(acc), segments, R).gather(1, y[:, None]).squeeze(1)
    ahat = torch.exp(-H) / torch.where(valid, prior, torch.ones_like(prior))
    return torch.where(valid, ahat, torch.zeros_like(ahat))


def distill_rows_reference(
    student,
    teacher,
    target,
    *,
    tau=1.0,
    ce_weight=1.0,
    kd_weight=1.0,
    not_true=False,
    soft_ce=False,
    ignore_index=-100,
    class_alpha=None,
    row_weight=None,
    rho=None,
    segments=None,
    teacher_negent=None,
    row_scale=None,
):
    """The ``reference`` backend: ``(L [R], dL_i/dz_i [R, C])`` with the closed-form gradient.

    ``dL_i/dz_i = a_i (softmax(z_i) - e_y) + (b_i / tau) (W_i q_i - P_i)`` with ``W_i = sum_c P_ic``;
    the tests check it against autograd through :func:`distill_reference`.
    """
    with torch.no_grad():
        loss = distill_reference(
            student,
            teacher,
            target,
            tau=tau,
            ce_weight=ce_weight,
            kd_weight=kd_weight,
            not_true=not_true,
            soft_ce=soft_ce,
            ignore_index=ignore_index,
            class_alpha=class_alpha,
            row_weight=row_weight,
            rho=rho,
            segments=segments,
            teacher_negent=teacher_negent,
            row_scale=row_scale,
        )
        acc, z, valid, y, onehot, drop = _setup(student, target, ignore_index, not_true)
        q = torch.softmax((z / tau).masked_fill(drop, float("-inf")), dim=1)
        P, _ = _target(teacher, acc, tau, drop, onehot, rho, segments, teacher_negent)
        W = P.sum(1, keepdim=True)
        a, b = _weights(acc, z.shape[0], z.device, y, ce_weight, kd_weight, class_alpha, row_weight, row_scale)
        g = a[:, None] * (torch.softmax(z, dim=1) - onehot.to(acc)) + (b / tau)[:, None] * (W * q - P)
        g = torch.where(valid[:, None], g, torch.zeros_like(g))
    return loss, g.to(student.dtype)
