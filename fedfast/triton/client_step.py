"""Triton kernels: fused all-client optimizer step, in place (formulas: fedfast/ops/client_step_reference.py).

Grid (n rows x column blocks). With clipping, a first kernel writes per-(row, block) partial squared norms
of the loss gradient; the per-row clip factor is a tiny [n] reduction. Generic terms: loss rows L [n, P], a
correction s_k v + r C_k (v [P], C [n, P]) inside momentum, a step offset o_k u (u [P]) outside it. Bytes: 20*n*P
with momentum (theta r/w, grad r, buffer r/w) + 4*n*P per optional per-row input (L, C).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._io import host_to_device


@triton.jit
def _loss_grad(th_ptr, g_ptrs, a_ptr, lrows_ptr, offs, cols, m, mu, HAS_PROX: tl.constexpr, HAS_LROWS: tl.constexpr):
    g = tl.load(g_ptrs, mask=m, other=0.0).to(tl.float32)
    t = tl.load(th_ptr + offs, mask=m, other=0.0)
    if HAS_PROX:
        g += mu * (t - tl.load(a_ptr + cols, mask=m, other=0.0))
    if HAS_LROWS:
        g += tl.load(lrows_ptr + offs, mask=m, other=0.0)
    return g, t


@triton.jit
def _row_block(
    th_ptr,
    g_ptr,
    a_ptr,
    lrows_ptr,
    clip_ptr,
    act_ptr,
    P,
    mu,
    HAS_PROX: tl.constexpr,
    HAS_LROWS: tl.constexpr,
    CLIP: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """This program's row k and column block: (k, cols, mask, offsets, clipped loss-side gradient, theta)."""
    k = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < P
    if ACT:
        m = m & (tl.load(act_ptr + k) != 0)
    offs = k * P + cols
    g, t = _loss_grad(th_ptr, g_ptr + offs, a_ptr, lrows_ptr, offs, cols, m, mu, HAS_PROX, HAS_LROWS)
    if CLIP:
        g = g * tl.load(clip_ptr + k)
    return k, cols, m, offs, g, t


@triton.jit
def _piece_block(tab_ptr, k, NPC, BLOCK: tl.constexpr):
    """Gradient pieces (autograd's per-parameter gradients, read where they are: no [n, P] concatenation): block
    b = program_id(1) of the block table covers columns ``start ... start + BLOCK`` of piece ``p``, a contiguous
    ``[n, width]`` fp32 tensor at address ``addr[p]``, whose column 0 is column ``offset[p]`` of theta. ``tab``:
    int64 ``[piece of each block | start of each block | width, offset, address of each piece]`` (NPC pieces).
    Returns (theta columns, mask, gradient pointers)."""
    b = tl.program_id(1)
    nb = tl.num_programs(1)
    p = tl.load(tab_ptr + b)
    cin = tl.load(tab_ptr + nb + b) + tl.arange(0, BLOCK)
    w = tl.load(tab_ptr + 2 * nb + p)
    m = cin < w
    cols = tl.load(tab_ptr + 2 * nb + NPC + p) + cin
    gp = tl.load(tab_ptr + 2 * nb + 2 * NPC + p).to(tl.pointer_type(tl.float32))
    return cols, m, gp + k * w + cin


