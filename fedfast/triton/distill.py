"""Triton kernel of the fused CE + distillation row op (forward writes loss and gradient together).

Formula and papers: :mod:`fedfast.ops.distill_reference`. Each program owns BLOCK_R rows; columns are
walked in BLOCK_C chunks: pass 1 keeps online (max, sum-exp) statistics of z, z/tau and t/tau (masked
at y for not-true), pass 2 writes ``dL/dz`` and accumulates the loss terms. When C fits one chunk
(``SINGLE``) the tile is loaded once and stays in registers.
Bytes moved: R*C*(s + t + g) + 12R (s, t, g: element sizes of student, teacher, gradient).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NEG_INF = float("-inf")


@triton.jit
def _row_targets(y_ptr, seg_ptr, rows, rmask, C, S, ignore_index, HAS_SEG: tl.constexpr):
    """Labels of BLOCK_R rows (0 where ignored/out of range), their validity, and segment ids clamped to [0, S)."""
    y = tl.load(y_ptr + rows, mask=rmask, other=ignore_index).to(tl.int64)
    valid = rmask & (y != ignore_index) & (y >= 0) & (y < C)
    seg = tl.zeros_like(y)
    if HAS_SEG:
        seg = tl.load(seg_ptr + rows, mask=rmask, other=0).to(tl.int64)
        seg = tl.minimum(tl.maximum(seg, 0), S - 1)
    return tl.where(valid, y, 0), valid, seg


@triton.jit
def _online(m, s, x):
    """Merge a [BR, BC] tile x into running (max m, sum-exp s); safe for all -inf."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
    return m_new, s


@triton.jit
def _load(z_ptr, t_ptr, rows, cols, C, rmask, y, inv_tau, NOT_TRUE: tl.constexpr, PROB: tl.constexpr):
    cm = cols < C
    m2 = rmask[:, None] & cm[None, :]
    offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    z = tl.load(z_ptr + offs, mask=m2, other=float("-inf")).to(tl.float32)
    t = tl.load(t_ptr + offs, mask=m2, other=0.0 if PROB else float("-inf")).to(tl.float32)
    is_y = cols[None, :] == y[:, None]
    zq = z * inv_tau
    if PROB:
        tt = t
        if NOT_TRUE:
            tt = tl.where(is_y, 0.0, tt)
    else:
        tt = t * inv_tau
        if NOT_TRUE:
            tt = tl.where(is_y, float("-inf"), tt)
    if NOT_TRUE:
        zq = tl.where(is_y, float("-inf"), zq)
    return z, zq, tt, is_y, m2, offs


@triton.jit
def _load_rho(rho_ptr, l1p_ptr, seg, cols, C, m2, like, RHO: tl.constexpr):
    """FedADC+ confidences rho_c and log(1 - rho_c) of each row's segment (zeros when unused)."""
    rho = like * 0.0
    l1p = like * 0.0
    if RHO:
        roffs = seg[:, None] * C + cols[None, :]
        rho = tl.load(rho_ptr + roffs, mask=m2, other=0.0)
        l1p = tl.load(l1p_ptr + roffs, mask=m2, other=0.0)
    return rho, l1p


@triton.jit
def _nonfinite(x):
    """Per row of a tile: how many entries are NaN or +inf (-inf is a valid, excluded class)."""
    return tl.sum(((x != x) | (x == float("inf"))).to(tl.float32), axis=1)


@triton.jit
def _expm1(x):
    """expm1(x) for x <= 0: the Taylor series to x^7 where x > -1/4 (truncation < 4e-10, below an fp32 ulp of the
    result), exp(x) - 1 elsewhere (no cancellation there); -1 at -inf, NaN for NaN."""
    p = x * (1.0 + x * (0.5 + x * (1.0 / 6 + x * (1.0 / 24 + x * (1.0 / 120 + x * (1.0 / 720 + x * (1.0 / 5040)))))))
    return tl.where(x > -0.25, p, tl.exp(x) - 1.0)


