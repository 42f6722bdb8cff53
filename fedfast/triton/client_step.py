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
def _loss_grad(th_ptr, g_ptr, a_ptr, dyn_ptr, offs, cols, m, mu, HAS_PROX: tl.constexpr, HAS_DYN: tl.constexpr):
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
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
    g, t = _loss_grad(th_ptr, g_ptr, a_ptr, dyn_ptr, offs, cols, m, mu, HAS_PROX, HAS_DYN)
    if CLIP:
        g = g * tl.load(clip_ptr + k)
    return k, cols, m, offs, g, t


@triton.jit
def _norm_kernel(th_ptr, g_ptr, a_ptr, dyn_ptr, part_ptr, P, NB, mu, HAS_PROX: tl.constexpr, HAS_DYN: tl.constexpr,
                 BLOCK: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    cols = b * BLOCK + tl.arange(0, BLOCK)
    m = cols < P
    g, _ = _loss_grad(th_ptr, g_ptr, a_ptr, dyn_ptr, k * P + cols, cols, m, mu, HAS_PROX, HAS_DYN)
    tl.store(part_ptr + k * NB + b, tl.sum(g * g, axis=0))


@triton.jit
def _step_kernel(th_ptr, g_ptr, a_ptr, dyn_ptr, clip_ptr, lr_ptr, wd_ptr, c_ptr, ck_ptr, buf_ptr, dr_ptr, ds_ptr, act_ptr,
                 P, mu,
                 mom, LR_ROW: tl.constexpr, WD_ROW: tl.constexpr, HAS_PROX: tl.constexpr, HAS_DYN: tl.constexpr,
                 CLIP: tl.constexpr, SCAF: tl.constexpr, MOM: tl.constexpr, DRIFT: tl.constexpr, DSCALE: tl.constexpr,
                 ACT: tl.constexpr,
                 BLOCK: tl.constexpr):
    k, cols, m, offs, g, t = _row_block(th_ptr, g_ptr, a_ptr, dyn_ptr, clip_ptr, act_ptr, P, mu, HAS_PROX, HAS_DYN,
                                        CLIP, ACT, BLOCK)
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


def clip_factors(theta, grad, anchor, dyn, prox_mu, max_norm, BLOCK):
    """Per-row clip factors [n] of the loss-side gradient (``theta`` itself as a dummy pointer without clipping).
    ``anchor`` / ``dyn``: fp32 tensors or ``theta`` as a dummy."""
    if not max_norm > 0:
        return theta
    n, P = theta.shape
    NB = triton.cdiv(P, BLOCK)
    part = torch.empty(n, NB, dtype=torch.float32, device=theta.device)
    _norm_kernel[(n, NB)](theta, grad, anchor, dyn, part, P, NB, float(prox_mu), HAS_PROX=bool(prox_mu),
                          HAS_DYN=dyn is not theta, BLOCK=BLOCK, num_warps=4)
    return torch.clamp(max_norm / (part.sum(1).sqrt() + 1e-6), max=1.0)


def client_step_triton(theta, grad, lr, momentum, buf, wd, prox_mu, anchor, dyn, c, ck, drift, drift_scale, max_norm,
                       active):
    n, P = theta.shape
    BLOCK = 1024
    NB = triton.cdiv(P, BLOCK)
    f32 = lambda t: t.float().contiguous() if t is not None else theta  # noqa: E731
    grad = grad.contiguous()
    clip = clip_factors(theta, grad, f32(anchor), f32(dyn), prox_mu, max_norm, BLOCK)
    _step_kernel[(n, NB)](theta, grad, f32(anchor), f32(dyn), clip, lr.float().contiguous(), wd.float().contiguous(),
                          f32(c), f32(ck), buf if buf is not None else theta, f32(drift), f32(drift_scale),
                          active.to(torch.int8).contiguous() if active is not None else theta, P, float(prox_mu),
                          float(momentum), LR_ROW=lr.numel() == n and n > 1, WD_ROW=wd.numel() == n and n > 1,
                          HAS_PROX=bool(prox_mu), HAS_DYN=dyn is not None, CLIP=max_norm > 0, SCAF=c is not None,
                          MOM=buf is not None, DRIFT=drift is not None,
                          DSCALE=drift is not None and drift_scale is not None, ACT=active is not None, BLOCK=BLOCK,
                          num_warps=4)
