"""The output layer fused with the distillation loss in row chunks (fedfast.ops.linear_distill, fedfast.nn.LinearKDLoss,
issue 36): equal to the unfused layer + KDLoss in value and in the gradients of hidden, weight and bias, at any chunk
size; the teacher as logits or as hidden states + its own head; memory without the [R, V] logits."""

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fedfast.nn as fnn
from fedfast import ops
from fedfast.ops import _backend

BACKENDS = ["reference"] + (["cpu"] if _backend.available("cpu", "cpu") else [])


def _case(dtype=torch.float64, R=11, H=6, V=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(R, H, generator=g, dtype=dtype)
    W = torch.randn(V, H, generator=g, dtype=dtype) * 0.5
    b = torch.randn(V, generator=g, dtype=dtype)
    th = torch.randn(R, 5, generator=g, dtype=dtype)
    tW = torch.randn(V, 5, generator=g, dtype=dtype)
    tb = torch.randn(V, generator=g, dtype=dtype)
    y = torch.randint(0, V, (R,), generator=g)
    y[4] = -100
    return h, W, b, th, tW, tb, y


def _grads(fn, *xs):
    xs = [x.clone().requires_grad_() for x in xs]
    out = fn(*xs)
    return out.detach(), torch.autograd.grad(out, xs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [1, 3, 4, 11, None])
@pytest.mark.parametrize("not_true", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_equals_the_unfused_layer_and_loss(backend, chunk, not_true, reduction):
    h, W, b, th, tW, tb, y = _case()
    t = th @ tW.T + tb
    fused = fnn.LinearKDLoss(
        tau=2.0, ce_weight=0.7, not_true=not_true, reduction=reduction, chunk_rows=chunk, backend=backend
    )
    plain = (
        fnn.NTDLoss(tau=2.0, beta=1.0, reduction=reduction)
        if not_true
        else fnn.KDLoss(tau=2.0, ce_weight=0.7, reduction=reduction)
    )
    if not_true:  # NTDLoss has no ce_weight: compare against the op with the same weights

        def ref(h_, W_, b_):
            return ops.distill(
                h_ @ W_.T + b_,
                t,
                y,
                tau=2.0,
                ce_weight=0.7,
                kd_weight=4.0,
                kind="not_true",
                reduction=reduction,
                backend="reference",
            )
    else:

        def ref(h_, W_, b_):
            return plain(h_ @ W_.T + b_, t, y)

    want, gw = _grads(ref, h, W, b)
    got, gg = _grads(lambda h_, W_, b_: fused(h_, W_, y, t, bias=b_), h, W, b)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    for a, e in zip(gg, gw, strict=True):
        assert torch.allclose(a, e, rtol=1e-10, atol=1e-13)
    # the teacher as hidden states and its own head: the same
    got2, gg2 = _grads(
        lambda h_, W_, b_: fused(h_, W_, y, bias=b_, teacher_hidden=th, teacher_weight=tW, teacher_bias=tb), h, W, b
    )
    assert torch.allclose(got2, want, rtol=1e-12, atol=1e-14)
    assert all(torch.allclose(a, e, rtol=1e-10, atol=1e-13) for a, e in zip(gg2, gw, strict=True))


def test_float32_without_bias_and_first_order_only():
    h, W, _, th, tW, tb, y = _case(torch.float32, R=64, H=16, V=50)
    t = th @ tW.T
    want, gw = _grads(lambda h_, W_: fnn.KDLoss(tau=3.0)(h_ @ W_.T, t, y), h, W)
    got, gg = _grads(lambda h_, W_: fnn.LinearKDLoss(tau=3.0, chunk_rows=7)(h_, W_, y, t), h, W)
    assert torch.allclose(got, want, rtol=1e-5) and all(
        torch.allclose(a, e, rtol=1e-4, atol=1e-6) for a, e in zip(gg, gw, strict=True)
    )
    # create_graph=True gives the right first derivative (for the rows reductions too); only a second one is refused
    hh = h.clone().requires_grad_()
    (g,) = torch.autograd.grad(fnn.LinearKDLoss()(hh, W, y, t), hh)
    for red in ("mean", "none"):
        out = fnn.LinearKDLoss(reduction=red)(hh, W, y, t)
        (g2,) = torch.autograd.grad(out.sum() / (len(y) - 1 if red == "none" else 1), hh, create_graph=True)
        assert torch.allclose(g2, g, rtol=1e-5, atol=1e-7)
        with pytest.raises(RuntimeError, match="first-order"):
            torch.autograd.grad((g2**2).sum(), hh)


def test_bad_arguments_are_named():
    h, W, b, th, tW, tb, y = _case()
    t = th @ tW.T
    cases = [
        (dict(teacher_logits=t, teacher_hidden=th, teacher_weight=tW), "teacher_logits / teacher_hidden"),
        (dict(teacher_logits=t[:, :4]), "teacher_logits: expected"),
        (dict(teacher_hidden=th, teacher_weight=tW[:, :3]), "teacher_hidden / teacher_weight"),
        (dict(teacher_logits=t, bias=b[:3]), "bias: expected"),
        (dict(teacher_logits=t, reduction="bogus"), "reduction"),
        (dict(teacher_logits=t, reduction="segment"), "reduction: 'segment' needs `segments`"),
        (dict(teacher_logits=t, detach_teacher=False), "detach_teacher: linear_distill's teacher is a fixed"),
        (dict(teacher_logits=t, double_backward=True), "double_backward: the fused backward is first-order"),
        (dict(teacher_logits=t, chunk_rows=0), "chunk_rows"),
        (dict(teacher_logits=t, kind="mixed"), "kind"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            ops.linear_distill(h, W, y, **kw)
    with pytest.raises(ValueError, match="weight: expected"):
        ops.linear_distill(h, W[:, :2], y, t)
    with pytest.raises(ValueError, match="target"):
        ops.linear_distill(h, W, torch.full_like(y, 99), t)
    with pytest.raises(ValueError, match="target: expected shape"):
        ops.linear_distill(h, W, y[:3], t)
    for kw, msg in (
        (dict(detach_teacher=False), "detach_teacher: LinearKDLoss"),
        (dict(double_backward=True), "double_backward: LinearKDLoss"),
        (dict(reduction="x"), "reduction"),
    ):
        with pytest.raises(ValueError, match=msg):
            fnn.LinearKDLoss(**kw)


# the child processes' prelude: st(key) reads a /proc/self/status field in bytes (VmRSS, VmHWM)
_RSS_CHILD = textwrap.dedent("""
    import gc, sys, torch
    import fedfast.nn as fnn
    def st(k):
        for line in open("/proc/self/status"):
            if line.startswith(k + ":"):
                return int(line.split()[1]) * 1024
""")


@pytest.mark.slow
def test_memory_stays_below_one_logits_buffer(tmp_path):
    """R = 2048 rows, V = 32,768 classes: the logits would be 256 MB. The fused loss (the teacher as hidden states)
    grows the peak resident set by less than half of that with chunks of 64 rows (its own tensors: the weight's copy
    and gradient, 8 MB each, written once, and a chunk's logits, their gradient written over them, and teacher
    logits, 8 MB each) and by at most one logits buffer with the default chunks (a quarter of the rows: half a
    buffer); the unfused layer + KDLoss (the teacher's logits formed first) by more than two logits buffers."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs")
    child = _RSS_CHILD + textwrap.dedent("""
        R, H, V = 2048, 64, 32768
        g = torch.Generator().manual_seed(0)
        h, W = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g) * 0.1
        th, tW = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g) * 0.1
        y = torch.randint(0, V, (R,), generator=g)
        fused = sys.argv[1] != "plain"
        chunk = 64 if sys.argv[1] == "fused" else None
        def step():
            hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
            if fused:
                l = fnn.LinearKDLoss(chunk_rows=chunk)(hh, WW, y, teacher_hidden=th, teacher_weight=tW)
            else:
                l = fnn.KDLoss()(hh @ WW.T, th @ tW.T, y)
            l.backward()
            return hh.grad, WW.grad
        step(); gc.collect()
        hh0, WW0 = h.clone(), W.clone()   # the leaves' copies and their gradients are not the loss's memory
        gW = torch.empty_like(W); gh = torch.empty_like(h)
        del hh0, WW0, gW, gh
        open("/proc/self/clear_refs", "w").write("5"); base = st("VmRSS")
        out = step()
        print((st("VmHWM") - base) / (R * V * 4))
    """)
    res = {}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for mode in ("fused", "default", "plain"):
        (tmp_path / "m.py").write_text(child)
        r = subprocess.run(
            [sys.executable, str(tmp_path / "m.py"), mode], capture_output=True, text=True, env=env, timeout=300
        )
        assert r.returncode == 0, r.stderr[-2000:]
        res[mode] = float(r.stdout.split()[-1])
    assert res["fused"] <= 0.5 and res["default"] <= 1.0 and res["plain"] >= 2.0, res


# ---- issue 47: a first-class fused loss --------------------------------------------------------------------------


def _unfused(reduction, segments=None, num_segments=None, not_true=False):
    """The unfused layer + the module's own loss, as a user would write it."""
    loss = (
        fnn.NTDLoss(tau=2.0, beta=0.6, reduction=reduction)
        if not_true
        else fnn.KDLoss(tau=2.0, ce_weight=0.7, kd_weight=0.6, reduction=reduction)
    )

    def f(h_, W_, b_, t, y):
        kw = {} if segments is None else dict(segments=segments, num_segments=num_segments)
        return loss(h_ @ W_.T + b_, t, y, **kw)

    return f


def _fused(reduction, not_true=False, chunk=3):
    if not_true:
        return fnn.LinearKDLoss(
            tau=2.0, ce_weight=1.0, kd_weight=0.6, not_true=True, reduction=reduction, chunk_rows=chunk
        )
    return fnn.LinearKDLoss(tau=2.0, ce_weight=0.7, kd_weight=0.6, reduction=reduction, chunk_rows=chunk)


@pytest.mark.parametrize("reduction", ["none", "segment", "mean", "sum"])
@pytest.mark.parametrize("not_true", [False, True])
def test_every_reduction_and_segments_equal_the_unfused_loss(reduction, not_true):
    """'none' (per-row losses shaped as the target), 'segment' (per-segment means) and 'mean'/'sum' with segments,
    values and gradients (a non-uniform incoming gradient for the vector outputs), against Linear + KDLoss/NTDLoss."""
    h, W, b, th, tW, tb, y = _case(R=13)
    t = th @ tW.T + tb
    seg = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3])
    for segments in (None, seg) if reduction != "segment" else (seg,):
        S = None if segments is None else 4
        ref = _unfused(reduction, segments, S, not_true)
        fused = _fused(reduction, not_true)
        kw = {} if segments is None else dict(segments=segments, num_segments=S)
        want = ref(h, W, b, t, y)
        got = fused(h, W, y, t, bias=b, **kw)
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-14), (segments, got, want)
        w = torch.linspace(0.5, 2.0, want.numel(), dtype=want.dtype).reshape(want.shape)
        _, gw = _grads(lambda h_, W_, b_: (ref(h_, W_, b_, t, y) * w).sum(), h, W, b)
        _, gg = _grads(lambda h_, W_, b_: (fused(h_, W_, y, t, bias=b_, **kw) * w).sum(), h, W, b)
        for a, e in zip(gg, gw, strict=True):
            assert torch.allclose(a, e, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_language_models_hidden_states_with_padding(reduction):
    """[B, T, H] hidden states with [B, T] labels, padded positions at ignore_index: equal to the flattened rows
    (and 'none' shaped [B, T], zero at the padding)."""
    g = torch.Generator().manual_seed(3)
    B, T, H, V = 3, 5, 4, 17
    h = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64)
    t = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, 3:] = -1
    y[2, 1:] = -1
    loss = fnn.LinearKDLoss(tau=1.5, ignore_index=-1, reduction=reduction, chunk_rows=4)
    ref = fnn.KDLoss(tau=1.5, ignore_index=-1, reduction=reduction)
    got, gg = _grads(lambda h_, W_: loss(h_, W_, y, t).sum(), h, W)
    want, gw = _grads(lambda h_, W_: ref(h_.reshape(-1, H) @ W_.T, t.reshape(-1, V), y.reshape(-1)).sum(), h, W)
    assert torch.allclose(got, want, rtol=1e-12) and all(
        torch.allclose(a, e, rtol=1e-10) for a, e in zip(gg, gw, strict=True)
    )
    if reduction == "none":
        rows = loss(h, W, y, t)
        assert rows.shape == (B, T) and bool((rows[y == -1] == 0).all())


