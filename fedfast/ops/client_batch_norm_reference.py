"""The specification of :func:`fedfast.ops.client_batch_norm`, in plain PyTorch autograd (float64-capable; it also
runs under ``torch.func.vmap``, which the engine's vmap executor needs).

BatchNorm of n clients at once, each with its own statistics, weights and running buffers, on activations in the
batched executor's grouped layout ``x [B, n*C, *spatial]`` (B rows of a minibatch, n clients' C channels side by
side; ``[B, n*C, H, W]`` after a grouped convolution, ``[B, n*F]`` for a dense layer), viewed as ``[B, n, C, S]``
with S the spatial positions. With ``valid [n, B]`` only a client's valid rows
(not the padding of its last partial minibatch) enter its statistics, as a per-client loop that never sees the
padding computes them:

* batch statistics (training, or a model without running statistics): ``mean_kc`` and the biased ``var_kc`` over
  the valid rows and the S positions (count ``N_k = S * valid_k.sum()``), two-pass (centred) for accuracy;
* running statistics (eval mode of a model that tracks them): ``running_mean`` / ``running_var``;
* ``y = (x - mean) / sqrt(var + eps) * weight + bias`` on every row (padding rows included: their values are
  finite and unused);
* ``update``: the running buffers as ``nn.BatchNorm``'s training forward leaves them, per client:
  ``num_batches_tracked += 1``; ``f = momentum`` (or ``1 / num_batches_tracked`` when ``momentum`` is None);
  ``running_mean = f * mean + (1 - f) * running_mean``; ``running_var = f * var * N_k / (N_k - 1) + (1 - f) *
  running_var`` (the unbiased variance).
"""

from __future__ import annotations

import torch
from torch import Tensor


def batch_stats(x: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(mean [n, C], biased var [n, C], count [n])`` of ``x [B, n, C, S]`` over its valid rows, two-pass
    (centred: no cancellation however large a channel's mean)."""
    B, n, C, S = x.shape
    if valid is None:
        cnt = torch.full((n,), float(B * S), dtype=x.dtype, device=x.device)
        mean = x.mean((0, 3))
        xc = x - mean[None, :, :, None]
        return mean, (xc * xc).mean((0, 3)), cnt
    m = valid.t().to(x.dtype)[:, :, None, None]  # [B, n, 1, 1]
    cnt = valid.sum(1).to(x.dtype) * S
    mean = (x * m).sum((0, 3)) / cnt[:, None]
    xc = (x - mean[None, :, :, None]) * m
    return mean, (xc * xc).sum((0, 3)) / cnt[:, None], cnt


def update_running_(
    mean: Tensor,
    var: Tensor,
    cnt: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    num_batches_tracked: Tensor | None,
    momentum: float | None,
) -> None:
    """``nn.BatchNorm``'s running-buffer update for each client, in place (see the module docstring)."""
    with torch.no_grad():
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
        if momentum is None:
            f = (1.0 / num_batches_tracked.to(mean.dtype))[:, None]
        else:
            f = momentum
        unbiased = var.detach() * (cnt / (cnt - 1).clamp_min(1))[:, None]
        running_mean.copy_(f * mean.detach().to(running_mean.dtype) + (1 - f) * running_mean)
        running_var.copy_(f * unbiased.to(running_var.dtype) + (1 - f) * running_var)


def client_batch_norm_reference(
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
    """See the module docstring: ``x [B, n*C, *spatial]``, ``weight`` / ``bias`` ``[n, C]`` or None, ``valid [n, B]``
    bool or None, running buffers ``[n, C]`` (``num_batches_tracked [n]``) updated in place when ``update``.
    Returns y shaped as x."""
    shape = x.shape
    x = x.reshape(shape[0], n, shape[1] // n, -1)
    if use_batch_stats:
        mean, var, cnt = batch_stats(x, valid)
        if update:
            update_running_(mean, var, cnt, running_mean, running_var, num_batches_tracked, momentum)
    else:
        mean, var = running_mean.to(x.dtype), running_var.to(x.dtype)
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias
    return (x * scale[None, :, :, None] + shift[None, :, :, None]).reshape(shape)
