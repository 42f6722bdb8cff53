"""A vmap-free batched forward for ``nn.Sequential`` models: n clients' models over their own inputs at once.

``torch.func.vmap`` of ``functional_call`` turns a convolution with per-client weights into a grouped
convolution, but moves the client dimension between layers with copies and builds the flat gradient of
per-parameter slices with a full-size zero fill per parameter. For a plain ``nn.Sequential`` of the layers
below this executor keeps the activations in the grouped layout ``[B, n*C, H, W]`` for the whole
convolutional part (convolution = one grouped ``conv2d``, GroupNorm = one GroupNorm with ``n*G`` groups,
ReLU/pooling/dropout elementwise on that layout) and ``[n, B, F]`` for the dense part (Linear = one
``baddbmm``), so the only layout changes are at the input and at the Flatten.

Supported layers: Conv2d (no dilation-specific restrictions; ``padding_mode='zeros'``), Linear, ReLU,
LeakyReLU, Tanh, Sigmoid, GELU, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d, Flatten (start_dim=1), Dropout,
GroupNorm, Identity, nested ``nn.Sequential``. Anything else (BatchNorm, residual models, custom modules):
:func:`plan` returns None and the caller uses vmap. Results equal the per-client modules up to floating
point summation order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_ELEMENTWISE = (nn.ReLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.Identity)
_POOL = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d)


def _leaves(module: nn.Module, prefix: str = ""):
    for name, m in module.named_children():
        full = f"{prefix}{name}"
        if isinstance(m, nn.Sequential):
            yield from _leaves(m, full + ".")
        else:
            yield full, m


def plan(module: nn.Module):
    """``[(name, layer), ...]`` if ``module`` is a Sequential this executor supports, else None."""
    if not isinstance(module, nn.Sequential):
        return None
    layers = list(_leaves(module))
    ok = (nn.Conv2d, nn.Linear, nn.Flatten, nn.Dropout, nn.GroupNorm) + _ELEMENTWISE + _POOL
    for _, m in layers:
        if not isinstance(m, ok):
            return None
        if isinstance(m, nn.Conv2d) and (m.padding_mode != "zeros" or isinstance(m.padding, str)):
            return None
        if isinstance(m, nn.Flatten) and (m.start_dim != 1 or m.end_dim != -1):
            return None
    if not layers:
        return None
    # ReLU then MaxPool2d == MaxPool2d then ReLU (max commutes with a non-decreasing map, and both orders send
    # the gradient to the window's first maximum when it is positive, nowhere otherwise): pooling first runs
    # the ReLU and its backward on a 4x smaller tensor.
    for i in range(len(layers) - 1):
        if type(layers[i][1]) is nn.ReLU and type(layers[i + 1][1]) is nn.MaxPool2d:
            layers[i], layers[i + 1] = layers[i + 1], layers[i]
    return layers


class _BatchedLinear(torch.autograd.Function):
    """``y_k = x_k w_k^T + b_k`` for n clients (x ``[n, B, in]``, w ``[n, out, in]``, b ``[n, out]``).

    Autograd of ``baddbmm(b, x, w.transpose(1, 2))`` forms d w as ``x^T g`` in the transposed ``[n, in, out]``
    layout and the flat gradient then copies it back with a transpose (for the FedAvg CNN's 3136x512 layer on
    2 CPU cores: a 64 MB strided copy, ~55 ms per step, plus a ~35 ms gemm on a transposed operand). Here
    the backward forms ``g^T x`` directly in w's own layout (~15 ms)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        wt = w.transpose(1, 2)
        return torch.bmm(x, wt) if b is None else torch.baddbmm(b[:, None, :], x, wt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = torch.bmm(g, w) if ctx.needs_input_grad[0] else None
        gw = torch.bmm(g.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        gb = g.sum(1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


class _NCHWForDense(torch.autograd.Function):
    """NHWC activations -> NCHW order for the Flatten before a Linear (its weights index C*H*W), with the
    gradient handed back in NHWC: otherwise the pooling backward before it receives an NCHW gradient and
    converts its 4x larger input and output instead (measured: ~15 ms per step for the FedAvg CNN)."""

    @staticmethod
    def forward(ctx, h):
        return h.contiguous()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        return g.contiguous(memory_format=torch.channels_last)


def batched_forward(layers, params: dict, x: Tensor, training: bool, features: nn.Module | None = None,
                    channels_last: bool | None = None):
    """Run ``layers`` (from :func:`plan`) for n clients: ``params[name.weight]`` is ``[n, *shape]``, ``x`` is
    ``[n, B, ...]``. Returns ``[n, B, out]`` (or ``(input of features [n, B, d], out)``)."""
    n, B = x.shape[0], x.shape[1]
    feat = None
    # CPU: oneDNN convolution and pooling are much faster in NHWC (a 2x2 max-pool: ~10x); a convolution whose
    # output is not NHWC anyway (grouped weights) is converted.
    cl = channels_last if channels_last is not None else x.device.type == "cpu"
    nhwc = torch.channels_last
    if x.dim() == 5:  # images: the grouped layout [B, n*C, H, W]
        h = x.transpose(0, 1).reshape(B, n * x.shape[2], x.shape[3], x.shape[4])
        if cl:
            h = h.contiguous(memory_format=nhwc)
            if h.shape[1] == 1:  # one channel: NCHW strides pass as NHWC and oneDNN would answer in NCHW
                h = h.as_strided(h.shape, (h.stride(0), 1, h.stride(2), 1))
        grouped = True
    else:
        h = x
        grouped = False
    for name, m in layers:
        if m is features:
            feat = h if not grouped else h.reshape(B, n, -1).transpose(0, 1)
        if isinstance(m, nn.Conv2d):
            w = params[f"{name}.weight"]
            b = params.get(f"{name}.bias")
            h = F.conv2d(h, w.reshape(n * w.shape[1], *w.shape[2:]), None if b is None else b.reshape(-1),
                         m.stride, m.padding, m.dilation, n * m.groups)
            if cl and not h.is_contiguous(memory_format=nhwc):
                h = h.contiguous(memory_format=nhwc)
        elif isinstance(m, nn.GroupNorm):
            w, b = params.get(f"{name}.weight"), params.get(f"{name}.bias")
            h = F.group_norm(h, n * m.num_groups, None if w is None else w.reshape(-1),
                             None if b is None else b.reshape(-1), m.eps)
        elif isinstance(m, nn.Flatten):
            if grouped:  # [B, n*C, H, W] -> [n, B, C*H*W]
                if cl and not h.is_contiguous():
                    h = _NCHWForDense.apply(h)
                h = h.reshape(B, n, -1).transpose(0, 1)
                grouped = False
            else:
                h = h.reshape(n, B, -1)
        elif isinstance(m, nn.Linear):
            w = params[f"{name}.weight"]
            b = params.get(f"{name}.bias")
            if grouped:
                raise ValueError("model: a Linear layer on image activations needs a Flatten before it")
            h = _BatchedLinear.apply(h, w, b)
        elif isinstance(m, nn.Dropout):
            h = F.dropout(h, m.p, training)
        else:  # elementwise and pooling act per channel: the grouped layout is already right
            h = m(h)
    if grouped:  # [B, n*C, H, W] -> [n, B, C, H, W]
        h = h.reshape(B, n, h.shape[1] // n, *h.shape[2:]).transpose(0, 1)
    return (feat, h) if features is not None else h