@triton.jit
def _log1p(u):
    """log(1 + u) to a few ulp for small u (the classic log(w) * u / (w - 1), w = 1 + u)."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))


@triton.jit
def _expm1_merge(d, m_old, m_new, x, m2, n_old):
    """Running ``sum expm1(x - m)`` over a row's columns seen so far (``n_old`` of them before this tile), moved to
    the new maximum: ``d (1 + e) + n_old e`` with ``e = expm1(m_old - m_new)``; then this tile's valid columns."""
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    e = tl.where(m_old == float("-inf"), -1.0, _expm1(m_old - m_safe)).to(tl.float64)
    d = d + d * e + n_old * e
    return d + tl.sum(tl.where(m2, _expm1(x - m_safe[:, None]), 0.0).to(tl.float64), axis=1)


@triton.jit
def _stats(
    z,
    zq,
    tt,
    is_y,
    rho,
    m2,
    c0,
    m1,
    s1,
    mq,
    sq,
    mt,
    st,
    W,
    mv,
    zy,
    ty,
    nb,
    eq,
    et,
    PROB: tl.constexpr,
    RHO: tl.constexpr,
    KL: tl.constexpr,
):
    # KL: eq, et are the sums of expm1(zq - mq) and expm1(tt - mt), for the KL's row constant log(st / sq) =
    # log1p((et - eq) / (C + eq)) (distill_reference._log_ratio: near-uniform rows at a large tau keep their digits).
    if KL:  # first, with the tile's maxima taken here again: held across the stats below, the old maxima spill (sm_90)
        eq = _expm1_merge(eq, mq, tl.maximum(mq, tl.max(zq, axis=1)), zq, m2, c0)
        et = _expm1_merge(et, mt, tl.maximum(mt, tl.max(tt, axis=1)), tt, m2, c0)
    # nb counts the row's NaN and +inf logits (student, and teacher in the classes read): the row's loss and gradient
    # are NaN then, as IEEE arithmetic gives the formula (distill_reference), whatever the GPU's max does with NaN.
    nb += _nonfinite(z) + _nonfinite(tt)
    m1, s1 = _online(m1, s1, z)
    mq, sq = _online(mq, sq, zq)
    zy += tl.sum(tl.where(is_y, z, 0.0), axis=1)
    if PROB:
        W += tl.sum(tt, axis=1)
        ty += tl.sum(tl.where(is_y, tt, 0.0), axis=1)
    else:
        ty += tl.sum(tl.where(is_y, tt, 0.0), axis=1)
        m_new = tl.maximum(mt, tl.max(tt, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp(mt - m_safe)
        e = tl.exp(tt - m_safe[:, None])
        st = st * scale + tl.sum(e, axis=1)
        if RHO:
            mv = mv * scale + tl.sum(tl.where(is_y, 0.0, rho * e), axis=1)
        mt = m_new
    return m1, s1, mq, sq, mt, st, W, mv, zy, ty, nb, eq, et


@triton.jit
def _emit(
    g_ptr,
    offs,
    m2,
    z,
    zq,
    tt,
    is_y,
    rho,
    l1p,
    m1,
    inv_s1,
    mq,
    lsq,
    inv_sq,
    mt,
    inv_st,
    W,
    Py,
    a,
    kb,
    valid,
    bad,
    K,
    cross,
    PROB: tl.constexpr,
    RHO: tl.constexpr,
    KL: tl.constexpr,
):
    # log q = (zq - mq) - log(sq), q = exp(zq - mq) / sq: never form mq + log(sq) (digits lost at |z| ~ 1e4)
    m1s = tl.where(m1 == float("-inf"), 0.0, m1)
    mqs = tl.where(mq == float("-inf"), 0.0, mq)
    logq = (zq - mqs[:, None]) - lsq[:, None]
    q = tl.exp(zq - mqs[:, None]) * inv_sq[:, None]
    sm = tl.exp(z - m1s[:, None]) * inv_s1[:, None]
    if PROB:
        P = tt
    else:
        mts = tl.where(mt == float("-inf"), 0.0, mt)
        p = tl.exp(tt - mts[:, None]) * inv_st[:, None]
        if RHO:  # FedADC+ target: (1 - rho_c) p_c off the true class, P_y = p_y + moved mass on it
            P = tl.where(is_y, Py[:, None], (1.0 - rho) * p)
        else:
            P = p
    pos = P > 0
    if KL:  # KL(P || q) = sum_c P_c (log P_c - log q_c), the log ratio formed before the sum: into `cross`
        lr = ((tt - mts[:, None]) - (zq - mqs[:, None])) - K[:, None]
        if RHO:  # log P = log(1 - rho_c) + log p_c off the true class, log P_y at it
            lr = tl.where(is_y, tl.log(tl.maximum(Py, 1.2e-38))[:, None] - logq, l1p + lr)
        cross += tl.sum(tl.where(pos, P * tl.where(pos, lr, 0.0), 0.0), axis=1)
    else:
        cross += tl.sum(tl.where(pos, -P * tl.where(pos, logq, 0.0), 0.0), axis=1)
    g = a[:, None] * (sm - tl.where(is_y, 1.0, 0.0)) + kb[:, None] * (W[:, None] * q - P)
    g = tl.where(valid[:, None], tl.where(bad[:, None], float("nan"), g), 0.0)
    tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty), mask=m2)
    return cross


