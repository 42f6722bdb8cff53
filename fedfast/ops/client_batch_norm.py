"""BatchNorm of n clients at once with per-client statistics, masks and running buffers (the batched executor's
BatchNorm layer). :mod:`fedfast.ops.client_batch_norm_reference` is the specification; this is the same function
with the statistics taken once without autograd and an explicit backward.

Why not ``F.batch_norm`` over ``n*C`` channels alone: (1) a client's padding rows (its last partial minibatch) must
not enter its statistics, and (2) PyTorch's CPU forward for channels-last (NHWC, the layout the CPU convolutions
use) loses accuracy as a channel's mean grows against its spread (measured on the 2-core Intel Xeon VM,
[50, 48, 14, 14], std 0.5: 2.2e-6 max error at mean 0, 1.1e-5 at mean 3, 1.1e-4 at mean 30, against 4e-7 / 7e-7 / 3.8e-6
for NCHW); an untrained residual network amplified that to 1e-4 of its weights in one round (issue 46). Here the
statistics are two-pass (the mean, then the centred squares): 1.6e-7 from float64 in either layout.

The statistics are two-pass and shifted: each channel's first value is subtracted (one pass), the mean of the
shifted values taken, the centred values ``xhat`` formed in place, the mean of their squares; ``xhat`` scaled in
place is saved for the backward instead of x (the same memory). The backward is written out, exact for the
function as defined (padding rows included, whose outputs depend on the valid rows' statistics): with
``S1 = sum_all g`` and ``S2 = sum_all g * xhat``, ``gx = w * invstd * (g - valid * (S1 + xhat * S2) / N)``,
``gw = S2``, ``gb = S1``; its sums are ``torch.sum``'s (PyTorch's channels-last backward kernel sums ``g`` in fp32
with ~1e-5 error, 1e-7 here).

Bytes, with A the activation's size: forward ~9 A (reads x twice, the shifted temporary four times, writes it,
y), backward ~9 A (g three times, xhat twice, a temporary, gx), against PyTorch's ~3 A each way. Measured on
the 2-core Intel Xeon VM, [50, 640, 16, 16] NHWC fp32, forward + backward: 20 ms against PyTorch's 10 ms; the layers of
``benchmarks/bench_batch_norm.py``: 1.3 to 2.5x PyTorch's time (docs/benchmarks.md, "BatchNorm"). A fused CPU
kernel is the way to PyTorch's speed at this accuracy.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .client_batch_norm_reference import update_running_


def _c(v: Tensor) -> Tensor:
    """[n, C] -> [1, n, C, 1]: per client and channel, broadcast over rows and positions."""
    return v[None, :, :, None]


def _view4(x: Tensor, n: int) -> Tensor:
    """``[B, n*C, *spatial]`` as ``[B, n, C, S]`` (a view for NCHW and NHWC tensors)."""
    B, nC = x.shape[0], x.shape[1]
    try:
        return x.view(B, n, nC // n, -1)
    except RuntimeError:
        return x.reshape(B, n, nC // n, -1)


def _per_channel(v: Tensor, ndim: int) -> Tensor:
    """[n*C] -> broadcastable over [B, n*C, *spatial]."""
    return v.reshape(1, -1, *([1] * (ndim - 2)))


class _BatchStatsNorm(torch.autograd.Function):
    """``(y, mean, var)``: ``y = xhat * w + b`` with ``xhat = (x - mean) / sqrt(var + eps)`` and ``mean`` / ``var``
    [n, C] the batch statistics of ``x [B, n*C, *spatial]`` over its valid rows (``m`` [B, n, 1, 1] or None: all;
    biased var); the gradient of y includes their dependence on x (module docstring). Saves ``xhat`` (the size of
    x, which the backward does not need)."""

    @staticmethod
    def forward(ctx, x, n, w, b, m, eps):
        x4 = _view4(x, n)
        B, _, C, S = x4.shape
        # shifted by each channel's first value (row 0 is always a valid row): the mean of x - shift is of the
        # data's spread, not its offset, so its rounding is too (fp32 sums of a channel at mean 30 +- 0.5: 5e-6
        # of error in the mean itself, 1e-8 shifted)
        xhat = x4 - x4[:1, :, :, :1]
        if m is None:
            cnt = torch.full((n,), float(B * S), dtype=x.dtype, device=x.device)
            d = xhat.mean((0, 3))
            xhat.sub_(_c(d))
            var = (xhat * xhat).mean((0, 3))
        else:
            cnt = m.sum((0, 2, 3)) * S
            d = (xhat * m).sum((0, 3)) / cnt[:, None]
            xhat.sub_(_c(d))
            var = (xhat * xhat).mul_(m).sum((0, 3)) / cnt[:, None]
        mean = x4[0, :, :, 0] + d
        invstd = torch.rsqrt(var + eps)
        xhat = _unview(xhat.mul_(_c(invstd)), x.shape)  # y is made in x's shape: a new tensor, not a view
        d = x.dim()
        if w is not None and b is not None:
            y = torch.addcmul(_per_channel(b, d), xhat, _per_channel(w, d))
        elif w is not None:
            y = xhat * _per_channel(w, d)
        elif b is not None:
            y = xhat + _per_channel(b, d)
        else:
            y = xhat.clone()
        ctx.save_for_backward(xhat, w, invstd, m, cnt)
        ctx.n, ctx.has_b = n, b is not None
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, _gmean, _gvar):
        xhat, w, invstd, m, cnt = ctx.saved_tensors
        need = ctx.needs_input_grad
        n = ctx.n
        g4, xhat = _view4(g, n), _view4(xhat, n)
        s1 = g4.sum((0, 3))
        s2 = (g4 * xhat).sum((0, 3))
        gx = None
        if need[0]:
            k = invstd if w is None else invstd * w.view(n, -1)
            if m is None:  # gx = k (g - s1/N - xhat s2/N)
                gx = torch.addcmul(
                    torch.addcmul(_c(-k * s1 / cnt[:, None]), xhat, _c(-k * s2 / cnt[:, None])), g4, _c(k)
                )
            else:  # the correction on the valid rows only
                corr = torch.addcmul(_c(s1 / cnt[:, None]), xhat, _c(s2 / cnt[:, None])).mul_(m)
                gx = (g4 - corr).mul_(_c(k))
            gx = _unview(gx, g.shape)
        gw = s2.reshape(-1) if w is not None and need[2] else None
        gb = s1.reshape(-1) if ctx.has_b and need[3] else None
        return gx, None, gw, gb, None, None


def _unview(t: Tensor, shape) -> Tensor:
    """``[B, n, C, S]`` back to ``shape`` (a view where the strides allow: NCHW and NHWC)."""
    try:
        return t.view(shape)
    except RuntimeError:
        return t.reshape(shape)


def client_batch_norm(
    x: Tensor,
    n: int,
    weight: Tensor | None,
    bias: Tensor | None,
    *,
    valid: Tensor | None = None,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    num_batches_tracked: Tensor | None = None,
    use_batch_stats: bool = True,
    update: bool = False,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """BatchNorm of n clients on ``x [B, n*C, *spatial]`` (the definition:
    :mod:`fedfast.ops.client_batch_norm_reference`): ``weight`` / ``bias`` ``[n, C]`` or None; ``valid [n, B]``
    (bool; None: every row); the running buffers ``[n, C]`` (``num_batches_tracked [n]``) are read when not
    ``use_batch_stats`` and updated in place when ``update``. Returns ``y`` shaped (and laid out) as ``x``."""
    if x.dim() < 2 or x.shape[1] % n:
        raise ValueError(f"x: expected [B, n*C, ...] with n = {n}, got shape {tuple(x.shape)}")
    if (update or not use_batch_stats) and (running_mean is None or running_var is None):
        raise ValueError("running_mean, running_var: needed to update or to use the running statistics")
    w = None if weight is None else weight.reshape(-1)
    b = None if bias is None else bias.reshape(-1)
    if not use_batch_stats:
        scale = torch.rsqrt(running_var.reshape(-1).to(x.dtype) + eps)
        if w is not None:
            scale = scale * w
        shift = -running_mean.reshape(-1).to(x.dtype) * scale
        if b is not None:
            shift = shift + b
        return torch.addcmul(_per_channel(shift, x.dim()), x, _per_channel(scale, x.dim()))
    m = None if valid is None else valid.t().to(x.dtype)[:, :, None, None]
    y, mean, var = _BatchStatsNorm.apply(x, n, w, b, m, eps)
    if update:
        cnt = (
            valid.sum(1).to(x.dtype)
            if valid is not None
            else torch.full((n,), float(x.shape[0]), dtype=x.dtype, device=x.device)
        ) * (x[0, 0].numel())
        update_running_(mean, var, cnt, running_mean, running_var, num_batches_tracked, momentum)
    return y
