"""A linear layer fused with the distillation loss, in row chunks: for large vocabularies (language-model
distillation), where the ``[R, V]`` logits and their gradient are the largest tensors of a step.

``linear_distill(h, W, target, teacher_logits=..., bias=b)`` is the value of
``distill(h @ W.T + b, teacher, target, ...)`` (:func:`fedfast.ops.distill`, same formula), computed ``chunk_rows``
rows at a time: each chunk's logits are formed, the fused row op gives the chunk's loss and its gradient in the
logits, and that gradient is folded at once into the gradients of ``h``, ``W`` and ``b`` (``g @ W``, ``W``'s
gradient accumulated in place by one GEMM per chunk, ``g.sum(0)``) and dropped. The teacher is given as logits
``[..., V]`` or as its hidden states and output layer (``teacher_hidden`` ``[..., Ht]``, ``teacher_weight``
``[V, Ht]``, ``teacher_bias``), whose logits are then formed chunk by chunk too. ``hidden`` may have any leading
dimensions (``[B, T, H]`` with ``[B, T]`` targets: a language model's), flattened to rows.

Reductions: ``"mean"`` (over the rows whose target is not ``ignore_index``; with ``segments``, within each segment,
the segment means summed) and ``"sum"``, computed as Liger-Kernel's fused linear cross-entropy is: the gradients
are formed in the forward and the backward scales them (in place: the weight's gradient is written once, and with
nothing else holding it autograd takes it as ``W.grad``); ``"none"`` (per-row losses, shaped as the target) and
``"segment"`` (per-segment means ``[num_segments]``): the forward forms the losses only and the backward runs the
chunks again with each row's incoming gradient (twice the forward's logits GEMMs). Without anything to
differentiate (``torch.no_grad()``, or no input requiring grad) no gradient is formed.

Memory beyond the inputs and the gradients: one chunk's logits, row gradient and teacher logits. Chunks: a quarter
of the rows by default (``default_chunk_rows``): a quarter of a logits buffer for the chunk's logits (over which
the row op writes their gradient), a quarter more for the teacher's logits when it is given as hidden states, and
GEMMs over 1024 rows at 4096 rows, where the weight gradient's per-chunk update stays compute-bound (chunks of 32
rows made it memory-bound: 405 s at 4096 x 4096 x 128,000).

Composes with ``torch.compile(fullgraph=True)``, ``torch.export`` and ``torch.jit.trace`` (custom ops
``fedfast::linear_distill_total`` / ``_rows`` / ``_rows_backward`` with fake kernels and registered autograd; an
exported or traced graph forms the gradient of every floating input, as it cannot know which will require grad
when it runs) and with ``torch.func`` (``grad``, ``vmap`` over models each with its own weight, data and labels:
one model's chunks after another). ``create_graph=True`` gives the right first derivative; a second derivative is
refused when taken. Not supported, refused by name: a teacher that receives gradients (``detach_teacher=False``)
and second derivatives (``double_backward=True``): use the unfused layer with :class:`fedfast.nn.KDLoss`.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from . import _backend, _validate
from .distill import DistillRowsArgs, _backend_rows, _loss_dtype, row_scale_torch
from .distill_options import (
    DistillTerms,
    check_class_weight,
    check_options,
    check_teacher_vocab,
    option_rows_grad,
    option_scales,
)

_FIRST_ORDER = (
    "linear_distill: the fused backward is first-order (its gradients are computed in the forward); "
    "for a second derivative use the unfused layer and fedfast.nn.KDLoss(double_backward=True)"
)
_REDUCTIONS = ("mean", "sum", "none", "segment")


def default_chunk_rows(R: int, V: int) -> int:
    """Rows per chunk: a quarter of the rows (a chunk's logits, over which the row op writes their gradient, and
    the teacher's logits when given as hidden states: at most half a logits buffer), at least 1."""
    return max(1, -(-R // 4))


def _heads_in_state_dtype(h, W, b, th, tW, tb):
    """The output layers in their hidden states' dtype for the products (an fp32 head on bf16 states, the teacher's
    as the student's): ``(W, b, tW, tb)``; the gradients are returned in the parameters' own dtypes."""

    def like(x, ref):
        return x if x is None or x.dtype == ref.dtype else x.to(ref.dtype)

    return like(W, h), like(b, h), like(tW, th), like(tb, th)


def _pass(
    h,
    W,
    b,
    t,
    th,
    tW,
    tb,
    target,
    scale,
    tau: float,
    ce_weight: float,
    kd_weight: float,
    not_true: bool,
    ignore_index: int,
    chunk: int,
    backend: str,
    class_weight: Optional[Tensor],
    ext: list[float],
    need_h: bool,
    need_W: bool,
    need_b: bool,
    rows: bool,
):
    """One pass over the row chunks: ``(loss, gh, gW, gb)`` with ``loss`` the scaled rows' sum (or the rows [R],
    ``rows``) and the gradients of ``sum_i scale_i L_i`` (None where not needed). ``gh`` is written chunk by chunk,
    ``gW`` accumulated in place (fp32; the weight's dtype after, one conversion for a half-precision weight);
    :func:`_pass_functional` is the same pass out of place (tensors a torch.func transform wraps)."""
    R, V = h.shape[0], W.shape[0]
    acc = _loss_dtype(h)
    gh = torch.empty_like(h) if need_h else None
    gW = torch.zeros(W.shape, dtype=acc, device=W.device) if need_W else None
    gb = torch.zeros(V, dtype=acc, device=W.device) if need_b else None
    out = torch.empty(R, dtype=acc, device=h.device) if rows else torch.zeros((), dtype=acc, device=h.device)
    # the options' path: the hard and soft terms apart, scaled (rows [2, R], or their sums [2])
    terms = None if not ext else (h.new_empty((2, R), dtype=acc) if rows else h.new_zeros(2, dtype=acc))
    Wa, ba, tW, tb = _heads_in_state_dtype(h, W, b, th, tW, tb)
    n0 = min(chunk, R)
    # one chunk's logits (and teacher logits) buffer for the whole pass, written by the GEMMs (out=): no fresh
    # allocation, and no page faults, per chunk; on the C++ backend the row op writes dL/dz over the logits
    zbuf = h.new_empty((n0, V))
    tbuf = th.new_empty((n0, tW.shape[0])) if t is None and R else None
    for r0 in range(0, R, chunk):
        r1 = min(R, r0 + chunk)
        hc = h[r0:r1]
        # the bias inside the product (addmm), as F.linear adds it: one rounding of the logits in a half dtype
        z = torch.mm(hc, Wa.T, out=zbuf[: r1 - r0]) if b is None else torch.addmm(ba, hc, Wa.T, out=zbuf[: r1 - r0])
        tc = _teacher_chunk(t, th, tW, tb, tbuf, r0, r1)
        # the C++ kernel writes the gradient over the chunk's logits (no second [chunk, V] buffer)
        loss_rows, g, parts = _chunk_rows(
            backend,
            z,
            tc,
            target[r0:r1].contiguous(),
            scale[..., r0:r1].contiguous(),
            tau,
            ce_weight,
            kd_weight,
            not_true,
            ignore_index,
            class_weight,
            ext,
            in_place=backend == "cpu",
            need_grad=need_h or need_W or need_b,
        )
        if rows:
            out[r0:r1] = loss_rows
            if terms is not None:
                terms[:, r0:r1] = parts
        else:
            out = out + loss_rows.sum()
            if terms is not None:
                terms = terms + parts.sum(1)
        _add_grads(g, hc, Wa, (gh, gW, gb), r0, r1, acc)
        del g, z, tc
    if gW is not None and gW.dtype != W.dtype:
        gW = gW.to(W.dtype)
    if gb is not None and gb.dtype != b.dtype:
        gb = gb.to(b.dtype)
    return out, gh, gW, gb, terms


def _teacher_chunk(t, th, tW, tb, tbuf, r0: int, r1: int) -> Tensor:
    """Rows ``r0:r1`` of the teacher's logits: given (``t``), or formed by its head into ``tbuf``."""
    if t is not None:
        return t[r0:r1].contiguous()
    out = tbuf[: r1 - r0]
    return torch.mm(th[r0:r1], tW.T, out=out) if tb is None else torch.addmm(tb, th[r0:r1], tW.T, out=out)


def _add_grads(g: Tensor, hc: Tensor, Wa: Tensor, grads: tuple, r0: int, r1: int, acc) -> None:
    """One chunk's share of the gradients ``(gh, gW, gb)`` (None where not needed) from its logits' gradient ``g``:
    gh's rows written, gW and gb accumulated in place (no weight-sized temporary per chunk)."""
    gh, gW, gb = grads
    if gh is not None:
        if gh.dtype == Wa.dtype == g.dtype:
            torch.mm(g, Wa, out=gh[r0:r1])
        else:
            gh[r0:r1] = (g.to(Wa.dtype) @ Wa).to(gh.dtype)
    if gW is not None:
        gW.addmm_(g.to(acc).T, hc.to(acc))
    if gb is not None:
        gb += g.to(acc).sum(0)


def _chunk_rows(
    backend,
    z,
    tc,
    yc,
    sc,
    tau,
    ce_weight,
    kd_weight,
    not_true,
    ignore_index,
    class_weight,
    ext,
    in_place=False,
    need_grad=True,
):
    """One chunk's scaled loss rows ``[n]``, their gradient in the logits ``[n, V]`` and, on the options' path, the
    scaled hard and soft terms ``[2, n]`` (None on the fused kernels' path)."""
    if not ext:
        args = DistillRowsArgs(
            student=z,
            teacher=tc,
            target=yc,
            row_scale=sc,
            tau=float(tau),
            ce_weight=float(ce_weight),
            kd_weight=float(kd_weight),
            ignore_index=int(ignore_index),
            not_true=bool(not_true),
            in_place=bool(in_place),
        )
        loss_rows, g = _backend_rows(backend, args)
        return loss_rows, g, None
    beta, eps, cap, tcap, pad = ext
    hard, soft, g = option_rows_grad(
        z,
        tc,
        yc,
        sc,
        tau=tau,
        ce_weight=ce_weight,
        kd_weight=kd_weight,
        not_true=not_true,
        ignore_index=ignore_index,
        class_weight=class_weight,
        jsd_beta=beta,
        label_smoothing=eps,
        softcap=cap,
        teacher_softcap=tcap,
        teacher_vocab="pad" if pad else "drop",
        need_grad=need_grad,
    )
    parts = torch.stack([hard * sc[0], soft * sc[1]])
    return ce_weight * parts[0] + kd_weight * parts[1], g, parts


def _pass_functional(
    h,
    W,
    b,
    t,
    th,
    tW,
    tb,
    target,
    scale,
    tau,
    ce_weight,
    kd_weight,
    not_true,
    ignore_index,
    chunk,
    backend,
    class_weight,
    ext,
    need_h,
    need_W,
    need_b,
    rows,
):
    """:func:`_pass` out of place, for a backward under ``torch.func`` (whose saved tensors may be batched)."""
    acc = _loss_dtype(h)
    R = h.shape[0]
    Wa, ba, tW, tb = _heads_in_state_dtype(h, W, b, th, tW, tb)
    outs, ghs, gW, gb, parts_all = [], [], None, None, []
    for r0 in range(0, R, chunk):
        r1 = min(R, r0 + chunk)
        hc = h[r0:r1]
        z = hc @ Wa.T if b is None else torch.addmm(ba, hc, Wa.T)
        if t is not None:
            tc = t[r0:r1]
        else:
            tc = th[r0:r1] @ tW.T if tb is None else torch.addmm(tb, th[r0:r1], tW.T)
        loss_rows, g, parts = _chunk_rows(
            backend,
            z,
            tc,
            target[r0:r1],
            scale[..., r0:r1],
            tau,
            ce_weight,
            kd_weight,
            not_true,
            ignore_index,
            class_weight,
            ext,
        )
        outs.append(loss_rows if rows else loss_rows.sum())
        if parts is not None:
            parts_all.append(parts if rows else parts.sum(1))
        if need_h:
            ghs.append((g.to(Wa.dtype) @ Wa).to(h.dtype))
        if need_W:
            d = g.to(acc).T @ hc.to(acc)
            gW = d if gW is None else gW + d
        if need_b:
            d = g.to(acc).sum(0)
            gb = d if gb is None else gb + d
    out = torch.cat(outs) if rows else torch.stack(outs).sum()
    gh = torch.cat(ghs) if need_h else None
    terms = None if not parts_all else (torch.cat(parts_all, 1) if rows else torch.stack(parts_all).sum(0))
    return out, gh, None if gW is None else gW.to(W.dtype), None if gb is None else gb.to(b.dtype), terms


def _vmap_loop(fn, info, in_dims, inputs, n_out: int):
    """A vmap rule for the chunked Functions: each model's slice in turn (the chunk loop is the work; a batched
    weight would make each GEMM a batch of them anyway), the results stacked along dim 0."""
    per = []
    for i in range(info.batch_size):
        args = [x.select(d, i) if d is not None else x for x, d in zip(inputs[:9], in_dims[:9], strict=True)]
        out = fn(*args, *inputs[9:])
        per.append(out if isinstance(out, tuple) else (out,))
    stacked = tuple(None if per[0][k] is None else torch.stack([p[k] for p in per]) for k in range(n_out))
    dims = tuple(None if x is None else 0 for x in stacked)
    return (stacked, dims) if n_out > 1 else (stacked[0], dims[0])


def _empty(x: Tensor | None, like: Tensor) -> Tensor:
    """A custom op returns tensors only: a gradient not formed is an empty tensor."""
    return x if x is not None else like.new_empty(0)


# -- torch.compile / torch.export / torch.jit.trace: custom ops with fake kernels and registered autograd ----------
@torch.library.custom_op("fedfast::linear_distill_total", mutates_args=())
def _total_op(
    h: Tensor,
    W: Tensor,
    b: Optional[Tensor],
    t: Optional[Tensor],
    th: Optional[Tensor],
    tW: Optional[Tensor],
    tb: Optional[Tensor],
    target: Tensor,
    scale: Tensor,
    tau: float,
    ce_weight: float,
    kd_weight: float,
    not_true: bool,
    ignore_index: int,
    chunk: int,
    backend: str,
    class_weight: Optional[Tensor],
    ext: list[float],
    need_h: bool,
    need_W: bool,
    need_b: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    loss, gh, gW, gb, terms = _pass(
        h,
        W,
        b,
        t,
        th,
        tW,
        tb,
        target,
        scale,
        tau,
        ce_weight,
        kd_weight,
        not_true,
        ignore_index,
        chunk,
        backend,
        class_weight,
        ext,
        need_h,
        need_W,
        need_b,
        rows=False,
    )
    return loss, _empty(gh, h), _empty(gW, W), _empty(gb, h), _empty(terms, h)


@_total_op.register_fake
def _(
    h,
    W,
    b,
    t,
    th,
    tW,
    tb,
    target,
    scale,
    tau,
    ce_weight,
    kd_weight,
    not_true,
    ignore_index,
    chunk,
    backend,
    class_weight,
    ext,
    need_h,
    need_W,
    need_b,
):
    return (
        h.new_empty((), dtype=_loss_dtype(h)),
        torch.empty_like(h) if need_h else h.new_empty(0),
        torch.empty_like(W) if need_W else W.new_empty(0),
        torch.empty_like(b) if need_b and b is not None else h.new_empty(0),
        h.new_empty((2,), dtype=_loss_dtype(h)) if ext else h.new_empty(0),
    )


def _total_setup(ctx, inputs, output):
    ctx.save_for_backward(*output[1:4])
    ctx.need = inputs[-3:]
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zeros shaped as gh and gW for the gradient outputs


def _total_backward(ctx, grad_loss, *_):
    if torch.is_grad_enabled():
        raise RuntimeError(_FIRST_ORDER)
    if grad_loss is None:
        return (None,) * 21
    gh, gW, gb = ctx.saved_tensors
    out = [g * grad_loss.to(g.dtype) if need else None for g, need in zip((gh, gW, gb), ctx.need, strict=True)]
    return (out[0], out[1], out[2]) + (None,) * 18


_total_op.register_autograd(_total_backward, setup_context=_total_setup)


@torch.library.custom_op("fedfast::linear_distill_rows_backward", mutates_args=())
def _rows_backward_op(
    grad_scale: Tensor,
    h: Tensor,
    W: Tensor,
    b: Optional[Tensor],
    t: Optional[Tensor],
    th: Optional[Tensor],
    tW: Optional[Tensor],
    tb: Optional[Tensor],
    target: Tensor,
    tau: float,
    ce_weight: float,
    kd_weight: float,
    not_true: bool,
    ignore_index: int,
    chunk: int,
    backend: str,
    class_weight: Optional[Tensor],
    ext: list[float],
    need_h: bool,
    need_W: bool,
    need_b: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    _, gh, gW, gb, _terms = _pass(
        h,
        W,
        b,
        t,
        th,
        tW,
        tb,
        target,
        grad_scale,
        tau,
        ce_weight,
        kd_weight,
        not_true,
        ignore_index,
        chunk,
        backend,
        class_weight,
        ext,
        need_h,
        need_W,
        need_b,
        rows=False,
    )
    return _empty(gh, h), _empty(gW, W), _empty(gb, h)


@_rows_backward_op.register_fake
def _(
    grad_scale,
    h,
    W,
    b,
    t,
    th,
    tW,
    tb,
    target,
    tau,
    ce_weight,
    kd_weight,
    not_true,
    ignore_index,
    chunk,
    backend,
    class_weight,
    ext,
    need_h,
    need_W,
    need_b,
):
    return (
        torch.empty_like(h) if need_h else h.new_empty(0),
        torch.empty_like(W) if need_W else W.new_empty(0),
        torch.empty_like(b) if need_b and b is not None else h.new_empty(0),
    )


@torch.library.custom_op("fedfast::linear_distill_rows", mutates_args=())
def _rows_op(
    h: Tensor,
    W: Tensor,
    b: Optional[Tensor],
    t: Optional[Tensor],
    th: Optional[Tensor],
    tW: Optional[Tensor],
    tb: Optional[Tensor],
    target: Tensor,
    scale: Tensor,
    tau: float,
    ce_weight: float,
    kd_weight: float,
    not_true: bool,
    ignore_index: int,
    chunk: int,
    backend: str,
    class_weight: Optional[Tensor],
    ext: list[float],
    need_h: bool,
    need_W: bool,
    need_b: bool,
) -> tuple[Tensor, Tensor]:
    out, _, _, _, terms = _pass(
        h,
        W,
        b,
        t,
        th,
        tW,
        tb,
        target,
        scale,
        tau,
        ce_weight,
        kd_weight,
        not_true,
        ignore_index,
        chunk,
        backend,
        class_weight,
        ext,
        False,
        False,
        False,
        rows=True,
    )
    return out, _empty(terms, h)


@_rows_op.register_fake
def _(
    h,
    W,
    b,
    t,
    th,
    tW,
    tb,
    target,
    scale,
    tau,
    ce_weight,
    kd_weight,
    not_true,
    ignore_index,
    chunk,
    backend,
    class_weight,
    ext,
    need_h,
    need_W,
    need_b,
):
    acc = _loss_dtype(h)
    return h.new_empty((h.shape[0],), dtype=acc), (h.new_empty((2, h.shape[0]), dtype=acc) if ext else h.new_empty(0))


def _rows_setup(ctx, inputs, output):
    h, W, b, t, th, tW, tb, target, scale = inputs[:9]
    ctx.save_for_backward(h, W, b, t, th, tW, tb, target, scale)
    ctx.args = inputs[9:]
    ctx.mark_non_differentiable(output[1])


def _rows_backward(ctx, grad_rows, *_):
    if torch.is_grad_enabled():
        raise RuntimeError(_FIRST_ORDER)
    h, W, b, t, th, tW, tb, target, scale = ctx.saved_tensors
    *args, need_h, need_W, need_b = ctx.args
    gh, gW, gb = _rows_backward_op(
        grad_rows.to(scale.dtype) * scale, h, W, b, t, th, tW, tb, target, *args, need_h, need_W, need_b
    )
    return ((gh if need_h else None), (gW if need_W else None), (gb if need_b else None)) + (None,) * 18


_rows_op.register_autograd(_rows_backward, setup_context=_rows_setup)


# -- eager (and torch.func): autograd Functions without a custom op's dispatch, the gradients taken, not copied -------
def _refuse_forward_mode():
    raise NotImplementedError(
        "linear_distill (LinearKDLoss): forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) is not "
        "supported: the fused op forms reverse-mode gradients only. Use reverse mode (backward, torch.func.grad, "
        "vjp), or the unfused layer: KDLoss on F.linear(hidden, weight, bias), which supports jvp"
    )


class _Total(torch.autograd.Function):
    """Eager ``sum_i scale_i L_i`` with the gradients formed in the forward. The backward scales them in place and
    hands them on with no other reference (``W.grad`` is then that tensor: the weight gradient written once); with
    the graph kept (``retain_graph``) or under a ``torch.func`` transform it scales copies."""

    @staticmethod
    def forward(
        h,
        W,
        b,
        t,
        th,
        tW,
        tb,
        target,
        scale,
        tau,
        ce_weight,
        kd_weight,
        not_true,
        ignore_index,
        chunk,
        backend,
        class_weight,
        ext,
        need_h,
        need_W,
        need_b,
    ):
        return _pass(
            h,
            W,
            b,
            t,
            th,
            tW,
            tb,
            target,
            scale,
            tau,
            ce_weight,
            kd_weight,
            not_true,
            ignore_index,
            chunk,
            backend,
            class_weight,
            ext,
            need_h,
            need_W,
            need_b,
            rows=False,
        )

    @staticmethod
    def vmap(info, in_dims, *inputs):
        return _vmap_loop(_Total.forward, info, in_dims, inputs, 5)

    @staticmethod
    def jvp(ctx, *tangents):
        _refuse_forward_mode()

    @staticmethod
    def setup_context(ctx, inputs, output):
        grads = [g for g in output[1:4] if g is not None]
        ctx.mark_non_differentiable(*grads, *([] if output[4] is None else [output[4]]))
        ctx.set_materialize_grads(False)  # else autograd hands the backward zeros shaped as gh and gW: a weight's worth
        ctx.transformed = _backend.functorch_active(*inputs[:2])
        ctx.anchors = [x for x, need in zip(inputs[:3], inputs[-3:], strict=True) if need]
        if ctx.transformed:
            ctx.save_for_backward(*grads)
            ctx.layout = [g is not None for g in output[1:4]]
        else:  # held by ctx alone, so that the backward can give them away
            ctx.grads = list(output[1:4])

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if grad_loss is None:  # not materialised: the loss itself received no gradient
            return (None,) * 21
        if ctx.transformed:
            saved = iter(ctx.saved_tensors)
            grads = [next(saved) if present else None for present in ctx.layout]
            return _scaled(grads, grad_loss, ctx.anchors) + (None,) * 18
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError(
                "linear_distill: backward through the graph a second time; pass retain_graph=True to the first backward"
            )
        keep = torch._C._autograd._get_current_graph_task_keep_graph() or torch.is_grad_enabled()
        if keep:
            ctx.grads = grads
            return _scaled(grads, grad_loss, ctx.anchors) + (None,) * 18
        return tuple(None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads) + (None,) * 18


class _Rows(torch.autograd.Function):
    """Eager per-row losses ``scale_i L_i`` (reductions "none" and "segment"); the backward runs the chunks again
    with each row's incoming gradient."""

    @staticmethod
    def forward(
        h,
        W,
        b,
        t,
        th,
        tW,
        tb,
        target,
        scale,
        tau,
        ce_weight,
        kd_weight,
        not_true,
        ignore_index,
        chunk,
        backend,
        class_weight,
        ext,
        need_h,
        need_W,
        need_b,
    ):
        out, _, _, _, terms = _pass(
            h,
            W,
            b,
            t,
            th,
            tW,
            tb,
            target,
            scale,
            tau,
            ce_weight,
            kd_weight,
            not_true,
            ignore_index,
            chunk,
            backend,
            class_weight,
            ext,
            False,
            False,
            False,
            rows=True,
        )
        return out, terms

    @staticmethod
    def vmap(info, in_dims, *inputs):
        return _vmap_loop(_Rows.forward, info, in_dims, inputs, 2)

    @staticmethod
    def jvp(ctx, *tangents):
        _refuse_forward_mode()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:9])
        ctx.args = list(inputs[9:])
        if output[1] is not None:
            ctx.mark_non_differentiable(output[1])
        ctx.functional = _backend.functorch_active(*inputs[:2])
        if ctx.functional:  # the saved tensors come back wrapped (and batched under vmap): torch ops, out of place
            ctx.args[6] = "reference"

    @staticmethod
    def backward(ctx, grad_rows, *_):
        h, W, b, t, th, tW, tb, target, scale = ctx.saved_tensors
        *args, need_h, need_W, need_b = ctx.args
        with torch.no_grad():  # out of place where a torch.func transform wraps the saved tensors
            _, gh, gW, gb, _terms = (_pass_functional if ctx.functional else _pass)(
                h,
                W,
                b,
                t,
                th,
                tW,
                tb,
                target,
                grad_rows.to(scale.dtype) * scale,
                *args,
                need_h,
                need_W,
                need_b,
                rows=False,
            )
        # create_graph=True or a torch.func transform: right, and refused once differentiated
        if torch.is_grad_enabled():
            anchors = [x for x, need in zip((h, W, b), (need_h, need_W, need_b), strict=True) if need]
            return _scaled([gh, gW, gb], None, anchors) + (None,) * 18
        return (gh, gW, gb) + (None,) * 18


class _FirstOrderOnly(torch.autograd.Function):
    """``g * s``, whose own derivative raises :data:`_FIRST_ORDER`: a backward that builds a graph
    (``create_graph=True``, ``torch.func.grad``) gets the right first derivative, and only differentiating it again
    (through ``anchors``, the inputs the gradient belongs to) fails, with the reason."""

    generate_vmap_rule = True

    @staticmethod
    def forward(g, s, *anchors):
        return g * s if s is not None else g.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(_FIRST_ORDER)


def _scaled(grads, s, anchors) -> tuple:
    """The gradients times the incoming gradient ``s`` (None: 1), new tensors tied to ``anchors`` when grad mode is
    on (see :class:`_FirstOrderOnly`)."""
    out = []
    for g in grads:
        if g is None:
            out.append(None)
        elif torch.is_grad_enabled():
            out.append(_FirstOrderOnly.apply(g, None if s is None else s.to(g.dtype), *anchors))
        else:
            out.append(g * s.to(g.dtype) if s is not None else g)
    return tuple(out)


def _check(student: tuple, teacher: tuple, options: tuple) -> tuple:
    """Shapes, dtypes, devices and options: ValueError / TypeError naming the argument. ``student``: ``(hidden,
    weight, target, bias)``; ``teacher``: ``(teacher_logits, teacher_hidden, teacher_weight, teacher_bias,
    teacher_vocab)``; ``options``: ``(kind, reduction, detach_teacher, double_backward)``. Returns (lead, H, V)."""
    hidden, weight, target, bias = student
    teacher_logits, teacher_hidden, teacher_weight, teacher_bias, teacher_vocab = teacher
    lead, H, V = _check_student(hidden, weight, target, bias)
    _check_options(*options)
    _check_teacher(lead, V, teacher_logits, teacher_hidden, teacher_weight, teacher_bias, teacher_vocab)
    dev = hidden.device
    for name, x in (
        ("weight", weight),
        ("bias", bias),
        ("teacher_logits", teacher_logits),
        ("teacher_hidden", teacher_hidden),
        ("teacher_weight", teacher_weight),
        ("teacher_bias", teacher_bias),
        ("target", target),
    ):
        if x is not None and x.device != dev:
            raise ValueError(f"{name}: on {x.device}, hidden is on {dev}")
    return lead, H, V


def _check_student(hidden, weight, target, bias) -> tuple:
    """The student's hidden states [..., H], head [V, H] (+ bias [V]) and labels [...]: ``(lead, H, V)``."""
    if not isinstance(hidden, Tensor) or hidden.dim() < 1 or not hidden.is_floating_point():
        raise ValueError(
            f"hidden: expected a floating [..., H] tensor, got "
            f"{tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__}"
        )
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"weight: expected a floating [V, H] tensor, got "
            f"{tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__}"
        )
    lead, H, V = tuple(hidden.shape[:-1]), hidden.shape[-1], weight.shape[0]
    if weight.shape[1] != H:
        raise ValueError(f"weight: expected [V, {H}] to match hidden [..., {H}], got {tuple(weight.shape)}")
    if V < 2:
        raise ValueError(f"weight: needs at least 2 output classes, got V={V}")
    if not isinstance(target, Tensor) or tuple(target.shape) != lead:
        raise ValueError(
            f"target: expected shape {lead} (hidden's leading dimensions), got "
            f"{tuple(target.shape) if isinstance(target, Tensor) else type(target).__name__}"
        )
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"bias: expected shape ({V},), got {tuple(bias.shape)}")
    return lead, H, V


def _check_options(kind, reduction, detach_teacher, double_backward) -> None:
    """The loss's kind and reduction; a fixed teacher and first-order gradients (what this op computes)."""
    if kind not in ("full", "not_true"):
        raise ValueError(f"kind: must be 'full' or 'not_true', got {kind!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: one of {_REDUCTIONS}, got {reduction!r}")
    if detach_teacher is not True:
        raise ValueError(
            "detach_teacher: linear_distill's teacher is a fixed target (its logits, or its hidden "
            "states and head, get no gradient); for mutual distillation use the unfused layer with "
            "fedfast.nn.KDLoss(detach_teacher=False)"
        )
    if double_backward is not False:
        raise ValueError("double_backward: " + _FIRST_ORDER.split(": ", 1)[1])


def _check_teacher(lead, V, teacher_logits, teacher_hidden, teacher_weight, teacher_bias, teacher_vocab) -> None:
    """The teacher: its logits [..., Vt], or its hidden states [..., Ht] with its head [Vt, Ht] (+ bias [Vt]),
    one of the two; ``Vt`` against ``V`` as ``teacher_vocab`` allows."""
    if (teacher_logits is None) == (teacher_hidden is None):
        raise ValueError(
            "teacher_logits / teacher_hidden: give the teacher's logits [..., V], or its hidden states "
            "with teacher_weight (and teacher_bias), not both"
        )
    if teacher_logits is not None:
        if teacher_logits.dim() != len(lead) + 1 or tuple(teacher_logits.shape[:-1]) != lead:
            raise ValueError(f"teacher_logits: expected {list(lead) + [V]}, got {tuple(teacher_logits.shape)}")
        check_teacher_vocab(V, teacher_logits.shape[-1], teacher_vocab, "teacher_logits")
        return
    if (
        teacher_weight is None
        or tuple(teacher_hidden.shape[:-1]) != lead
        or teacher_weight.dim() != 2
        or teacher_weight.shape[1] != teacher_hidden.shape[-1]
    ):
        raise ValueError(
            f"teacher_hidden / teacher_weight: expected {list(lead) + ['Ht']} and [{V}, Ht], got "
            f"{tuple(teacher_hidden.shape)} and "
            f"{None if teacher_weight is None else tuple(teacher_weight.shape)}"
        )
    Vt = teacher_weight.shape[0]
    check_teacher_vocab(V, Vt, teacher_vocab, "teacher_weight")
    if teacher_bias is not None and tuple(teacher_bias.shape) != (Vt,):
        raise ValueError(f"teacher_bias: expected shape ({Vt},), got {tuple(teacher_bias.shape)}")


def _autocast_dtype(hidden) -> torch.dtype | None:
    """The autocast dtype where ``torch.autocast`` is on for ``hidden``'s device, else None."""
    if not isinstance(hidden, Tensor) or not hidden.is_floating_point():
        return None
    kind = hidden.device.type
    try:
        on = torch.is_autocast_enabled(kind)
    except (TypeError, RuntimeError):  # a device type autocast does not know
        return None
    return torch.get_autocast_dtype(kind) if on else None


def linear_distill(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    teacher_logits: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    teacher_hidden: Tensor | None = None,
    teacher_weight: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    tau: float = 1.0,
    ce_weight: float = 1.0,
    kd_weight: float = 1.0,
    kind: str = "full",
    reduction: str = "mean",
    ignore_index: int = -100,
    segments: Tensor | None = None,
    num_segments: int | None = None,
    chunk_rows: int | None = None,
    backend: str | None = None,
    validate: str | None = None,
    detach_teacher: bool = True,
    double_backward: bool = False,
    jsd_beta: float = 0.0,
    label_smoothing: float = 0.0,
    class_weight: Tensor | None = None,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    teacher_vocab: str | None = None,
    return_terms: bool = False,
):
    """The fused linear + distillation loss (see the module docstring): a scalar ("mean", "sum"), per-row losses
    shaped as ``target`` ("none") or per-segment means (``"segment"``), differentiable in ``hidden``, ``weight``
    and ``bias``.

    Under ``torch.autocast`` it does what ``F.linear`` followed by the loss does there: the output layers' inputs
    (hidden states, weight, bias; the teacher's too) are cast to the autocast dtype, so the logits are formed in it,
    the loss is computed and accumulated in fp32 from them, and the gradients reach the fp32 parameters through the
    casts (the weight's gradient is summed over the chunks in fp32, then rounded once to the autocast dtype, as
    ``F.linear``'s is). Teacher logits given as such are read as they are.

    Liger-Kernel's options (:mod:`fedfast.ops.distill_options` has the formula): ``jsd_beta`` (0 forward KL, 1
    reverse KL, between the generalised JSD), ``label_smoothing`` and ``class_weight`` [V] on the hard term (as
    ``F.cross_entropy``'s), ``softcap`` / ``teacher_softcap`` (logits ``c * tanh(z / c)``), a teacher with more
    classes than the student (``teacher_vocab="drop"`` or ``"pad"``), and ``return_terms=True``: a
    :class:`DistillTerms` ``(loss, ce, kd)`` with the hard and soft terms reduced as the loss is (``loss = ce_weight
    * ce + kd_weight * kd``; the terms carry no gradient). Any of them runs the chunks through the closed-form
    PyTorch rows (:func:`fedfast.ops.distill_options.option_rows_grad`) in place of the fused kernels."""
    cast = _autocast_dtype(hidden)
    if cast is not None:  # F.linear's casts under autocast; the rest of the op runs with autocast off
        hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias = (
            _cast(x, cast) for x in (hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias)
        )
    off = torch.autocast(hidden.device.type, enabled=False) if cast is not None else contextlib.nullcontext()
    with off:
        beta, eps, cap, tcap, teacher_vocab = check_options(
            jsd_beta, label_smoothing, class_weight, softcap, teacher_softcap, teacher_vocab
        )
        if not isinstance(return_terms, bool):
            raise TypeError(f"return_terms: expected True or False, got {return_terms!r}")
        lead, H, V = _check(
            (hidden, weight, target, bias),
            (teacher_logits, teacher_hidden, teacher_weight, teacher_bias, teacher_vocab),
            (kind, reduction, detach_teacher, double_backward),
        )
        tau = _validate.check_tau("tau", tau)
        ce_weight, kd_weight = _validate.real("ce_weight", ce_weight), _validate.real("kd_weight", kd_weight)
        h = hidden.reshape(-1, H)
        R, dev = h.shape[0], hidden.device
        mode = _validate.mode_for(dev, validate)
        y, segments = _checked_rows(target.reshape(-1), segments, R, V, ignore_index, num_segments, reduction, mode)
        chunk = _chunk_size(chunk_rows, R, V)
        be = _backend.resolve_for(backend, dev.type, h.dtype)
        nod = lambda x: None if x is None else x.detach()  # noqa: E731
        t = nod(teacher_logits.reshape(R, -1)) if teacher_logits is not None else None
        th = nod(teacher_hidden.reshape(R, -1)) if teacher_hidden is not None else None
        Vt = teacher_logits.shape[-1] if teacher_logits is not None else teacher_weight.shape[0]
        ext = []
        if beta or eps or class_weight is not None or cap or tcap or Vt > V or return_terms:
            ext = [beta, eps, cap, tcap, float(teacher_vocab == "pad")]
            class_weight = check_class_weight(class_weight, V, dev, mode)
        scale = _row_scales(y, V, ignore_index, segments, num_segments, class_weight, reduction, _loss_dtype(h), ext)
        traced = torch.compiler.is_compiling() or torch.jit.is_tracing()
        need = _needed_grads(hidden, weight, bias)
        head = (h, weight, bias, t, th, nod(teacher_weight), nod(teacher_bias), y, scale)
        opts = (float(tau), float(ce_weight), float(kd_weight), kind == "not_true", int(ignore_index), int(chunk), be)
        args = (*head, *opts, None if class_weight is None else class_weight.detach(), ext, *need)
        if reduction in ("mean", "sum"):
            # torch.compile, torch.export, torch.jit.trace: the custom op
            loss, *_, terms = _total_op(*args) if traced else _Total.apply(*args)
            return DistillTerms(loss, terms[0], terms[1]) if return_terms else loss
        rows, terms = _rows_op(*args) if traced else _Rows.apply(*args)
        out = (rows, *(terms if return_terms else ()))
        out = _reduced(out, lead, reduction, segments, num_segments)
        return DistillTerms(*out) if return_terms else out[0]


def _row_scales(y, V: int, ignore_index: int, segments, num_segments, class_weight, reduction: str, acc, ext):
    """The rows' weights in the reduction: ``[R]`` (1 / the valid rows per segment for "mean" / "segment", else 1),
    or on the options' path (``ext``) the hard and soft terms' ``[2, R]`` (:func:`option_scales`: class weights)."""
    R, mean = y.shape[0], reduction in ("mean", "segment")
    if ext:
        limit = num_segments if num_segments is not None else R
        return option_scales(y, V, ignore_index, segments, limit, class_weight, mean, acc)
    return row_scale_torch(y, V, ignore_index, segments, acc) if mean else torch.ones(R, dtype=acc, device=y.device)


def _needed_grads(hidden, weight, bias) -> list:
    """Which of hidden, weight, bias get a gradient. torch.compile guards on requires_grad; an exported or traced
    graph is run later with whichever inputs require grad then, so it forms every gradient (unless grad mode was off
    when it was made)."""
    grad_on = torch.is_grad_enabled()
    fixed = torch.jit.is_tracing() or torch.compiler.is_exporting()
    return [grad_on and x is not None and (fixed or x.requires_grad) for x in (hidden, weight, bias)]


def _cast(x, dtype):
    """``x`` in ``dtype`` where it is a floating tensor of another dtype (autocast's cast of F.linear's inputs)."""
    return x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != dtype else x


def _checked_rows(y, segments, R: int, V: int, ignore_index: int, num_segments, reduction: str, mode) -> tuple:
    """``(labels [R], segments [R] or None)``, checked (``mode``: now, deferred into the graph, or off)."""
    dev = y.device
    _validate.check_target(y, R, V, ignore_index, dev, mode)
    if segments is not None:
        segments = segments.reshape(-1)
        _validate.check_segments(segments, R, dev, mode, num_segments)
    elif reduction == "segment":
        raise ValueError("reduction: 'segment' needs `segments`")
    return _validate.in_graph(y.contiguous(), segments, V, ignore_index, num_segments, mode)


def _chunk_size(chunk_rows, R, V: int) -> int:
    """Rows per chunk: ``chunk_rows`` (checked), or :func:`default_chunk_rows`."""
    if chunk_rows is None:  # (the row count may be a traced or symbolic size: not checked as a user's int)
        return default_chunk_rows(R, V)
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows: a positive int or None, got {chunk_rows!r}")
    return chunk_rows


def _reduced(out: tuple, lead: tuple, reduction: str, segments, num_segments) -> tuple:
    """Per-row results [R] as ``reduction`` returns them: shaped as the target ("none"), or per segment."""
    if reduction == "none":
        return tuple(x.reshape(lead) for x in out)
    S = _validate.segment_count(segments, num_segments)
    idx = segments.long().clamp(0, S - 1)
    return tuple(torch.zeros(S, dtype=x.dtype, device=x.device).index_add(0, idx, x) for x in out)


__all__ = ["linear_distill", "default_chunk_rows", "DistillTerms"]