def test_no_gradient_work_without_anything_to_differentiate(monkeypatch):
    """Under torch.no_grad(), or with no input requiring grad, the chunks form no gradient (the evaluation cost of
    issue 47: 7.47 s vs 5.18 s); with grad, only what requires it."""
    ld = importlib.import_module("fedfast.ops.linear_distill")
    seen = []
    real = ld._pass

    def spy(*a, **k):
        seen.append(tuple(a[-3:]) + (k["rows"],))  # need_h, need_W, need_b, rows
        return real(*a, **k)

    monkeypatch.setattr(ld, "_pass", spy)
    h, W, b, th, tW, tb, y = _case(torch.float32)
    t = th @ tW.T
    hh, WW, bb = (x.clone().requires_grad_() for x in (h, W, b))
    with torch.no_grad():
        fnn.LinearKDLoss()(hh, WW, y, t, bias=bb)
    fnn.LinearKDLoss()(h, W, y, t, bias=b)
    assert seen == [(False, False, False, False)] * 2, seen
    seen.clear()
    fnn.LinearKDLoss()(h, WW, y, t, bias=b).backward()
    assert seen == [(False, True, False, False)], seen
    assert WW.grad is not None and hh.grad is None


def test_the_weight_gradient_is_written_once():
    """The weight gradient the chunks accumulate is the tensor autograd hands to W.grad: not copied, not scaled
    into a second weight-sized buffer (4.05 GiB at 4096 x 4096 x 128,000 before)."""
    ld = importlib.import_module("fedfast.ops.linear_distill")
    h, W, _, th, tW, _, y = _case(torch.float32, R=40, H=8, V=30)
    made = []
    real = ld._pass

    def spy(*a, **k):
        out = real(*a, **k)
        made.append(out[2].data_ptr())  # not the tensor: a reference held here would make autograd copy it
        return out

    try:
        ld._pass = spy
        WW = W.clone().requires_grad_()
        (2.5 * fnn.LinearKDLoss(chunk_rows=7)(h, WW, y, teacher_hidden=th, teacher_weight=tW)).backward()
    finally:
        ld._pass = real
    assert WW.grad.data_ptr() == made[0]
    W2 = W.clone().requires_grad_()
    (2.5 * fnn.KDLoss()(h @ W2.T, th @ tW.T, y)).backward()
    assert torch.allclose(WW.grad, W2.grad, rtol=1e-5, atol=1e-7)
    # the graph kept (retain_graph): a second backward is right, as the gradients are scaled copies then
    WW = W.clone().requires_grad_()
    loss = fnn.LinearKDLoss(chunk_rows=7)(h, WW, y, th @ tW.T)
    loss.backward(retain_graph=True)
    loss.backward()
    assert torch.allclose(WW.grad, 2 * W2.grad / 2.5, rtol=1e-5, atol=1e-7)


