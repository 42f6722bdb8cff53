"""Triton kernels: fused all-client optimizer step, in place (formulas: fedfast/ops/client_step_reference.py).

Grid (n rows x column blocks). With clipping, a first kernel writes per-(row, block) partial squared norms
of the loss-side gradient; the per-row clip factor is a tiny [n] reduction. Bytes: 20*n*P with momentum
(theta r/w, grad r, buffer r/w) + 4*n*P per optional per-row input (FedDyn, SCAFFOLD c_k).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _loss_grad(th_ptr, g_ptrs, a_ptr, dyn_ptr, offs, cols, m, mu, HAS_PROX: tl.constexpr, HAS_DYN: tl.constexpr):
    g = tl.load(g_ptrs, mask=m, other=0.0).to(tl.float32)
    t = tl.load(th_ptr + offs, mask=m, other=0.0)
    if HAS_PROX:
        g += mu * (t - tl.load(a_ptr + cols, mask=m, other=0.0))
    if HAS_DYN:
        g += tl.load(dyn_ptr + offs, mask=m, other=0.0)
    return g, t


@triton.jit
def _row_block(th_ptr, g_ptr, a_ptr, dyn_ptr, clip_ptr, act_ptr, P, mu, HAS_PROX: tl.constexpr,
               HAS_DYN: tl.constexpr, CLIP: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """This program's row k and column block: (k, cols, mask, offsets, clipped loss-side gradient, theta)."""
    k = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < P
    if ACT:
        m = m & (tl.load(act_ptr + k) != 0)
    offs = k * P + cols
    g, t = _loss_grad(th_ptr, g_ptr + offs, a_ptr, dyn_ptr, offs, cols, m, mu, HAS_PROX, HAS_DYN)
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
def _norm_kernel(th_ptr, g_ptr, a_ptr, dyn_ptr, part_ptr, P, NB, mu, tab_ptr, NPC, HAS_PROX: tl.constexpr,
                 HAS_DYN: tl.constexpr, PIECES: tl.constexpr, BLOCK: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    if PIECES:
        cols, m, gptrs = _piece_block(tab_ptr, k, NPC, BLOCK)
    else:
        cols = b * BLOCK + tl.arange(0, BLOCK)
        m = cols < P
        gptrs = g_ptr + k * P + cols
    g, _ = _loss_grad(th_ptr, gptrs, a_ptr, dyn_ptr, k * P + cols, cols, m, mu, HAS_PROX, HAS_DYN)
    tl.store(part_ptr + k * NB + b, tl.sum(g * g, axis=0))


@triton.jit
def _step_kernel(th_ptr, g_ptr, a_ptr, dyn_ptr, clip_ptr, lr_ptr, wd_ptr, c_ptr, ck_ptr, buf_ptr, dr_ptr, ds_ptr, act_ptr,
                 P, mu,
                 mom, tab_ptr, NPC, LR_ROW: tl.constexpr, WD_ROW: tl.constexpr, HAS_PROX: tl.constexpr,
                 HAS_DYN: tl.constexpr, CLIP: tl.constexpr, SCAF: tl.constexpr, MOM: tl.constexpr, DRIFT: tl.constexpr,
                 DSCALE: tl.constexpr, ACT: tl.constexpr, PIECES: tl.constexpr, BLOCK: tl.constexpr):
    if PIECES:
        k = tl.program_id(0).to(tl.int64)
        cols, m, gptrs = _piece_block(tab_ptr, k, NPC, BLOCK)
        if ACT:
            m = m & (tl.load(act_ptr + k) != 0)
        offs = k * P + cols
        g, t = _loss_grad(th_ptr, gptrs, a_ptr, dyn_ptr, offs, cols, m, mu, HAS_PROX, HAS_DYN)
        if CLIP:
            g = g * tl.load(clip_ptr + k)
    else:
        k, cols, m, offs, g, t = _row_block(th_ptr, g_ptr, a_ptr, dyn_ptr, clip_ptr, act_ptr, P, mu, HAS_PROX,
                                            HAS_DYN, CLIP, ACT, BLOCK)
    wd = tl.load(wd_ptr + k) if WD_ROW else tl.load(wd_ptr)
    g += wd * t
    if SCAF:
        g += tl.load(c_ptr + cols, mask=m, other=0.0) - tl.load(ck_ptr + offs, mask=m, other=0.0)
    if MOM:
        g = mom * tl.load(buf_ptr + offs, mask=m, other=0.0) + g
        tl.store(buf_ptr + offs, g, mask=m)
    if DRIFT:
        d = tl.load(dr_ptr + cols, mask=m, other=0.0)
        if DSCALE:
            d = d * tl.load(ds_ptr + k)
        g += d
    lr = tl.load(lr_ptr + k) if LR_ROW else tl.load(lr_ptr)
    tl.store(th_ptr + offs, t - lr * g, mask=m)


def clip_factors(theta, grad, anchor, dyn, prox_mu, max_norm, BLOCK, pieces=None):
    """Per-row clip factors [n] of the loss-side gradient (``theta`` itself as a dummy pointer without clipping).
    ``anchor`` / ``dyn``: fp32 tensors or ``theta`` as a dummy. ``pieces``: ``(table, number of pieces, number of
    blocks)`` of :func:`piece_table` when ``grad`` is a list of per-parameter gradients."""
    if not max_norm > 0:
        return theta
    n, P = theta.shape
    NB = triton.cdiv(P, BLOCK) if pieces is None else pieces[2]
    part = torch.empty(n, NB, dtype=torch.float32, device=theta.device)
    tab, npc = (theta, 0) if pieces is None else pieces[:2]
    _norm_kernel[(n, NB)](theta, theta if pieces is not None else grad, anchor, dyn, part, P, NB, float(prox_mu), tab,
                          npc, HAS_PROX=bool(prox_mu), HAS_DYN=dyn is not theta, PIECES=pieces is not None,
                          BLOCK=BLOCK, num_warps=4)
    return torch.clamp(max_norm / (part.sum(1).sqrt() + 1e-6), max=1.0)


_TABLES: dict = {}


def piece_table(pieces, BLOCK: int):
    """The int64 block table of :func:`_piece_block` for these pieces (its static part cached per layout; the
    addresses change with every step), on the pieces' device without a host sync; with the number of pieces and
    of blocks."""
    from ..flat import host_to_device
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


def client_step_triton(theta, grad, lr, momentum, buf, wd, prox_mu, anchor, dyn, c, ck, drift, drift_scale, max_norm,
                       active):
    """``grad``: one ``[n, P]`` tensor, or the per-parameter fp32 gradients ``[n, *shape]`` (contiguous; read in
    place through a block table: no concatenation, 8 bytes per parameter and client less traffic per step)."""
    n, P = theta.shape
    BLOCK = 1024
    f32 = lambda t: t.float().contiguous() if t is not None else theta  # noqa: E731
    if isinstance(grad, (list, tuple)):
        grad = [g.contiguous() for g in grad if g.numel()]
        pieces = piece_table(grad, BLOCK) if grad else None
        keep = grad  # the pieces stay referenced until both launches are queued
        grad, NB = theta, (pieces[2] if pieces else 0)
        if not NB:
            return
    else:
        grad, pieces, keep = grad.contiguous(), None, None
        NB = triton.cdiv(P, BLOCK)
    clip = clip_factors(theta, grad, f32(anchor), f32(dyn), prox_mu, max_norm, BLOCK, pieces)
    tab, npc = (theta, 0) if pieces is None else pieces[:2]
    _step_kernel[(n, NB)](theta, grad, f32(anchor), f32(dyn), clip, lr.float().contiguous(), wd.float().contiguous(),
                          f32(c), f32(ck), buf if buf is not None else theta, f32(drift), f32(drift_scale),
                          active.to(torch.int8).contiguous() if active is not None else theta, P, float(prox_mu),
                          float(momentum), tab, npc, LR_ROW=lr.numel() == n and n > 1,
                          WD_ROW=wd.numel() == n and n > 1, HAS_PROX=bool(prox_mu), HAS_DYN=dyn is not None,
                          CLIP=max_norm > 0, SCAF=c is not None, MOM=buf is not None, DRIFT=drift is not None,
                          DSCALE=drift is not None and drift_scale is not None, ACT=active is not None,
                          PIECES=pieces is not None, BLOCK=BLOCK, num_warps=4)
    del keep