@triton.jit
def _norm_kernel(
    th_ptr,
    g_ptr,
    a_ptr,
    lrows_ptr,
    part_ptr,
    P,
    NB,
    mu,
    tab_ptr,
    NPC,
    HAS_PROX: tl.constexpr,
    HAS_LROWS: tl.constexpr,
    PIECES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    k = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    if PIECES:
        cols, m, gptrs = _piece_block(tab_ptr, k, NPC, BLOCK)
    else:
        cols = b * BLOCK + tl.arange(0, BLOCK)
        m = cols < P
        gptrs = g_ptr + k * P + cols
    g, _ = _loss_grad(th_ptr, gptrs, a_ptr, lrows_ptr, k * P + cols, cols, m, mu, HAS_PROX, HAS_LROWS)
    tl.store(part_ptr + k * NB + b, tl.sum(g * g, axis=0))


@triton.jit
def _delta_part(t, df_ptr, dp_ptr, k, cols, m):
    """This program's sum of ``(theta' - delta_from)^2`` over its columns, to ``part[k, program_id(1)]``."""
    d = tl.where(m, t - tl.load(df_ptr + cols, mask=m, other=0.0), 0.0)
    tl.store(dp_ptr + k * tl.num_programs(1) + tl.program_id(1), tl.sum(d * d, axis=0))


@triton.jit
def _step_kernel(
    th_ptr,
    g_ptr,
    a_ptr,
    lrows_ptr,
    clip_ptr,
    lr_ptr,
    wd_ptr,
    cv_ptr,
    cs_ptr,
    cr_ptr,
    sv_ptr,
    ss_ptr,
    buf_ptr,
    act_ptr,
    df_ptr,
    dp_ptr,
    P,
    mu,
    rcoef,
    mom,
    tab_ptr,
    NPC,
    LR_ROW: tl.constexpr,
    WD_ROW: tl.constexpr,
    HAS_PROX: tl.constexpr,
    HAS_LROWS: tl.constexpr,
    CLIP: tl.constexpr,
    CVEC: tl.constexpr,
    CSCALE: tl.constexpr,
    CROWS: tl.constexpr,
    MOM: tl.constexpr,
    SVEC: tl.constexpr,
    SSCALE: tl.constexpr,
    ACT: tl.constexpr,
    PIECES: tl.constexpr,
    DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if PIECES:
        k = tl.program_id(0).to(tl.int64)
        cols, m, gptrs = _piece_block(tab_ptr, k, NPC, BLOCK)
        if ACT:
            m = m & (tl.load(act_ptr + k) != 0)
        offs = k * P + cols
        g, t = _loss_grad(th_ptr, gptrs, a_ptr, lrows_ptr, offs, cols, m, mu, HAS_PROX, HAS_LROWS)
        if CLIP:
            g = g * tl.load(clip_ptr + k)
    else:
        k, cols, m, offs, g, t = _row_block(
            th_ptr, g_ptr, a_ptr, lrows_ptr, clip_ptr, act_ptr, P, mu, HAS_PROX, HAS_LROWS, CLIP, ACT, BLOCK
        )
    wd = tl.load(wd_ptr + k) if WD_ROW else tl.load(wd_ptr)
    g += wd * t
    if CVEC:  # the correction s_k v + r C_k, summed before it is added
        corr = tl.load(cv_ptr + cols, mask=m, other=0.0)
        if CSCALE:
            corr = tl.load(cs_ptr + k) * corr
        if CROWS:
            corr = corr + rcoef * tl.load(cr_ptr + offs, mask=m, other=0.0)
        g += corr
    elif CROWS:
        g += rcoef * tl.load(cr_ptr + offs, mask=m, other=0.0)
    if MOM:
        g = mom * tl.load(buf_ptr + offs, mask=m, other=0.0) + g
        tl.store(buf_ptr + offs, g, mask=m)
    if SVEC:
        u = tl.load(sv_ptr + cols, mask=m, other=0.0)
        if SSCALE:
            u = u * tl.load(ss_ptr + k)
        g += u
    lr = tl.load(lr_ptr + k) if LR_ROW else tl.load(lr_ptr)
    t = t - lr * g
    tl.store(th_ptr + offs, t, mask=m)
    if DELTA:
        _delta_part(t, df_ptr, dp_ptr, k, cols, m)


def clip_factors(theta, grad, anchor, lrows, prox_mu, max_norm, BLOCK, pieces=None):
    """Per-row clip factors [n] of the loss gradient (``theta`` itself as a dummy pointer without clipping).
    ``anchor`` / ``lrows``: fp32 tensors or ``theta`` as a dummy. ``pieces``: ``(table, number of pieces, number of
    blocks)`` of :func:`piece_table` when ``grad`` is a list of per-parameter gradients."""
    if not max_norm > 0:
        return theta
    n, P = theta.shape
    NB = triton.cdiv(P, BLOCK) if pieces is None else pieces[2]
    part = torch.empty(n, NB, dtype=torch.float32, device=theta.device)
    tab, npc = (theta, 0) if pieces is None else pieces[:2]
    _norm_kernel[(n, NB)](
        theta,
        theta if pieces is not None else grad,
        anchor,
        lrows,
        part,
        P,
        NB,
        float(prox_mu),
        tab,
        npc,
        HAS_PROX=bool(prox_mu),
        HAS_LROWS=lrows is not theta,
        PIECES=pieces is not None,
        BLOCK=BLOCK,
        num_warps=4,
    )
    return torch.clamp(max_norm / (part.sum(1).sqrt() + 1e-6), max=1.0)


_TABLES: dict = {}


def piece_table(pieces, BLOCK: int):
    """The int64 block table of :func:`_piece_block` for these pieces (its static part cached per layout; the
    addresses change with every step), on the pieces' device without a host sync; with the number of pieces and
    of blocks."""
    n = pieces[0].shape[0]
    widths = tuple(g.numel() // n if n else 0 for g in pieces)
    dev = pieces[0].device
    key = (widths, BLOCK)
    if key not in _TABLES:
        blk_piece, blk_start = [], []
        for p, w in enumerate(widths):
            starts = list(range(0, w, BLOCK))
            blk_piece += [p] * len(starts)
            blk_start += starts
        offsets = [sum(widths[:p]) for p in range(len(widths))]
        _TABLES[key] = (blk_piece + blk_start + list(widths) + offsets, len(blk_piece))
    static, nb = _TABLES[key]
    tab = host_to_device(torch.tensor(static + [g.data_ptr() for g in pieces], dtype=torch.int64), dev)
    return tab, len(widths), nb


def delta_parts(theta, delta_from, NB: int):
    """The (``delta_from`` as fp32, the [n, NB] partial sums) the step kernels write (``theta`` twice as dummies
    without ``delta_from``)."""
    if delta_from is None:
        return theta, theta
    return delta_from.float().contiguous(), torch.empty(theta.shape[0], NB, dtype=torch.float32, device=theta.device)


def delta_finish(part, delta_norm, active) -> None:
    """The active rows' ``||theta' - delta_from||`` from the kernel's partial sums (added in float64)."""
    d = part.double().sum(1).sqrt().float()
    delta_norm.copy_(d if active is None else torch.where(active.to(torch.bool), d, delta_norm))


def grad_operand(theta, grad, BLOCK: int) -> tuple:
    """``(the kernel's gradient operand, the pieces' block table or None, what must stay referenced until the
    launches are queued, the column blocks)``: one ``[n, P]`` tensor as it is, or the per-parameter pieces read in
    place through their block table (``theta`` as the operand's placeholder; 0 blocks when no piece has columns)."""
    if isinstance(grad, (list, tuple)):
        grad = [g.contiguous() for g in grad if g.numel()]
        pieces = piece_table(grad, BLOCK) if grad else None
        return theta, pieces, grad, (pieces[2] if pieces else 0)
    return grad.contiguous(), None, None, triton.cdiv(theta.shape[1], BLOCK)


def client_step_triton(
    theta,
    grad,
    lr,
    momentum,
    buf,
    wd,
    prox_mu,
    anchor,
    loss_rows,
    corr_vec,
    corr_vec_scale,
    corr_rows,
    corr_rows_coef,
    step_vec,
    step_vec_scale,
    max_norm,
    active,
    delta_from=None,
    delta_norm=None,
):
    """The compiled backends' argument order (fedfast.ops.client_step). ``grad``: one ``[n, P]`` tensor, or the
    per-parameter fp32 gradients ``[n, *shape]`` (contiguous; read in place through a block table: no
    concatenation, 8 bytes per parameter and client less traffic per step). ``delta_norm`` (written, with
    ``delta_from``): each block's share of the update norm from the values it just stored, n x blocks partials."""
    n, P = theta.shape
    BLOCK = 1024
    f32 = lambda t: t.float().contiguous() if t is not None else theta  # noqa: E731
    grad, pieces, keep, NB = grad_operand(theta, grad, BLOCK)
    if not NB:
        if delta_norm is not None:  # no columns: every distance is 0
            delta_finish(theta.new_zeros(theta.shape[0], 0), delta_norm, active)
        return
    clip = clip_factors(theta, grad, f32(anchor), f32(loss_rows), prox_mu, max_norm, BLOCK, pieces)
    tab, npc = (theta, 0) if pieces is None else pieces[:2]
    dfrom, part = delta_parts(theta, delta_from, NB)
    _step_kernel[(n, NB)](
        theta,
        grad,
        f32(anchor),
        f32(loss_rows),
        clip,
        lr.float().contiguous(),
        wd.float().contiguous(),
        f32(corr_vec),
        f32(corr_vec_scale),
        f32(corr_rows),
        f32(step_vec),
        f32(step_vec_scale),
        buf if buf is not None else theta,
        active.to(torch.int8).contiguous() if active is not None else theta,
        dfrom,
        part,
        P,
        float(prox_mu),
        float(corr_rows_coef),
        float(momentum),
        tab,
        npc,
        LR_ROW=lr.numel() == n and n > 1,
        WD_ROW=wd.numel() == n and n > 1,
        HAS_PROX=bool(prox_mu),
        HAS_LROWS=loss_rows is not None,
        CLIP=max_norm > 0,
        CVEC=corr_vec is not None,
        CSCALE=corr_vec is not None and corr_vec_scale is not None,
        CROWS=corr_rows is not None,
        MOM=buf is not None,
        SVEC=step_vec is not None,
        SSCALE=step_vec is not None and step_vec_scale is not None,
        ACT=active is not None,
        PIECES=pieces is not None,
        DELTA=delta_from is not None,
        BLOCK=BLOCK,
        num_warps=4,
    )
    del keep
    if delta_from is not None:
        delta_finish(part, delta_norm, active)