def _lm_case():
    g = torch.Generator().manual_seed(5)
    B, T, H, V = 2, 6, 8, 23
    h = torch.randn(B, T, H, generator=g)
    W = torch.randn(V, H, generator=g) * 0.3
    b = torch.randn(V, generator=g) * 0.1
    th, tW = torch.randn(B, T, 4, generator=g), torch.randn(V, 4, generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    y[1, 4:] = -100
    return h, W, b, th, tW, y


class _Head(torch.nn.Module):
    """A language model's output layer trained by distillation from a teacher's hidden states and head."""

    def __init__(self, W, b, reduction):
        super().__init__()
        self.W, self.b = torch.nn.Parameter(W.clone()), torch.nn.Parameter(b.clone())
        self.loss = fnn.LinearKDLoss(tau=2.0, ce_weight=0.5, reduction=reduction, chunk_rows=5)

    def forward(self, h, y, th, tW):
        out = self.loss(h, self.W, y, bias=self.b, teacher_hidden=th, teacher_weight=tW)
        return out if out.dim() == 0 else (out * torch.arange(1, out.numel() + 1.0).reshape(out.shape)).sum()


def _eager(reduction):
    h, W, b, th, tW, y = _lm_case()
    m = _Head(W, b, reduction)
    hh = h.clone().requires_grad_()
    loss = m(hh, y, th, tW)
    loss.backward()
    return loss.detach(), hh.grad, m.W.grad, m.b.grad


@pytest.mark.parametrize("how", ["compile", "export", "trace", "func"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_composes_with_compile_export_trace_and_func(how, reduction):
    """torch.compile(fullgraph=True), torch.export (run from the exported program), torch.jit.trace and
    torch.func.grad: the value and the gradients of hidden, weight and bias equal eager's (issue 47: opaque errors
    before)."""
    want = _eager(reduction)
    h, W, b, th, tW, y = _lm_case()
    m = _Head(W, b, reduction)
    hh = h.clone().requires_grad_()
    if how == "func":
        params = dict(m.named_parameters())

        def f(p, h_):
            return torch.func.functional_call(m, p, (h_, y, th, tW))

        (gp, gh), val = torch.func.grad_and_value(f, argnums=(0, 1))(params, h)
        got = (val, gh, gp["W"], gp["b"])
    else:
        if how == "compile":
            torch._dynamo.reset()
            fn = torch.compile(m, fullgraph=True, backend="aot_eager")
        elif how == "export":
            fn = torch.export.export(m, (h, y, th, tW)).module()
            fn.load_state_dict(m.state_dict())
        else:
            fn = torch.jit.trace(m, (h, y, th, tW), check_trace=False)
        loss = fn(hh, y, th, tW)
        params = {k.split(".")[-1]: v for k, v in fn.named_parameters()}
        gW, gb, gh = torch.autograd.grad(loss, [params["W"], params["b"], hh])
        got = (loss.detach(), gh, gW, gb)
    for a, e in zip(got, want, strict=True):
        assert torch.allclose(a, e, rtol=1e-5, atol=1e-6), (how, a, e)


def test_compiled_inductor_fullgraph():
    """The default inductor backend too (the custom ops are opaque to it, their fake kernels give the shapes)."""
    want = _eager("mean")
    h, W, b, th, tW, y = _lm_case()
    m = _Head(W, b, "mean")
    torch._dynamo.reset()
    fn = torch.compile(m, fullgraph=True)
    hh = h.clone().requires_grad_()
    loss = fn(hh, y, th, tW)
    loss.backward()
    for a, e in zip((loss.detach(), hh.grad, m.W.grad, m.b.grad), want, strict=True):
        assert torch.allclose(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_vmap_of_grad_over_models_with_their_own_labels(reduction):
    """torch.func.vmap(grad(...)) over N output layers, each with its own hidden states, teacher and labels (a
    per-client head), and over one shared weight: equal to the unfused layer + KDLoss under the same transform; a
    second derivative (grad of grad) is refused by name."""
    g = torch.Generator().manual_seed(7)
    N, R, H, V = 3, 5, 4, 9
    h = torch.randn(N, R, H, generator=g, dtype=torch.float64)
    W = torch.randn(N, V, H, generator=g, dtype=torch.float64)
    t = torch.randn(N, R, V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (N, R), generator=g)
    y[1, 2] = -100
    fused, plain = fnn.LinearKDLoss(reduction=reduction, chunk_rows=2), fnn.KDLoss(reduction=reduction)

    def f(h_, W_, t_, y_):
        return fused(h_, W_, y_, t_).sum()

    def u(h_, W_, t_, y_):
        return plain(h_ @ W_.T, t_, y_).sum()

    for dims, WW in (((0, 0, 0, 0), W), ((0, None, 0, 0), W[0])):
        got = torch.func.vmap(torch.func.grad_and_value(f, argnums=(0, 1)), in_dims=dims)(h, WW, t, y)
        want = torch.func.vmap(torch.func.grad_and_value(u, argnums=(0, 1)), in_dims=dims)(h, WW, t, y)
        assert torch.allclose(got[1], want[1], rtol=1e-12)
        for a, e in zip(got[0], want[0], strict=True):
            assert torch.allclose(a, e, rtol=1e-10, atol=1e-14)
    with pytest.raises(RuntimeError, match="first-order"):
        torch.func.grad(lambda x: torch.func.grad(f)(x, W[0], t[0], y[0]).pow(2).sum())(h[0])


def test_backward_allocates_nothing_weight_sized():
    """The backward of "mean"/"sum" scales the stored gradients in place and receives no zeros for them: at
    R = 256, H = 1024, V = 8192 (weight 32 MB, logits 8 MB) the backward's peak resident growth stays under a
    quarter of the weight (autograd materialised weight-sized zeros for the gradient outputs before: + 1.0)."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs")
    child = _RSS_CHILD + textwrap.dedent("""
        R, H, V = 256, 1024, 8192
        h = torch.randn(R, H).requires_grad_()
        W = (torch.randn(V, H) * 0.03).requires_grad_()
        t, y = torch.randn(R, V), torch.randint(0, V, (R,))
        loss_fn = fnn.LinearKDLoss()
        worst = 0.0
        for _ in range(3):
            h.grad = W.grad = None
            gc.collect()
            loss = loss_fn(h, W, y, t)
            open("/proc/self/clear_refs", "w").write("5")
            base = st("VmRSS")
            loss.backward()
            worst = max(worst, (st("VmHWM") - base) / (V * H * 4))
        print(worst)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout.split()[-1]) < 0.25, r.stdout
