"""Triton kernel: fused server update over flat client rows (formulas: fedfast/ops/aggregate_reference.py).

One program per BLOCK columns streams the n participating rows once (acc += w_k x_k), flags rows holding
NaN/inf, then applies the server rule, the optional per-client state-row update R_k' = (R_k + shift) +
a_k (X_k - g) with the column sum of its changes, and the ring-buffer write.
Bytes: n*P*x + 4P*(2 + 2*[momentum]) + 8*n*P with state rows + 4P*[shift, change, ring].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _aggregate_kernel(
    x_ptr,
    rows_ptr,
    w_ptr,
    g_ptr,
    m_ptr,
    mo_ptr,
    r_ptr,
    ro_ptr,
    coef_ptr,
    shift_ptr,
    change_ptr,
    ring_ptr,
    gout_ptr,
    avg_ptr,
    bad_ptr,
    ashift_ptr,
    n,
    P,
    beta,
    scale,
    lr,
    slot,
    HAS_M: tl.constexpr,
    KEEP_M: tl.constexpr,
    STATE: tl.constexpr,
    SHIFT: tl.constexpr,
    RING: tl.constexpr,
    ASHIFT: tl.constexpr,
    BLOCK: tl.constexpr,
    UNROLL: tl.constexpr,
):
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    cm = cols < P
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if ASHIFT:  # avg = avg_shift + sum_k w_k X_k (DP-FedAvg's unnormalised weights)
        acc = tl.load(ashift_ptr + cols, mask=cm, other=0.0)
    # UNROLL rows per iteration: their loads are independent, so UNROLL row blocks are in flight at once (the
    # sum's order is still k = 0, 1, ..., n - 1: the same bits for any UNROLL)
    for k0 in range(0, n, UNROLL):
        for j in tl.static_range(UNROLL):
            k = k0 + j
            ok = k < n
            r = tl.load(rows_ptr + k, mask=ok, other=0).to(tl.int64)
            x = tl.load(x_ptr + r * P + cols, mask=cm & ok, other=0.0).to(tl.float32)
            acc += tl.load(w_ptr + k, mask=ok, other=0.0) * x
            # flag row k if any element is NaN/inf: a masked atomic issues no memory op for finite data and needs
            # no cross-warp reduction (a tl.max + atomic per row costs a barrier per iteration)
            nonfinite = cm & ok & ((x != x) | (tl.abs(x) == float("inf")))
            tl.atomic_max(
                bad_ptr + k + tl.zeros([BLOCK], dtype=tl.int64), tl.full([BLOCK], 1, tl.int32), mask=nonfinite
            )
    g = tl.load(g_ptr + cols, mask=cm, other=0.0)
    mm = scale * (g - acc)  # m' = beta m + scale (g - avg) ; g' = g - lr m'
    if HAS_M:
        mm += beta * tl.load(m_ptr + cols, mask=cm, other=0.0)
    if KEEP_M:
        tl.store(mo_ptr + cols, mm, mask=cm)
    newg = g - lr * mm
    if STATE:  # R_k' = (R_k + shift) + a_k (X_k - g) ; change = sum_k (R_k' - R_k)
        sh = tl.zeros([BLOCK], dtype=tl.float32)
        if SHIFT:
            sh = tl.load(shift_ptr + cols, mask=cm, other=0.0)
        dc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, n):
            r = tl.load(rows_ptr + k).to(tl.int64)
            x = tl.load(x_ptr + r * P + cols, mask=cm, other=0.0).to(tl.float32)
            old = tl.load(r_ptr + k * P + cols, mask=cm, other=0.0)
            base = old
            if SHIFT:
                base = old + sh
            v = base + tl.load(coef_ptr + k) * (x - g)
            tl.store(ro_ptr + k * P + cols, v, mask=cm)
            dc += v - old
        tl.store(change_ptr + cols, dc, mask=cm)
    tl.store(gout_ptr + cols, newg, mask=cm)
    tl.store(avg_ptr + cols, acc, mask=cm)
    if RING:
        tl.store(ring_ptr + slot * P + cols, newg, mask=cm)


# (BLOCK columns per program, rows loaded per iteration, warps), from benchmarks/gpu_probe.py's sweep on an H100
# (P = 1,663,370; copy 3001 GB/s): 2161 GB/s at 100 clients and 2492 at 1000 against 1878 and 2127 with one row per
# iteration; w @ X (cuBLAS) 2692 and 2726 GB/s in the same run
CONFIG = (1024, 4, 4)


def aggregate_triton(
    X,
    rows,
    g,
    w,
    beta,
    scale,
    lr,
    momentum,
    state_rows,
    state_coef,
    state_shift,
    ring,
    slot,
    count,
    avg_shift=None,
    config=None,
):
    """Same contract as the C++ ``aggregate``: returns [global, average, momentum, state_rows, state_change, ring,
    ring_mean, bad (n + 1 flags)]. ``config``: (BLOCK, UNROLL, num_warps), default :data:`CONFIG`."""
    X = X.contiguous()
    n, P = rows.numel(), X.shape[1]
    dev = X.device
    f32 = lambda t: t.float().contiguous() if t is not None else None  # noqa: E731
    g, w = f32(g), f32(w)
    m, r, coef, shift, ashift = f32(momentum), f32(state_rows), f32(state_coef), f32(state_shift), f32(avg_shift)
    keep_m = m is not None or beta != 0.0
    gout, avg = torch.empty(P, device=dev), torch.empty(P, device=dev)
    mo = torch.empty(P, device=dev) if keep_m else None
    ro = torch.empty_like(r) if r is not None else None
    change = torch.empty(P, device=dev) if r is not None else None
    rb = ring.float().clone() if ring is not None else None
    bad = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    d = gout  # placeholder pointer for unused arguments
    o = lambda t: t if t is not None else d  # noqa: E731
    BLOCK, UNROLL, warps = config or CONFIG
    _aggregate_kernel[(triton.cdiv(P, BLOCK),)](
        X,
        rows.long().contiguous(),
        w,
        g,
        o(m),
        o(mo),
        o(r),
        o(ro),
        o(coef),
        o(shift),
        o(change),
        o(rb),
        gout,
        avg,
        bad,
        o(ashift),
        n,
        P,
        float(beta),
        float(scale),
        float(lr),
        int(slot),
        HAS_M=m is not None,
        KEEP_M=keep_m,
        STATE=r is not None,
        SHIFT=shift is not None,
        RING=rb is not None,
        ASHIFT=ashift is not None,
        BLOCK=BLOCK,
        UNROLL=UNROLL,
        num_warps=warps,
    )
    badb = bad.bool()
    badb[n] = ~torch.isfinite(avg).all()
    ring_mean = rb[:count].mean(0) if rb is not None else None
    return [gout, avg, mo, ro, change, rb, ring_mean, badb]