@triton.jit
def _distill_kernel(
    z_ptr,
    t_ptr,
    y_ptr,
    neg_ptr,
    alpha_ptr,
    rw_ptr,
    rs_ptr,
    rho_ptr,
    l1p_ptr,
    seg_ptr,
    loss_ptr,
    g_ptr,
    R,
    C,
    S,
    inv_tau,
    ce_w,
    kd_w,
    ignore_index,
    NOT_TRUE: tl.constexpr,
    SOFT_CE: tl.constexpr,
    PROB: tl.constexpr,
    HAS_ALPHA: tl.constexpr,
    HAS_RW: tl.constexpr,
    HAS_RS: tl.constexpr,
    RHO: tl.constexpr,
    HAS_SEG: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    y, valid, seg = _row_targets(y_ptr, seg_ptr, rows, rmask, C, S, ignore_index, HAS_SEG)
    zero = tl.zeros([BLOCK_R], dtype=tl.float32)
    ninf = zero + float("-inf")
    m1, s1, mq, sq, mt, st, W, mv, zy, ty, nb = ninf, zero, ninf, zero, ninf, zero, zero, zero, zero, zero, zero
    eq, et = zero.to(tl.float64), zero.to(tl.float64)  # fp64: fp32 sums of expm1 cost 1e-4 of the KL at tau 1000
    KL: tl.constexpr = (not PROB) and (not SOFT_CE)
    cols0 = tl.arange(0, BLOCK_C)
    if SINGLE:
        z, zq, tt, is_y, m2, offs = _load(z_ptr, t_ptr, rows, cols0, C, rmask, y, inv_tau, NOT_TRUE, PROB)
        rho, l1p = _load_rho(rho_ptr, l1p_ptr, seg, cols0, C, m2, tt, RHO)
        m1, s1, mq, sq, mt, st, W, mv, zy, ty, nb, eq, et = _stats(
            z, zq, tt, is_y, rho, m2, 0.0, m1, s1, mq, sq, mt, st, W, mv, zy, ty, nb, eq, et, PROB, RHO, KL
        )
    else:
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + cols0
            z, zq, tt, is_y, m2, offs = _load(z_ptr, t_ptr, rows, cols, C, rmask, y, inv_tau, NOT_TRUE, PROB)
            rho, _ = _load_rho(rho_ptr, l1p_ptr, seg, cols, C, m2, tt, RHO)
            m1, s1, mq, sq, mt, st, W, mv, zy, ty, nb, eq, et = _stats(
                z, zq, tt, is_y, rho, m2, c0 * 1.0, m1, s1, mq, sq, mt, st, W, mv, zy, ty, nb, eq, et, PROB, RHO, KL
            )
    if not PROB:
        W = zero + 1.0
    bad = nb > 0
    m1s = tl.where(m1 == float("-inf"), 0.0, m1)
    mts = tl.where(mt == float("-inf"), 0.0, mt)
    inv_s1 = 1.0 / s1
    inv_sq = 1.0 / sq
    lsq = tl.log(sq)
    inv_st = tl.where(st > 0, 1.0 / st, 0.0)
    K = _log1p((et - eq) / (C + eq)).to(tl.float32)  # the KL's row constant log(st / sq) (used when KL)
    # true-class target probability P_y
    if NOT_TRUE:
        Py = zero
    elif PROB:
        Py = ty
    else:
        Py = tl.exp(ty - mts) * inv_st
        if RHO:
            Py = Py + mv * inv_st
    a = zero + ce_w
    b = zero + kd_w
    if HAS_ALPHA:
        al = tl.load(alpha_ptr + y, mask=valid, other=0.0)
        a = a * (1.0 - al)
        b = b * al
    if HAS_RW:
        b = b * tl.load(rw_ptr + rows, mask=rmask, other=0.0)
    if HAS_RS:  # reduction weight: scales the loss row and its gradient
        sc = tl.load(rs_ptr + rows, mask=rmask, other=0.0)
        a = a * sc
        b = b * sc
    kb = b * inv_tau
    cross = zero
    if SINGLE:
        cross = _emit(
            g_ptr,
            offs,
            m2,
            z,
            zq,
            tt,
            is_y,
            rho,
            l1p,
            m1,
            inv_s1,
            mq,
            lsq,
            inv_sq,
            mt,
            inv_st,
            W,
            Py,
            a,
            kb,
            valid,
            bad,
            K,
            cross,
            PROB,
            RHO,
            KL,
        )
    else:
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + cols0
            z, zq, tt, is_y, m2, offs = _load(z_ptr, t_ptr, rows, cols, C, rmask, y, inv_tau, NOT_TRUE, PROB)
            rho, l1p = _load_rho(rho_ptr, l1p_ptr, seg, cols, C, m2, tt, RHO)
            cross = _emit(
                g_ptr,
                offs,
                m2,
                z,
                zq,
                tt,
                is_y,
                rho,
                l1p,
                m1,
                inv_s1,
                mq,
                lsq,
                inv_sq,
                mt,
                inv_st,
                W,
                Py,
                a,
                kb,
                valid,
                bad,
                K,
                cross,
                PROB,
                RHO,
                KL,
            )
    ce = (m1s - zy) + tl.log(s1)
    D = cross  # the KL (KL), or the soft cross-entropy (plus a given mixture's negent)
    if PROB and not SOFT_CE:
        D = D + tl.load(neg_ptr + rows, mask=rmask, other=0.0)
    loss = tl.where(valid, tl.where(bad, float("nan"), a * ce + b * D), 0.0)
    tl.store(loss_ptr + rows, loss, mask=rmask)


def launch_config(C: int, elem_budget: int = 512, max_block_c: int = 2048, elems_per_thread: int = 8):
    """(BLOCK_R, BLOCK_C, SINGLE, num_warps) for a row length C: small programs (one row of up to 2048 classes,
    or 512 elements) with 4-8 warps, many of them per SM.

    Measured on an H100 (``benchmarks/gpu_probe.py``, benchmarks/results/nvidia-h100-80gb-hbm3-probe.json, every
    candidate checked against the others): the KD forward at R = 65536, C = 1000 ran at 2329 GB/s with (1, 1024, 4
    warps) against 1091 GB/s with the earlier (2, 1024, 16 warps), 617 against 422 GB/s at C = 100 (4, 128, 4
    against 16, 128, 16) and 1749 against 1571 GB/s at C = 32000 (2048-wide chunks with 8 warps against 4096 with
    16). Registers: ``scripts/triton_sm90_check.py`` compiles every option with these tiles without a spill.
    """
    block_c = min(triton.next_power_of_2(C), max_block_c)
    block_r = max(1, min(64, elem_budget // block_c))
    single = C <= block_c
    num_warps = min(8, max(4, block_r * block_c // (32 * elems_per_thread)))
    return block_r, block_c, single, num_warps


def _refuse_cpu_arguments(student, mix_weights, class_prior, in_place) -> None:
    """The CPU kernel's arguments (the teacher mixture's weights, ASD's class prior, the in-place gradient) and a
    float64 student: refused by name (fedfast.ops.distill mixes the teachers and makes ASD's weights first on a
    GPU)."""
    given = [
        k
        for k, v in (
            ("mix_weights", mix_weights is not None),
            ("class_prior", class_prior is not None),
            ("in_place", bool(in_place)),
        )
        if v
    ]
    if given:
        raise ValueError(
            f"{given[0]}: the CPU kernel's argument; the triton backend takes the teacher mixed and ASD's "
            f"row weights made (fedfast.ops.distill does both)"
        )
    if student.dtype == torch.float64:
        raise TypeError("student: the triton backend computes in fp32; use backend='reference' or 'cpu' for fp64")


def distill_rows_triton(
    student,
    teacher,
    target,
    negent,
    mix_weights,
    class_alpha,
    row_weight,
    class_prior,
    entropy_tau,
    rho,
    segments,
    row_scale,
    tau,
    ce_weight,
    kd_weight,
    ignore_index,
    not_true,
    soft_ce,
    in_place,
    config=None,
):
    """The compiled backends' argument order (``FEDFAST_DISTILL_ROWS``, fedfast.ops.distill); returns (loss [R],
    dL/dz [R, C], 0). ``mix_weights``, ``class_prior`` and ``in_place`` are the CPU kernel's: on a GPU
    fedfast.ops.distill mixes the teachers and computes ASD's weights in ops of their own first, so they are refused
    here. ``config``: (BLOCK_R, BLOCK_C, num_warps) instead of :func:`launch_config`'s (benchmarks/gpu_probe.py)."""
    _refuse_cpu_arguments(student, mix_weights, class_prior, in_place)
    R, C = student.shape
    student, teacher, target = student.contiguous(), teacher.contiguous(), target.contiguous()
    loss = torch.empty(R, dtype=torch.float32, device=student.device)
    grad = torch.empty_like(student)
    if R == 0:
        return loss, grad, 0
    f32 = lambda x: x.to(torch.float32).contiguous() if x is not None else loss  # noqa: E731
    l1p = torch.log1p(-rho.float()).contiguous() if rho is not None else None
    S = rho.shape[0] if rho is not None else 1
    BR, BC, single, nw = launch_config(C)
    if config is not None:
        BR, BC, nw = config
        single = C <= BC
    _distill_kernel[(triton.cdiv(R, BR),)](
        student,
        teacher,
        target,
        f32(negent),
        f32(class_alpha),
        f32(row_weight),
        f32(row_scale),
        f32(rho),
        f32(l1p),
        segments if segments is not None else target,
        loss,
        grad,
        R,
        C,
        S,
        1.0 / tau,
        ce_weight,
        kd_weight,
        ignore_index,
        NOT_TRUE=not_true,
        SOFT_CE=soft_ce,
        PROB=negent is not None,
        HAS_ALPHA=class_alpha is not None,
        HAS_RW=row_weight is not None,
        HAS_RS=row_scale is not None,
        RHO=rho is not None,
        HAS_SEG=(segments is not None and S > 1),
        SINGLE=single,
        BLOCK_R=BR,
        BLOCK_C=BC,
        num_warps=nw,
    )
    return loss, grad, 0


@triton.jit
def _scale_rows_kernel(g_ptr, s_ptr, out_ptr, N, C, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + offs // C, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (g * s).to(out_ptr.dtype.element_ty), mask=m)


def scale_rows_triton(grad, grad_loss):
    """Backward: ``grad_loss[:, None] * grad`` in fp32, stored in grad.dtype. Bytes: 2*R*C*g + 4R."""
    grad = grad.contiguous()
    out = torch.empty_like(grad)
    N = grad.numel()
    if N:
        BLOCK = 4096
        _scale_rows_kernel[(triton.cdiv(N, BLOCK),)](
            grad, grad_loss.contiguous(), out, N, grad.shape[1], BLOCK=BLOCK, num_warps=8
        )
    return out
