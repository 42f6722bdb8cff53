"""A 2-D convolution with every client's own weights, in the batched executor's grouped layout.

``client_conv2d(x, w, b, stride, padding, dilation, impl=...)``: ``x`` is ``[B, n*Cin, H, W]`` (client ``k`` owns
channels ``k*Cin ... (k+1)*Cin - 1``), ``w`` is ``[n, Cout, Cin, KH, KW]``, ``b`` ``[n, Cout]`` or None; returns
``[B, n*Cout, OH, OW]`` with ``out[:, k*Cout:(k+1)*Cout] = F.conv2d(x[:, k*Cin:(k+1)*Cin], w[k], b[k], ...)``.
Differentiable in ``x``, ``w`` and ``b``.

Implementations (``impl``), all the same function (tests/test_client_conv.py checks each against
:func:`client_conv2d_reference` in float64, forward and both gradients):

* ``"grouped"``: one ``F.conv2d`` with ``groups = n`` (cuDNN / oneDNN grouped convolution). The CPU default:
  oneDNN runs it near the machine's sgemm rate in NHWC. A strided 1 x 1 convolution on the CPU runs as a subsample
  and a stride-1 convolution (:mod:`fedfast.ops.conv_cpu`: the same values, round a oneDNN bug in torch 2.13).
* ``"gemm"``: explicit im2col (``F.unfold``) and one batched matrix product per pass (forward, input gradient
  through ``F.fold``, weight gradient); memory: the unfolded input, ``KH*KW`` times the input, is kept for the
  backward.
* ``"triton"``: implicit GEMMs (:mod:`fedfast.triton.conv`), no im2col buffer; CUDA, or the Triton interpreter.
* ``"hybrid"``: the Triton implicit GEMM forward, cuDNN's grouped input and weight gradients
  (``aten.convolution_backward`` with ``groups = n``). Measured kernel by kernel on an H100
  (``benchmarks/tune_conv.py``, docs/benchmarks.md): cuDNN's grouped *forward* falls to 1.6 TFLOP/s from 200
  clients on (35 ms at 200 clients of ``simple_cnn``'s second convolution, against 1.5 ms for the implicit GEMM),
  while its grouped gradients run at 25-34 TFLOP/s, 1.5-2x the implicit GEMMs'. Each pass is the fastest measured.

On CUDA, ``"gemm"`` and ``"triton"`` use TF32 tensor cores exactly when ``torch.backends.cudnn.allow_tf32`` is
set (PyTorch's default), i.e. when a plain per-client loop's cuDNN convolutions may use them too; with it cleared
they compute in fp32. The Triton kernels then take three TF32 products per product (``"tf32x3"``: the operands'
high and low parts, fp32 accuracy), not one: cuDNN picks fp32 kernels for many small layers even with TF32 allowed,
and a single TF32 product put the engine 60x further from the float64 loop than the TF32 loop was on a small CNN
(1.9e-3 against 3.0e-5 after two rounds; 7.8e-2 against 6.3e-3 on a BatchNorm ResNet; H100, 2026-11-27,
benchmarks/results/nvidia-h100-80gb-hbm3-tf32.json). It costs 24 % of a pfl_cifar_50 round there (28.4 against
22.9 ms); ``fedfast.triton.conv.TF32_PRECISION = "tf32"`` opts into the single product.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _backend
from .conv_cpu import conv2d, takes_subsample

IMPLS = ("grouped", "gemm", "triton", "hybrid")


def _pair(v) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    t = tuple(int(a) for a in v)
    if len(t) != 2:
        raise ValueError(f"expected an int or a pair, got {v!r}")
    return t


def out_size(H: int, W: int, kernel, stride, padding, dilation) -> tuple[int, int]:
    (KH, KW), (SH, SW), (PH, PW), (DH, DW) = _pair(kernel), _pair(stride), _pair(padding), _pair(dilation)
    return (H + 2 * PH - DH * (KH - 1) - 1) // SH + 1, (W + 2 * PW - DW * (KW - 1) - 1) // SW + 1


def client_conv2d_reference(x: Tensor, w: Tensor, b: Tensor | None = None, stride=1, padding=0, dilation=1) -> Tensor:
    """The specification: a loop of ``F.conv2d`` over the clients (any dtype, float64 included)."""
    n, Cout, Cin = w.shape[:3]
    outs = [
        F.conv2d(
            x[:, k * Cin : (k + 1) * Cin],
            w[k],
            None if b is None else b[k],
            _pair(stride),
            _pair(padding),
            _pair(dilation),
        )
        for k in range(n)
    ]
    return torch.cat(outs, 1)


def _tf32(device: torch.device) -> bool:
    return device.type == "cuda" and bool(torch.backends.cudnn.allow_tf32)


@contextlib.contextmanager
def _matmul_tf32(on: bool):
    """Matrix products with TF32 exactly when ``on`` (the convolution's rule, not ``torch.backends.cuda.matmul``)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


class _GemmConv(torch.autograd.Function):
    """im2col + batched GEMM over (sample, client) pairs: cols ``[B*n, Cin*KH*KW, L]``, ``out = W_k @ cols``."""

    @staticmethod
    def forward(ctx, x, w, b, stride, padding, dilation):
        B, _, H, W = x.shape
        n, Cout, Cin, KH, KW = w.shape
        OH, OW = out_size(H, W, (KH, KW), stride, padding, dilation)
        L = OH * OW
        cols = F.unfold(x.reshape(B * n, Cin, H, W), (KH, KW), dilation, padding, stride)  # [B*n, Cin*KH*KW, L]
        with _matmul_tf32(_tf32(x.device)):
            out = torch.matmul(w.reshape(1, n, Cout, Cin * KH * KW), cols.view(B, n, Cin * KH * KW, L))
        if b is not None:
            out += b.reshape(1, n, Cout, 1)
        ctx.save_for_backward(cols, w)
        ctx.geom = (B, n, Cin, H, W, stride, padding, dilation, b is not None)
        return out.view(B, n * Cout, OH, OW)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        cols, w = ctx.saved_tensors
        B, n, Cin, H, W, stride, padding, dilation, has_b = ctx.geom
        _, Cout, _, KH, KW = w.shape
        L = g.shape[2] * g.shape[3]
        gv = g.reshape(B, n, Cout, L)
        gx = gw = gb = None
        with _matmul_tf32(_tf32(g.device)):
            if ctx.needs_input_grad[1]:  # sum over the batch of g_(b,k) cols_(b,k)^T
                gw = torch.matmul(gv, cols.view(B, n, Cin * KH * KW, L).transpose(2, 3)).sum(0).reshape(w.shape)
            if ctx.needs_input_grad[0]:
                gcols = torch.matmul(w.reshape(1, n, Cout, Cin * KH * KW).transpose(2, 3), gv)
                gx = F.fold(gcols.reshape(B * n, Cin * KH * KW, L), (H, W), (KH, KW), dilation, padding, stride).view(
                    B, n * Cin, H, W
                )
        if has_b and ctx.needs_input_grad[2]:
            gb = gv.sum((0, 3))
        return gx, gw, gb, None, None, None


class _TritonConv(torch.autograd.Function):
    """The implicit-GEMM kernels of :mod:`fedfast.triton.conv`: forward, input gradient, weight gradient."""

    @staticmethod
    def forward(ctx, x, w, b, stride, padding, dilation, grads="triton"):
        from ..triton.conv import conv_forward

        B, _, H, W = x.shape
        n, Cout = w.shape[:2]
        OH, OW = out_size(H, W, w.shape[3:], stride, padding, dilation)
        fmt = (
            torch.channels_last
            if (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
            else torch.contiguous_format
        )
        out = torch.empty(B, n * Cout, OH, OW, device=x.device, dtype=torch.float32, memory_format=fmt)
        wc = w.contiguous()
        conv_forward(x, wc, None if b is None else b.contiguous(), stride, padding, dilation, out, _tf32(x.device))
        ctx.save_for_backward(x, wc)
        ctx.geom = (stride, padding, dilation, b is not None)
        ctx.grads = grads
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        from ..triton.conv import conv_input_grad, conv_weight_grad

        x, w = ctx.saved_tensors
        stride, padding, dilation, has_b = ctx.geom
        tf32 = _tf32(g.device)
        gx = gw = gb = None
        if ctx.grads == "cudnn":
            gx, gw = _grouped_grads(
                g, x, w, stride, padding, dilation, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            )
        else:
            if ctx.needs_input_grad[0]:
                gx = conv_input_grad(g, w, stride, padding, dilation, torch.empty_like(x), tf32)
            if ctx.needs_input_grad[1]:
                gw = conv_weight_grad(g, x, stride, padding, dilation, torch.empty_like(w), tf32)
        if has_b and ctx.needs_input_grad[2]:
            gb = g.sum((0, 2, 3)).view(w.shape[0], w.shape[1])
        return gx, gw, gb, None, None, None, None


def _grouped_grads(g, x, w, stride, padding, dilation, need_x: bool, need_w: bool):
    """The grouped convolution's input and weight gradients (cuDNN on CUDA: one ``convolution_backward`` with
    ``groups = n``, TF32 by ``torch.backends.cudnn.allow_tf32`` as everywhere). On the CPU (the Triton interpreter's
    tests) a strided 1 x 1 kernel goes through :func:`conv_cpu.conv2d`'s exact subsample path instead."""
    n, Cout, Cin, KH, KW = w.shape
    w2 = w.view(n * Cout, Cin, KH, KW)
    if takes_subsample(x, w2, stride):
        xs, ws = x.detach().requires_grad_(need_x), w2.detach().requires_grad_(need_w)
        with torch.enable_grad():
            out = conv2d(xs, ws, None, stride, padding, dilation, n)
        got = iter(torch.autograd.grad(out, [t for t, on in ((xs, need_x), (ws, need_w)) if on], g))
        gx, gw = (next(got) if need_x else None), (next(got) if need_w else None)
    else:
        gx, gw, _ = torch.ops.aten.convolution_backward(
            g, x, w2, None, list(stride), list(padding), list(dilation), False, [0, 0], n, [need_x, need_w, False]
        )
    return gx, (gw.view(w.shape) if gw is not None else None)


def client_conv2d(
    x: Tensor, w: Tensor, b: Tensor | None = None, stride=1, padding=0, dilation=1, *, impl: str = "grouped"
) -> Tensor:
    """Every client's convolution at once (see the module docstring). ValueError names a bad argument."""
    if impl not in IMPLS:
        raise ValueError(f"impl: one of {IMPLS}, got {impl!r}")
    if not (torch.is_tensor(x) and x.dim() == 4):
        raise ValueError(f"x: expected [B, n*Cin, H, W], got {tuple(x.shape) if torch.is_tensor(x) else type(x)}")
    if not (torch.is_tensor(w) and w.dim() == 5):
        raise ValueError(f"w: expected [n, Cout, Cin, KH, KW], got {tuple(w.shape) if torch.is_tensor(w) else type(w)}")
    n, Cout, Cin = w.shape[:3]
    if x.shape[1] != n * Cin:
        raise ValueError(f"x: has {x.shape[1]} channels, the {n} clients' weights take {n} x {Cin}")
    if b is not None and tuple(b.shape) != (n, Cout):
        raise ValueError(f"b: expected shape ({n}, {Cout}), got {tuple(b.shape)}")
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    OH, OW = out_size(x.shape[2], x.shape[3], w.shape[3:], stride, padding, dilation)
    if OH < 1 or OW < 1:
        raise ValueError(f"x: {tuple(x.shape[2:])} images are smaller than the kernel {tuple(w.shape[3:])}")
    if impl == "grouped":
        return conv2d(
            x,
            w.reshape(n * Cout, Cin, *w.shape[3:]),
            None if b is None else b.reshape(-1),
            stride,
            padding,
            dilation,
            n,
        )
    if x.dtype != torch.float32 or w.dtype != torch.float32:
        raise TypeError(f"x, w: impl={impl!r} computes in fp32, got {x.dtype} and {w.dtype} (use impl='grouped')")
    if impl == "gemm":
        return _GemmConv.apply(x, w, b, stride, padding, dilation)
    if not _backend.available("triton", x.device.type):
        why = _backend.interpreter_problem()
        raise ValueError(
            f"impl: {impl!r} needs a CUDA device (or TRITON_INTERPRET=1) and triton; x is on "
            f"{x.device.type}" + (f" ({why})" if why else "")
        )
    return _TritonConv.apply(x, w, b, stride, padding, dilation, "cudnn" if impl == "hybrid" else "triton")


__all__ = ["client_conv2d", "client_conv2d_reference", "IMPLS", "out_size"]
