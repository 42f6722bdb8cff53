"""Triton kernel: fused server update over flat client rows (formulas: fedfast/ops/aggregate_reference.py).

One program per BLOCK columns streams the n participating rows once (acc += w_k x_k), flags rows holding
NaN/inf, then applies the server rule (momentum / FedDyn), SCAFFOLD controls and the FedGKD buffer write.
Bytes: n*P*x + 4P*(2 + 2*[momentum]) + 8*n*P per kept per-client state (FedDyn h_k, SCAFFOLD c_k) + 4P*[buffer].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _aggregate_kernel(x_ptr, rows_ptr, w_ptr, g_ptr, m_ptr, mo_ptr, h_ptr, ho_ptr, hb_ptr, hbo_ptr, c_ptr, co_ptr,
                      ck_ptr, cko_ptr, coef_ptr, tb_ptr, gout_ptr, avg_ptr, bad_ptr, n, P, beta, scale, lr, inv_dynK,
                      inv_scK, slot, HAS_M: tl.constexpr, KEEP_M: tl.constexpr, DYN: tl.constexpr, SCAF: tl.constexpr,
                      TB: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    cm = cols < P
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    tot = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, n):
        r = tl.load(rows_ptr + k).to(tl.int64)
        x = tl.load(x_ptr + r * P + cols, mask=cm, other=0.0).to(tl.float32)
        acc += tl.load(w_ptr + k) * x
        if DYN:
            tot += x
        # flag row k if any element is NaN/inf: a masked atomic issues no memory op for finite data and needs
        # no cross-warp reduction (a tl.max + atomic per row costs a barrier per iteration)
        nonfinite = cm & ((x != x) | (tl.abs(x) == float("inf")))
        tl.atomic_max(bad_ptr + k + tl.zeros([BLOCK], dtype=tl.int64), tl.full([BLOCK], 1, tl.int32), mask=nonfinite)
    g = tl.load(g_ptr + cols, mask=cm, other=0.0)
    if DYN:  # h_k += X_k - g ; hbar += sum_k (X_k - g) / K ; g' = avg + hbar'
        for k in range(0, n):
            r = tl.load(rows_ptr + k).to(tl.int64)
            x = tl.load(x_ptr + r * P + cols, mask=cm, other=0.0).to(tl.float32)
            hk = tl.load(h_ptr + k * P + cols, mask=cm, other=0.0)
            tl.store(ho_ptr + k * P + cols, hk + (x - g), mask=cm)
        hb = tl.load(hb_ptr + cols, mask=cm, other=0.0) + (tot - n * g) * inv_dynK
        tl.store(hbo_ptr + cols, hb, mask=cm)
        newg = acc + hb
    else:  # m' = beta m + scale (g - avg) ; g' = g - lr m'
        mm = scale * (g - acc)
        if HAS_M:
            mm += beta * tl.load(m_ptr + cols, mask=cm, other=0.0)
        if KEEP_M:
            tl.store(mo_ptr + cols, mm, mask=cm)
        newg = g - lr * mm
    if SCAF:  # c_k' = c_k - c + coef_k (g - X_k) ; c' = c + sum_k (c_k' - c_k) / K
        c = tl.load(c_ptr + cols, mask=cm, other=0.0)
        dc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, n):
            r = tl.load(rows_ptr + k).to(tl.int64)
            x = tl.load(x_ptr + r * P + cols, mask=cm, other=0.0).to(tl.float32)
            ck = tl.load(ck_ptr + k * P + cols, mask=cm, other=0.0)
            v = ck - c + tl.load(coef_ptr + k) * (g - x)
            tl.store(cko_ptr + k * P + cols, v, mask=cm)
            dc += v - ck
        tl.store(co_ptr + cols, c + dc * inv_scK, mask=cm)
    tl.store(gout_ptr + cols, newg, mask=cm)
    tl.store(avg_ptr + cols, acc, mask=cm)
    if TB:
        tl.store(tb_ptr + slot * P + cols, newg, mask=cm)


def aggregate_triton(X, rows, g, w, beta, scale, lr, momentum, dyn_h, dyn_hbar, dyn_K, scaffold_c, scaffold_ck,
                     scaffold_coef, sc_K, teacher_buffer, slot, count):
    """Same contract as the C++ ``aggregate``: returns [global, average, momentum, dyn_h, dyn_hbar, scaffold_c,
    scaffold_ck, teacher_buffer, teacher, bad (n + 1 flags)]."""
    X = X.contiguous()
    n, P = rows.numel(), X.shape[1]
    dev = X.device
    f32 = lambda t: t.float().contiguous() if t is not None else None  # noqa: E731
    g, w = f32(g), f32(w)
    m, h, hb, c, ck, coef = f32(momentum), f32(dyn_h), f32(dyn_hbar), f32(scaffold_c), f32(scaffold_ck), f32(scaffold_coef)
    keep_m = m is not None or beta != 0.0
    gout, avg = torch.empty(P, device=dev), torch.empty(P, device=dev)
    mo = torch.empty(P, device=dev) if keep_m else None
    ho = torch.empty_like(h) if h is not None else None
    hbo = torch.empty_like(hb) if h is not None else None
    co = torch.empty_like(c) if c is not None else None
    cko = torch.empty_like(ck) if c is not None else None
    tb = teacher_buffer.float().clone() if teacher_buffer is not None else None
    bad = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    d = gout  # placeholder pointer for unused arguments
    BLOCK = 1024
    _aggregate_kernel[(triton.cdiv(P, BLOCK),)](
        X, rows.long().contiguous(), w, g, m if m is not None else d, mo if mo is not None else d,
        h if h is not None else d, ho if ho is not None else d, hb if hb is not None else d,
        hbo if hbo is not None else d, c if c is not None else d, co if co is not None else d,
        ck if ck is not None else d, cko if cko is not None else d, coef if coef is not None else d,
        tb if tb is not None else d, gout, avg, bad, n, P, float(beta), float(scale), float(lr), 1.0 / float(dyn_K),
        1.0 / float(sc_K), int(slot), HAS_M=m is not None, KEEP_M=keep_m, DYN=h is not None, SCAF=c is not None,
        TB=tb is not None, BLOCK=BLOCK, num_warps=4)
    badb = bad.bool()
    badb[n] = ~torch.isfinite(avg).all()
    teacher = tb[:count].mean(0) if tb is not None else None
    return [gout, avg, mo, ho, hbo, co, cko, tb, teacher, badb]
