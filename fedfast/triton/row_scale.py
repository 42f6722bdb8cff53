"""Triton kernel of the losses' row bookkeeping: each row's reduction weight and the target/segment checks, one launch.

Reference: :func:`fedfast.ops.distill.row_scale_torch` (the weights) and :mod:`fedfast.ops._validate` (the checks);
the C++ twin is ``fedfast._C.row_scale``. For ``reduction="mean"`` each row's weight is 1 / (number of valid rows),
or with ``segments`` 1 / (number of valid rows of its client); a row is valid when its target is a class
(in [0, C), not ``ignore_index``). With ``CHECK`` the program also ORs 1 into ``status[0]`` if a target is neither a
class nor ``ignore_index`` and into ``status[1]`` if a client id is outside [0, limit) or smaller than the one before
(the deferred validation's flags, read once per round by :func:`fedfast.ops.raise_if_invalid`).

Why a kernel: on a GPU the same bookkeeping in tensor ops is 9-33 launches per loss call (the mask, the per-client
counts by ``index_add``, their reciprocal gathered back, and with deferred validation the range and order checks),
about 11 us of host time each on the H100's host (benchmarks/results/nvidia-h100-80gb-hbm3-host.json), where the
device needs a few microseconds in all. One program (the rows of a federated step: R <= 65536) walks the rows three
times: zero the per-client counts, count the valid rows with atomics, write 1/n. Bytes: R*(y + s) read twice + 4R
written (y, s: the sizes of the target and segment ids). 1/n is divided with IEEE rounding (``div_rn``): Triton's
fp32 ``/`` is the approximate ``div.full.f32`` on NVIDIA GPUs, 1 ulp off torch's and the C++ pass's 1/n for some n
(seen on the H100, 2026-11-27: R = 1025 rows of 21 clients).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_scale_kernel(
    y_ptr,
    seg_ptr,
    cnt_ptr,
    rs_ptr,
    st_ptr,
    R,
    C,
    ignore_index,
    limit,
    HAS_SEG: tl.constexpr,
    MODE: tl.constexpr,
    CHECK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """MODE 0: checks only; 1: 1/#valid rows; 2: 1/#valid rows of the row's segment (needs HAS_SEG)."""
    offs0 = tl.arange(0, BLOCK)
    bad_t = tl.zeros([BLOCK], dtype=tl.int32)
    bad_s = tl.zeros([BLOCK], dtype=tl.int32)
    nvalid = tl.zeros([BLOCK], dtype=tl.int32)
    if MODE == 2:
        for start in range(0, R, BLOCK):
            o = start + offs0
            tl.store(cnt_ptr + o, tl.zeros([BLOCK], dtype=tl.int32), mask=o < R)
        tl.debug_barrier()  # every thread's zeros land before any count (one program: a CTA barrier suffices)
    for start in range(0, R, BLOCK):
        o = start + offs0
        m = o < R
        y = tl.load(y_ptr + o, mask=m, other=ignore_index).to(tl.int64)
        ok = m & (y != ignore_index) & (y >= 0) & (y < C)
        if CHECK:
            bad_t = bad_t | (m & (y != ignore_index) & ((y < 0) | (y >= C))).to(tl.int32)
        if HAS_SEG:
            s = tl.load(seg_ptr + o, mask=m, other=0).to(tl.int64)
            if CHECK:
                prev = tl.load(seg_ptr + o - 1, mask=m & (o > 0), other=0).to(tl.int64)
                out = (s < 0) | (s >= limit) | ((o > 0) & (s < prev))
                bad_s = bad_s | (m & out).to(tl.int32)
            if MODE == 2:
                sc = tl.minimum(tl.maximum(s, 0), R - 1)
                tl.atomic_add(cnt_ptr + sc, ok.to(tl.int32), mask=m & ok)
        if MODE == 1:
            nvalid += ok.to(tl.int32)
    if MODE == 1:
        d = tl.maximum(tl.sum(nvalid, axis=0), 1).to(tl.float32)
        inv = tl.math.div_rn(d * 0.0 + 1.0, d)
        for start in range(0, R, BLOCK):
            o = start + offs0
            tl.store(rs_ptr + o, tl.zeros([BLOCK], dtype=tl.float32) + inv, mask=o < R)
    if MODE == 2:
        tl.debug_barrier()  # all counts done before they are read
        for start in range(0, R, BLOCK):
            o = start + offs0
            m = o < R
            s = tl.load(seg_ptr + o, mask=m, other=0).to(tl.int64)
            sc = tl.minimum(tl.maximum(s, 0), R - 1)
            # read through an atomic (at L2, where the counts were added), not a possibly stale L1 line
            n = tl.atomic_add(cnt_ptr + sc, tl.zeros([BLOCK], dtype=tl.int32), mask=m)
            tl.store(
                rs_ptr + o,
                tl.math.div_rn(tl.zeros([BLOCK], dtype=tl.float32) + 1.0, tl.maximum(n, 1).to(tl.float32)),
                mask=m,
            )
    if CHECK:
        tl.atomic_or(st_ptr, tl.max(bad_t, axis=0))
        tl.atomic_or(st_ptr + 1, tl.max(bad_s, axis=0))


def row_scale_triton(target, segments, C: int, ignore_index: int, mode: int, limit: int, status=None):
    """``FEDFAST_ROW_SCALE``'s arguments and result: each row's reduction weight (fp32 [R]; None for ``mode`` 0) and
    0 (no flags found on the host); with ``status`` (int32, the deferred validation's flags: [0] target, [1]
    segments) the checks of the targets and client ids on the device. ``mode``: 0 checks only, 1 one mean over the
    valid rows, 2 one mean per segment (``segments`` sorted client ids < ``limit``)."""
    R = target.shape[0]
    dev = target.device
    if mode == 2 and segments is None:
        mode = 1
    rs = torch.empty(R, dtype=torch.float32, device=dev) if mode else None
    if R == 0 or (mode == 0 and status is None):
        return rs, 0
    cnt = torch.empty(R, dtype=torch.int32, device=dev) if mode == 2 else target
    _row_scale_kernel[(1,)](
        target,
        segments if segments is not None else target,
        cnt,
        rs if rs is not None else cnt,
        status if status is not None else cnt,
        R,
        C,
        ignore_index,
        limit,
        HAS_SEG=segments is not None,
        MODE=mode,
        CHECK=status is not None,
        BLOCK=1024,
        num_warps=8,
    )
    return rs, 0
