"""Triton kernels: a 2-D convolution with every client's own weights, as implicit GEMMs (no im2col buffer).

Layout (the batched executor's grouped layout): ``x`` is ``[B, n*Cin, H, W]`` with any strides (NHWC, i.e.
``channels_last``, makes the channel loads contiguous), ``w`` is ``[n, Cout, Cin, KH, KW]`` contiguous, ``out``
``[B, n*Cout, OH, OW]``. Client ``k`` owns channels ``k*Cin ...`` of ``x`` and ``k*Cout ...`` of ``out``.
Formulas: :func:`fedfast.ops.client_conv.client_conv2d_reference` (a per-client ``F.conv2d`` loop).

Three kernels, each one batched GEMM over the clients (grid axis 2 = client) with the reduction index ``j`` read
as a tap and a channel, ``j = (r * KW + s) * C + c`` (the channel fastest: contiguous loads in NHWC):

* forward ``out[b, co, p] = sum_j A[(b, p), j] W[j, co]``: M = B*OH*OW output pixels, N = Cout, K = KH*KW*Cin;
* input gradient ``dx[b, ci, q] = sum_j dY[(b, q), j] W[co, ci, r, s]``: M = B*H*W input pixels, N = Cin,
  K = KH*KW*Cout, the output pixel of tap (r, s) being ``((q + pad - r*dil) / stride)`` where that divides;
* weight gradient ``dw[co, ci, r, s] = sum_{b, p} dY[(b, p), co] A[(b, p), j]``: M = Cout, N = KH*KW*Cin,
  K = B*OH*OW.

FLOPs (each kernel): ``2 * B * OH * OW * Cout * Cin * KH * KW`` per client. Bytes, at the least: the forward reads
x and w once and writes out (``4 * (B*n*Cin*H*W + n*Cout*Cin*KH*KW + B*n*Cout*OH*OW)``); taps re-read x through
the caches. ``PREC``: ``"ieee"`` (fp32 semantics) or ``"tf32"`` (tensor cores, as cuDNN convolutions run by
default: ``torch.backends.cudnn.allow_tf32``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_fwd_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    o_ptr,
    Bn,
    Cin,
    H,
    W,
    Cout,
    OH,
    OW,
    sxb,
    sxc,
    sxh,
    sxw,
    sob,
    soc,
    soh,
    sow,
    KH: tl.constexpr,
    KW: tl.constexpr,
    SH: tl.constexpr,
    SW: tl.constexpr,
    PH: tl.constexpr,
    PW: tl.constexpr,
    DH: tl.constexpr,
    DW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FOLD: tl.constexpr,
    IDX64: tl.constexpr,
    PREC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    k = tl.program_id(2).to(tl.int64)
    M = Bn * OH * OW
    Ktot = KH * KW * Cin
    offs_m = pid_m * BM + tl.arange(0, BM)
    if IDX64:  # offsets past 2**31 elements: 64-bit index math (else 32-bit: fewer registers)
        offs_m = offs_m.to(tl.int64)
    bb = offs_m // (OH * OW)
    pp = offs_m % (OH * OW)
    oh, ow = pp // OW, pp % OW
    m_ok = offs_m < M
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < Cout
    x_base = x_ptr + k * Cin * sxc
    w_base = w_ptr + k * Cout * Ktot
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if FOLD:  # few input channels (an image stem): taps and channels in one reduction index
        ihb, iwb = oh * SH - PH, ow * SW - PW
        row = bb * sxb + ihb * sxh + iwb * sxw  # the address is separable: a pixel term plus a (tap, channel) term
        for j0 in range(0, Ktot, BK):
            j = j0 + tl.arange(0, BK)
            if IDX64:
                j = j.to(tl.int64)
            j_ok = j < Ktot
            rs = j // Cin
            ci = j % Cin
            rd, sd = (rs // KW) * DH, (rs % KW) * DW
            ih = ihb[:, None] + rd[None, :]
            iw = iwb[:, None] + sd[None, :]
            a_ok = m_ok[:, None] & j_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            a = tl.load(x_base + row[:, None] + (ci * sxc + rd * sxh + sd * sxw)[None, :], mask=a_ok, other=0.0)
            wt = tl.load(
                w_base + offs_n[None, :] * Ktot + ci[:, None] * (KH * KW) + rs[:, None],
                mask=j_ok[:, None] & n_ok[None, :],
                other=0.0,
            )
            acc += tl.dot(a, wt, input_precision=PREC)
    else:  # per tap: 1-D pixel index math, the channels of a pixel contiguous in NHWC
        for tap in range(0, KH * KW):  # a loop, not unrolled: 25 unrolled 5x5 taps spill registers
            r, s = tap // KW, tap % KW
            ih = oh * SH - PH + r * DH
            iw = ow * SW - PW + s * DW
            p_ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            pix = bb * sxb + ih * sxh + iw * sxw
            for c0 in range(0, Cin, BK):
                ci = c0 + tl.arange(0, BK)
                if IDX64:
                    ci = ci.to(tl.int64)
                c_ok = ci < Cin
                a = tl.load(x_base + pix[:, None] + ci[None, :] * sxc, mask=p_ok[:, None] & c_ok[None, :], other=0.0)
                wt = tl.load(
                    w_base + offs_n[None, :] * Ktot + ci[:, None] * (KH * KW) + tap,
                    mask=c_ok[:, None] & n_ok[None, :],
                    other=0.0,
                )
                acc += tl.dot(a, wt, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + k * Cout + offs_n, mask=n_ok, other=0.0)[None, :]
    o = o_ptr + k * Cout * soc + bb[:, None] * sob + offs_n[None, :] * soc + (oh * soh + ow * sow)[:, None]
    tl.store(o, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _conv_dgrad_kernel(
    g_ptr,
    w_ptr,
    dx_ptr,
    Bn,
    Cin,
    H,
    W,
    Cout,
    OH,
    OW,
    sgb,
    sgc,
    sgh,
    sgw,
    sdb,
    sdc,
    sdh,
    sdw,
    KH: tl.constexpr,
    KW: tl.constexpr,
    SH: tl.constexpr,
    SW: tl.constexpr,
    PH: tl.constexpr,
    PW: tl.constexpr,
    DH: tl.constexpr,
    DW: tl.constexpr,
    FOLD: tl.constexpr,
    IDX64: tl.constexpr,
    PREC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    k = tl.program_id(2).to(tl.int64)
    M = Bn * H * W
    Ktot = KH * KW * Cout
    offs_m = pid_m * BM + tl.arange(0, BM)
    if IDX64:  # offsets past 2**31 elements: 64-bit index math (else 32-bit: fewer registers)
        offs_m = offs_m.to(tl.int64)
    bb = offs_m // (H * W)
    qq = offs_m % (H * W)
    ih, iw = qq // W, qq % W
    m_ok = offs_m < M
    offs_n = pid_n * BN + tl.arange(0, BN)  # input channel
    n_ok = offs_n < Cin
    g_base = g_ptr + k * Cout * sgc
    w_base = w_ptr + k * Cout * Cin * KH * KW
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if FOLD:  # few output channels: taps and channels in one reduction index
        for j0 in range(0, Ktot, BK):
            j = j0 + tl.arange(0, BK)
            if IDX64:
                j = j.to(tl.int64)
            j_ok = j < Ktot
            rs = j // Cout
            co = j % Cout
            r, s = rs // KW, rs % KW
            th = ih[:, None] + PH - r[None, :] * DH
            tw = iw[:, None] + PW - s[None, :] * DW
            thc, twc = tl.maximum(th, 0), tl.maximum(tw, 0)
            oh, ow = thc // SH, twc // SW
            a_ok = (
                m_ok[:, None]
                & j_ok[None, :]
                & (th >= 0)
                & (tw >= 0)
                & (oh * SH == thc)
                & (ow * SW == twc)
                & (oh < OH)
                & (ow < OW)
            )
            a = tl.load(g_base + bb[:, None] * sgb + co[None, :] * sgc + oh * sgh + ow * sgw, mask=a_ok, other=0.0)
            wt = tl.load(
                w_base + co[:, None] * (Cin * KH * KW) + offs_n[None, :] * (KH * KW) + rs[:, None],
                mask=j_ok[:, None] & n_ok[None, :],
                other=0.0,
            )
            acc += tl.dot(a, wt, input_precision=PREC)
    else:
        for tap in range(0, KH * KW):
            r, s = tap // KW, tap % KW
            th = ih + PH - r * DH
            tw = iw + PW - s * DW
            thc, twc = tl.maximum(th, 0), tl.maximum(tw, 0)
            oh, ow = thc // SH, twc // SW
            p_ok = m_ok & (th >= 0) & (tw >= 0) & (oh < OH) & (ow < OW)
            if SH > 1:
                p_ok = p_ok & (oh * SH == thc)
            if SW > 1:
                p_ok = p_ok & (ow * SW == twc)
            pix = bb * sgb + oh * sgh + ow * sgw
            for c0 in range(0, Cout, BK):
                co = c0 + tl.arange(0, BK)
                if IDX64:
                    co = co.to(tl.int64)
                c_ok = co < Cout
                a = tl.load(g_base + pix[:, None] + co[None, :] * sgc, mask=p_ok[:, None] & c_ok[None, :], other=0.0)
                wt = tl.load(
                    w_base + co[:, None] * (Cin * KH * KW) + offs_n[None, :] * (KH * KW) + tap,
                    mask=c_ok[:, None] & n_ok[None, :],
                    other=0.0,
                )
                acc += tl.dot(a, wt, input_precision=PREC)
    d = dx_ptr + k * Cin * sdc + bb[:, None] * sdb + offs_n[None, :] * sdc + (ih * sdh + iw * sdw)[:, None]
    tl.store(d, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _conv_wgrad_kernel(
    g_ptr,
    x_ptr,
    dw_ptr,
    Bn,
    Cin,
    H,
    W,
    Cout,
    OH,
    OW,
    sgb,
    sgc,
    sgh,
    sgw,
    sxb,
    sxc,
    sxh,
    sxw,
    nclients,
    ksplit,
    kchunk,
    KH: tl.constexpr,
    KW: tl.constexpr,
    SH: tl.constexpr,
    SW: tl.constexpr,
    PH: tl.constexpr,
    PW: tl.constexpr,
    DH: tl.constexpr,
    DW: tl.constexpr,
    FOLD: tl.constexpr,
    IDX64: tl.constexpr,
    PREC: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    pid_z = tl.program_id(2)
    k = (pid_z // ksplit).to(tl.int64)  # the client
    part = pid_z % ksplit  # its share of the reduction: pixels [part * kchunk, (part + 1) * kchunk)
    Ntot = KH * KW * Cin
    Ktot = Bn * OH * OW
    p_lo = part * kchunk
    p_hi = tl.minimum(p_lo + kchunk, Ktot)
    offs_m = pid_m * BM + tl.arange(0, BM)  # output channel
    if IDX64:
        offs_m = offs_m.to(tl.int64)
    m_ok = offs_m < Cout
    if FOLD:  # the N tile spans (tap, input channel) pairs
        j = pid_n * BN + tl.arange(0, BN)
        if IDX64:
            j = j.to(tl.int64)
        j_ok = j < Ntot
        rs = j // Cin
        ci = j % Cin
        rd, sd = (rs // KW) * DH, (rs % KW) * DW
        colx = ci * sxc + rd * sxh + sd * sxw
    else:  # the N tile is a block of input channels of one tap
        nc = tl.cdiv(Cin, BN)
        tap = pid_n // nc
        ci = (pid_n % nc) * BN + tl.arange(0, BN)
        if IDX64:
            ci = ci.to(tl.int64)
        j_ok = ci < Cin
        r1, s1 = tap // KW, tap % KW
    g_base = g_ptr + k * Cout * sgc
    x_base = x_ptr + k * Cin * sxc
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for p0 in range(p_lo, p_hi, BK):
        p = p0 + tl.arange(0, BK)
        p_ok = p < p_hi
        if IDX64:
            p = p.to(tl.int64)
        bb = p // (OH * OW)
        pp = p % (OH * OW)
        oh, ow = pp // OW, pp % OW
        gt = tl.load(
            g_base + offs_m[:, None] * sgc + (bb * sgb + oh * sgh + ow * sgw)[None, :],
            mask=m_ok[:, None] & p_ok[None, :],
            other=0.0,
        )  # [BM, BK]
        if FOLD:
            ihb, iwb = oh * SH - PH, ow * SW - PW
            ih = ihb[:, None] + rd[None, :]
            iw = iwb[:, None] + sd[None, :]
            x_ok = p_ok[:, None] & j_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            xt = tl.load(
                x_base + (bb * sxb + ihb * sxh + iwb * sxw)[:, None] + colx[None, :], mask=x_ok, other=0.0
            )  # [BK, BN]
        else:
            ih = oh * SH - PH + r1 * DH
            iw = ow * SW - PW + s1 * DW
            q_ok = p_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            xt = tl.load(
                x_base + (bb * sxb + ih * sxh + iw * sxw)[:, None] + ci[None, :] * sxc,
                mask=q_ok[:, None] & j_ok[None, :],
                other=0.0,
            )
        acc += tl.dot(gt, xt, input_precision=PREC)
    if FOLD:
        col = ci * (KH * KW) + rs
    else:
        col = ci * (KH * KW) + tap
    # [ksplit, n, ...]
    d = dw_ptr + (part.to(tl.int64) * nclients + k) * Cout * Ntot + offs_m[:, None] * Ntot + col[None, :]
    tl.store(d, acc, mask=m_ok[:, None] & j_ok[None, :])


# (BM, BN, BK, num_warps, num_stages[, split]), with no register spills on sm_90 (scripts/triton_sm90_check.py,
# both precisions). Measured on an H100 by benchmarks/tune_conv.py (benchmarks/results/nvidia-h100-80gb-hbm3-
# tune.json: each kernel alone, 8 tiles each, on simple_cnn's second convolution at 50, 200 and 1000 clients and the
# FedNTD CNN's 5x5 one, TF32): the weight gradient's (64, 32, 32, 4, 4) beat the tile before it, (64, 64, 32, 8,
# 2), on all four layers (by 0-11 %). The forward's (128, 64, 16, 4, 4) and the input gradient's (128, 32, 16, 4, 4)
# were 12-18 % faster than these on all four, but spill (192 and 92 B in the forward with TF32; 16 B in the input
# gradient in fp32): not taken while a spill-free tile is within that margin. Folded (thin-channel) and 64-bit
# index variants keep 2-D index tiles live and take smaller tiles (not tuned on a GPU). The weight gradient's
# optional sixth entry splits its reduction over that many programs per tile (0 or absent: :func:`wgrad_split`).
CONFIGS = {"fwd": (64, 64, 16, 8, 2), "dgrad": (64, 32, 16, 4, 2), "wgrad": (64, 32, 32, 4, 4)}
CONFIGS_THIN = {"fwd": (32, 64, 16, 4, 2), "dgrad": (32, 32, 16, 4, 2), "wgrad": (32, 64, 16, 4, 2)}
FOLD_BELOW = 16  # channel counts below this fold the taps into the reduction index (one dot per 16+ lanes)


def _cfg(kind: str, cfg, thin: bool):
    if cfg is not None:
        return cfg
    return (CONFIGS_THIN if thin else CONFIGS)[kind]


def _strides(t: torch.Tensor):
    return [int(v) for v in t.stride()]


def _idx64(*ts) -> bool:
    """Whether an element offset of any of these tensors can pass 2**31 - 1 (then the kernels index in 64 bits)."""
    return any(sum((d - 1) * st for d, st in zip(t.shape, t.stride(), strict=True)) >= 2**31 - 1 for t in ts)


def _n_block(c: int, bn: int) -> int:
    """The N tile: no wider than the (power-of-two rounded) channel count, at least 16 (tl.dot's minimum)."""
    return max(16, min(bn, triton.next_power_of_2(int(c))))


# What "TF32 allowed" runs as: "tf32" (one TF32 product, ~1e-3 relative per product, as cuDNN's TF32 kernels) or
# "tf32x3" (three TF32 products with the operands' low parts: fp32 accuracy on the tensor cores)
TF32_PRECISION = "tf32x3"


def _prec(tf32: bool) -> str:
    if not tf32:
        return "ieee"
    if TF32_PRECISION not in ("tf32", "tf32x3"):
        raise ValueError(f"fedfast.triton.conv.TF32_PRECISION: 'tf32' or 'tf32x3', not {TF32_PRECISION!r}")
    return TF32_PRECISION


def _launch(kernel_size, stride, padding, dilation, fold: bool, i64: bool, tf32: bool, tiles) -> dict:
    """The launch keywords the three convolution kernels share: the geometry (kernel size, stride, padding,
    dilation), the index mode (``FOLD``, ``IDX64``), the dot precision and the tiles ``(BM, BN, BK, warps,
    stages)``."""
    BM, BN, BK, nw, ns = tiles
    return dict(
        KH=kernel_size[0],
        KW=kernel_size[1],
        SH=stride[0],
        SW=stride[1],
        PH=padding[0],
        PW=padding[1],
        DH=dilation[0],
        DW=dilation[1],
        FOLD=fold,
        IDX64=i64,
        PREC=_prec(tf32),
        BM=BM,
        BN=BN,
        BK=BK,
        num_warps=nw,
        num_stages=ns,
    )


def conv_forward(x, w, b, stride, padding, dilation, out, tf32: bool = False, cfg=None):
    """``out[B, n*Cout, OH, OW] = conv(x, w_k) + b_k`` for every client k (``out`` preallocated, any strides)."""
    B, _, H, W = x.shape
    n, Cout, Cin, KH, KW = w.shape
    OH, OW = out.shape[2], out.shape[3]
    fold, i64 = Cin < FOLD_BELOW, _idx64(x, w, out)
    BM, BN, BK, nw, ns = _cfg("fwd", cfg, fold or i64)
    BN = _n_block(Cout, BN)
    grid = (triton.cdiv(B * OH * OW, BM), triton.cdiv(Cout, BN), n)
    _conv_fwd_kernel[grid](
        x,
        w,
        b if b is not None else w,
        out,
        B,
        Cin,
        H,
        W,
        Cout,
        OH,
        OW,
        *_strides(x),
        *_strides(out),
        HAS_BIAS=b is not None,
        **_launch((KH, KW), stride, padding, dilation, fold, i64, tf32, (BM, BN, BK, nw, ns)),
    )
    return out


def conv_input_grad(g, w, stride, padding, dilation, dx, tf32: bool = False, cfg=None):
    """``dx[B, n*Cin, H, W]``: the input gradient of every client's convolution given ``g = dL/d out``."""
    B, _, H, W = dx.shape
    n, Cout, Cin, KH, KW = w.shape
    OH, OW = g.shape[2], g.shape[3]
    fold, i64 = Cout < FOLD_BELOW, _idx64(g, w, dx)
    BM, BN, BK, nw, ns = _cfg("dgrad", cfg, fold or i64)
    BN = _n_block(Cin, BN)
    grid = (triton.cdiv(B * H * W, BM), triton.cdiv(Cin, BN), n)
    _conv_dgrad_kernel[grid](
        g,
        w,
        dx,
        B,
        Cin,
        H,
        W,
        Cout,
        OH,
        OW,
        *_strides(g),
        *_strides(dx),
        **_launch((KH, KW), stride, padding, dilation, fold, i64, tf32, (BM, BN, BK, nw, ns)),
    )
    return dx


MIN_SPLIT_STEPS = 16  # a reduction share is at least this many BK-wide steps


def wgrad_split(programs: int, ktot: int, bk: int, device: torch.device) -> int:
    """Reduction shares per weight-gradient tile: 1 when the tiles alone give every SM two programs, else enough
    shares for that (each at least ``MIN_SPLIT_STEPS`` steps of ``bk`` pixels). The weight gradient's reduction
    (``B*OH*OW`` pixels) is long and its output small: with few clients per chunk (FedNTD's 10) its tiles are
    fewer than the SMs, and each runs thousands of pixels alone. 1 off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= 2 * sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), ktot // (bk * MIN_SPLIT_STEPS)))


def conv_weight_grad(g, x, stride, padding, dilation, dw, tf32: bool = False, cfg=None):
    """``dw[n, Cout, Cin, KH, KW]`` (contiguous): every client's weight gradient given ``g = dL/d out``.

    With the reduction split in S shares (:func:`wgrad_split`, or ``cfg[5]``), each share writes its partial sum
    to a ``[S, n, Cout, Cin*KH*KW]`` buffer and the shares are summed in a fixed order: deterministic, no
    atomics; the summation order differs from S = 1 only by rounding."""
    B, _, H, W = x.shape
    n, Cout, Cin, KH, KW = dw.shape
    OH, OW = g.shape[2], g.shape[3]
    fold, i64 = Cin < FOLD_BELOW, _idx64(g, x, dw)
    c = _cfg("wgrad", cfg, fold or i64)
    BM, BN, BK, nw, ns = c[:5]
    BM = _n_block(Cout, BM)
    if not fold:
        BN = _n_block(Cin, BN)
    nb = triton.cdiv(KH * KW * Cin, BN) if fold else KH * KW * triton.cdiv(Cin, BN)
    ktot = B * OH * OW
    split = int(c[5]) if len(c) > 5 and c[5] else wgrad_split(triton.cdiv(Cout, BM) * nb * n, ktot, BK, dw.device)
    split = max(1, min(split, triton.cdiv(ktot, BK)))
    kchunk = triton.cdiv(triton.cdiv(ktot, split), BK) * BK  # a multiple of BK
    split = triton.cdiv(ktot, kchunk)  # no empty share
    dst = dw if split == 1 else torch.empty((split,) + tuple(dw.shape), device=dw.device, dtype=dw.dtype)
    i64 = i64 or _idx64(dst)
    grid = (triton.cdiv(Cout, BM), nb, n * split)
    _conv_wgrad_kernel[grid](
        g,
        x,
        dst,
        B,
        Cin,
        H,
        W,
        Cout,
        OH,
        OW,
        *_strides(g),
        *_strides(x),
        n,
        split,
        kchunk,
        **_launch((KH, KW), stride, padding, dilation, fold, i64, tf32, (BM, BN, BK, nw, ns)),
    )
    if split > 1:
        torch.sum(dst, 0, out=dw)
    return dw
