"""A linear layer fused with the distillation loss, in row chunks: for large vocabularies (language-model
distillation), where the ``[R, V]`` logits and their gradient are the largest tensors of a step.

``linear_distill(h, W, target, teacher_logits=..., bias=b)`` is the value of
``distill(h @ W.T + b, teacher, target, ...)`` (:func:`fedfast.ops.distill`, same formula and options), computed
``chunk_rows`` rows at a time: each chunk's logits are formed, the fused row op gives the chunk's loss and its
gradient in the logits, and that gradient is folded at once into the gradients of ``h``, ``W`` and ``b``
(``g @ W``, ``g.T @ h``, ``g.sum(0)``) and dropped. The teacher can be given as logits ``[R, V]`` or as its hidden
states and output layer (``teacher_hidden`` ``[R, Ht]``, ``teacher_weight`` ``[V, Ht]``, ``teacher_bias``), whose
logits are then formed chunk by chunk too. Peak memory beyond the inputs: the gradients of ``h``, ``W`` and ``b``
and one chunk's logits, gradient and teacher logits, never an ``[R, V]`` tensor. Like Liger-Kernel's fused linear
cross-entropy, the gradients are computed in the forward and the backward scales them.

Supported: ``kind`` "full" | "not_true", ``tau``, ``ce_weight``, ``kd_weight``, ``reduction`` "mean" (over the rows
whose target is not ``ignore_index``) | "sum". The teacher is a fixed target (no gradient reaches it). The backward
is first-order: differentiating the gradient again raises (use the unfused layer with
``fedfast.nn.KDLoss(double_backward=True)``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _backend, _validate
from ._rows import valid_rows
from .distill import _backend_rows, _loss_dtype

_FIRST_ORDER = ("linear_distill: the fused backward is first-order (its gradients are computed in the forward); "
                "for a second derivative use the unfused layer and fedfast.nn.KDLoss(double_backward=True)")


def default_chunk_rows(R: int, V: int) -> int:
    """Rows per chunk: about 2**22 logits (16 MB in fp32) per chunk, at least 1, at most R."""
    return max(1, min(R, (1 << 22) // max(V, 1)))


class _LinearDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, W, b, teacher_logits, th, tW, tb, target, tau, ce_weight, kd_weight, not_true, reduction,
                ignore_index, chunk, backend):
        R, V = h.shape[0], W.shape[0]
        acc = _loss_dtype(h)
        valid = valid_rows(target, V, ignore_index)
        scale = (1.0 / valid.sum().clamp_min(1).to(acc)) if reduction == "mean" else torch.ones((), dtype=acc,
                                                                                                 device=h.device)
        need_h, need_W, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and \
            ctx.needs_input_grad[2]
        gh = torch.zeros_like(h) if need_h else None
        gW = torch.zeros(W.shape, dtype=acc, device=W.device) if need_W else None
        gb = torch.zeros(V, dtype=acc, device=W.device) if need_b else None
        total = torch.zeros((), dtype=acc, device=h.device)
        for r0 in range(0, R, chunk):
            r1 = min(R, r0 + chunk)
            hc = h[r0:r1]
            z = hc @ W.T
            if b is not None:
                z = z + b
            if teacher_logits is not None:
                t = teacher_logits[r0:r1]
            else:
                t = th[r0:r1] @ tW.T
                if tb is not None:
                    t = t + tb
            t = t.detach().contiguous()
            rs = scale.expand(r1 - r0).contiguous()
            loss_rows, g = _backend_rows(backend, z.contiguous(), t, target[r0:r1].contiguous(), None, None, None,
                                         None, None, rs, tau, ce_weight, kd_weight, ignore_index, not_true, False)
            total = total + loss_rows.sum()
            if need_h:
                gh[r0:r1] = (g.to(W.dtype) @ W).to(h.dtype)
            if need_W:
                gW += g.to(acc).T @ hc.to(acc)
            if need_b:
                gb += g.to(acc).sum(0)
            del z, t, g
        ctx.save_for_backward(gh, None if gW is None else gW.to(W.dtype), None if gb is None else gb.to(b.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():
            raise RuntimeError(_FIRST_ORDER)
        gh, gW, gb = ctx.saved_tensors
        sc = (lambda g: None if g is None else g * grad_out.to(g.dtype))
        return (sc(gh), sc(gW), sc(gb)) + (None,) * 13


def linear_distill(hidden: Tensor, weight: Tensor, target: Tensor, teacher_logits: Tensor | None = None, *,
                   bias: Tensor | None = None, teacher_hidden: Tensor | None = None,
                   teacher_weight: Tensor | None = None, teacher_bias: Tensor | None = None, tau: float = 1.0,
                   ce_weight: float = 1.0, kd_weight: float = 1.0, kind: str = "full", reduction: str = "mean",
                   ignore_index: int = -100, chunk_rows: int | None = None, backend: str | None = None) -> Tensor:
    """The fused linear + distillation loss (see the module docstring); a scalar, differentiable in ``hidden``,
    ``weight`` and ``bias``."""
    for name, x, nd in (("hidden", hidden, 2), ("weight", weight, 2)):
        if not isinstance(x, Tensor) or x.dim() != nd or not x.is_floating_point():
            raise ValueError(f"{name}: expected a floating [{'R, H' if name == 'hidden' else 'V, H'}] tensor, got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    R, H = hidden.shape
    V = weight.shape[0]
    if weight.shape[1] != H:
        raise ValueError(f"weight: expected [V, {H}] to match hidden [R, {H}], got {tuple(weight.shape)}")
    if V < 2:
        raise ValueError(f"weight: needs at least 2 output classes, got V={V}")
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"bias: expected shape ({V},), got {tuple(bias.shape)}")
    if kind not in ("full", "not_true"):
        raise ValueError(f"kind: must be 'full' or 'not_true', got {kind!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction: 'mean' or 'sum' (a per-row or per-segment loss needs the [R, V] logits: use "
                         f"fedfast.nn losses on the layer's output), got {reduction!r}")
    _validate.check_tau("tau", tau)
    if (teacher_logits is None) == (teacher_hidden is None):
        raise ValueError("teacher_logits / teacher_hidden: give the teacher's logits [R, V], or its hidden states "
                         "with teacher_weight (and teacher_bias), not both")
    if teacher_logits is not None:
        if tuple(teacher_logits.shape) != (R, V):
            raise ValueError(f"teacher_logits: expected [{R}, {V}], got {tuple(teacher_logits.shape)}")
    else:
        if teacher_weight is None or teacher_hidden.dim() != 2 or teacher_hidden.shape[0] != R or \
                teacher_weight.dim() != 2 or teacher_weight.shape != (V, teacher_hidden.shape[1]):
            raise ValueError(f"teacher_hidden / teacher_weight: expected [{R}, Ht] and [{V}, Ht], got "
                             f"{tuple(teacher_hidden.shape)} and "
                             f"{None if teacher_weight is None else tuple(teacher_weight.shape)}")
        if teacher_bias is not None and tuple(teacher_bias.shape) != (V,):
            raise ValueError(f"teacher_bias: expected shape ({V},), got {tuple(teacher_bias.shape)}")
    dev = hidden.device
    for name, x in (("weight", weight), ("bias", bias), ("teacher_logits", teacher_logits),
                    ("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight),
                    ("teacher_bias", teacher_bias), ("target", target)):
        if x is not None and x.device != dev:
            raise ValueError(f"{name}: on {x.device}, hidden is on {dev}")
    _validate.check_target(target, R, V, ignore_index, dev, _validate.mode_for(dev, None))
    chunk = default_chunk_rows(R, V) if chunk_rows is None else int(chunk_rows)
    if chunk < 1:
        raise ValueError(f"chunk_rows: must be >= 1, got {chunk_rows!r}")
    be = _backend.resolve_for(backend, dev.type, hidden.dtype)
    nod = (lambda x: None if x is None else x.detach())
    return _LinearDistill.apply(hidden, weight, bias, nod(teacher_logits), nod(teacher_hidden), nod(teacher_weight),
                                nod(teacher_bias), target, float(tau), float(ce_weight), float(kd_weight),
                                kind == "not_true", reduction, int(ignore_index), chunk, be)


__all__ = ["linear_distill", "default_chunk_rows"]
