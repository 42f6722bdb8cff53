"""The output layer fused with the distillation loss in row chunks (fedfast.ops.linear_distill, fedfast.nn.LinearKDLoss,
issue 36): equal to the unfused layer + KDLoss in value and in the gradients of hidden, weight and bias, at any chunk
size; the teacher as logits or as hidden states + its own head; memory without the [R, V] logits."""
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
    fused = fnn.LinearKDLoss(tau=2.0, ce_weight=0.7, not_true=not_true, reduction=reduction, chunk_rows=chunk,
                             backend=backend)
    plain = (fnn.NTDLoss(tau=2.0, beta=1.0, reduction=reduction) if not_true else
             fnn.KDLoss(tau=2.0, ce_weight=0.7, reduction=reduction))
    if not_true:  # NTDLoss has no ce_weight: compare against the op with the same weights
        def ref(h_, W_, b_):
            return ops.distill(h_ @ W_.T + b_, t, y, tau=2.0, ce_weight=0.7, kd_weight=4.0, kind="not_true",
                               reduction=reduction, backend="reference")
    else:
        def ref(h_, W_, b_):
            return plain(h_ @ W_.T + b_, t, y)
    want, gw = _grads(ref, h, W, b)
    got, gg = _grads(lambda h_, W_, b_: fused(h_, W_, y, t, bias=b_), h, W, b)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    for a, e in zip(gg, gw):
        assert torch.allclose(a, e, rtol=1e-10, atol=1e-13)
    # the teacher as hidden states and its own head: the same
    got2, gg2 = _grads(lambda h_, W_, b_: fused(h_, W_, y, bias=b_, teacher_hidden=th, teacher_weight=tW,
                                                  teacher_bias=tb), h, W, b)
    assert torch.allclose(got2, want, rtol=1e-12, atol=1e-14)
    assert all(torch.allclose(a, e, rtol=1e-10, atol=1e-13) for a, e in zip(gg2, gw))


def test_float32_without_bias_and_first_order_only():
    h, W, _, th, tW, tb, y = _case(torch.float32, R=64, H=16, V=50)
    t = th @ tW.T
    want, gw = _grads(lambda h_, W_: fnn.KDLoss(tau=3.0)(h_ @ W_.T, t, y), h, W)
    got, gg = _grads(lambda h_, W_: fnn.LinearKDLoss(tau=3.0, chunk_rows=7)(h_, W_, y, t), h, W)
    assert torch.allclose(got, want, rtol=1e-5) and all(torch.allclose(a, e, rtol=1e-4, atol=1e-6)
                                                         for a, e in zip(gg, gw))
    hh = h.clone().requires_grad_()
    g, = torch.autograd.grad(fnn.LinearKDLoss()(hh, W, y, t), hh, create_graph=False)
    with pytest.raises(RuntimeError, match="first-order"):
        torch.autograd.grad(fnn.LinearKDLoss()(hh, W, y, t), hh, create_graph=True)


def test_bad_arguments_are_named():
    h, W, b, th, tW, tb, y = _case()
    t = th @ tW.T
    cases = [(dict(teacher_logits=t, teacher_hidden=th, teacher_weight=tW), "teacher_logits / teacher_hidden"),
             (dict(teacher_logits=t[:, :4]), "teacher_logits: expected"),
             (dict(teacher_hidden=th, teacher_weight=tW[:, :3]), "teacher_hidden / teacher_weight"),
             (dict(teacher_logits=t, bias=b[:3]), "bias: expected"),
             (dict(teacher_logits=t, reduction="none"), "reduction"),
             (dict(teacher_logits=t, chunk_rows=0), "chunk_rows"),
             (dict(teacher_logits=t, kind="mixed"), "kind")]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            ops.linear_distill(h, W, y, **kw)
    with pytest.raises(ValueError, match="weight: expected"):
        ops.linear_distill(h, W[:, :2], y, t)
    with pytest.raises(ValueError, match="target"):
        ops.linear_distill(h, W, torch.full_like(y, 99), t)


def test_memory_stays_below_one_logits_buffer(tmp_path):
    """R = 2048 rows, V = 32,768 classes: the logits would be 256 MB. The fused loss (chunks of 64 rows, the teacher
    as hidden states) grows the peak resident set by less than half of that (its own tensors: the weight's copy,
    gradient and scaled gradient, 8 MB each, and a chunk's logits, teacher logits and gradient, 8 MB each); the
    unfused layer + KDLoss (the teacher's logits formed first) by more than two logits buffers."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs")
    child = textwrap.dedent('''
        import gc, sys, torch
        import fedfast.nn as fnn
        def st(k):
            for line in open("/proc/self/status"):
                if line.startswith(k + ":"):
                    return int(line.split()[1]) * 1024
        R, H, V = 2048, 64, 32768
        g = torch.Generator().manual_seed(0)
        h, W = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g) * 0.1
        th, tW = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g) * 0.1
        y = torch.randint(0, V, (R,), generator=g)
        fused = sys.argv[1] == "fused"
        def step():
            hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
            if fused:
                l = fnn.LinearKDLoss(chunk_rows=64)(hh, WW, y, teacher_hidden=th, teacher_weight=tW)
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
    ''')
    res = {}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for mode in ("fused", "plain"):
        (tmp_path / "m.py").write_text(child)
        r = subprocess.run([sys.executable, str(tmp_path / "m.py"), mode], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        res[mode] = float(r.stdout.split()[-1])
    assert res["fused"] <= 0.5 and res["plain"] >= 2.0, res
