"""fedfast.nn losses where PyTorch users take them: double backward, a teacher that learns, torch.jit.trace,
torch.func, float64 reductions (issue 36). Each either works (against an independent eager formula or numerical
derivatives) or fails with an error that names the limitation: never a silently wrong gradient."""

import pytest
import torch
import torch.nn.functional as F

import fedfast.nn as fnn
from fedfast import ops

R, C = 12, 6


def _data(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(R, C, generator=g, dtype=dtype)
    t = torch.randn(R, C, generator=g, dtype=dtype)
    y = torch.randint(0, C, (R,), generator=g)
    y[3] = -100  # an ignored row
    return z, t, y


def _losses():
    """(name, module, extra forward args) for each of the six losses, with non-default options."""
    prior = torch.rand(C, dtype=torch.float64) + 0.1
    alpha = torch.rand(C, dtype=torch.float64)
    freq = torch.rand(C, dtype=torch.float64) + 0.05
    return [
        ("kd", lambda **k: fnn.KDLoss(tau=3.0, ce_weight=0.5, **k), ()),
        ("ntd", lambda **k: fnn.NTDLoss(tau=2.0, beta=0.7, **k), ()),
        ("asd", lambda **k: fnn.ASDLoss(tau=2.0, lam=3.0, **k), (prior / prior.sum(),)),
        ("gkd", lambda **k: fnn.GKDLoss(tau=2.0, gamma=0.4, **k), ()),
        ("cad", lambda **k: fnn.CADLoss(tau=2.0, **k), (alpha,)),
        ("adc", lambda **k: fnn.ADCLoss(tau=3.0, lam=0.4, **k), (freq,)),
    ]


def kd_eager(z, t, y, tau, ce_weight, kd_weight):
    """Hinton KD as research code writes it (RepDistiller's DistillKL + cross-entropy), mean over kept rows."""
    keep = y != -100
    ce = F.cross_entropy(z[keep], y[keep])
    kl = F.kl_div(F.log_softmax(z[keep] / tau, 1), F.softmax(t[keep] / tau, 1), reduction="batchmean")
    return ce_weight * ce + kd_weight * tau**2 * kl


@pytest.mark.parametrize("name,make,extra", _losses(), ids=[x[0] for x in _losses()])
def test_second_derivative_refused_by_default_and_exact_on_request(name, make, extra):
    z, t, y = _data()
    # default: the first derivative with create_graph=True is right; differentiating it again raises, by name
    zz = z.clone().requires_grad_()
    (g,) = torch.autograd.grad(make()(zz, t, y, *extra), zz, create_graph=True)
    zr = z.clone().requires_grad_()
    (want,) = torch.autograd.grad(make(double_backward=True)(zr, t, y, *extra), zr)
    assert torch.allclose(g, want, rtol=1e-10, atol=1e-12)
    with pytest.raises(RuntimeError, match="first-order.*double_backward=True"):
        torch.autograd.grad((g * g).sum(), zz)
    # double_backward=True: second derivatives agree with numerical ones
    loss = make(double_backward=True)
    assert torch.autograd.gradgradcheck(lambda a: loss(a, t, y, *extra), (z.clone().requires_grad_(),))


def test_gradient_penalty_through_a_model_is_refused_not_wrong():
    """The failure the issue found: parameter gradients of a gradient penalty silently 100 % off. Now: refused
    by default, and with double_backward=True equal to the eager formula's."""
    z, t, y = _data()
    x = torch.randn(R, 5, dtype=torch.float64)
    lin = torch.nn.Linear(5, C).double()
    (gp,) = torch.autograd.grad(fnn.KDLoss(tau=2.0)(lin(x), t, y), lin.weight, create_graph=True)
    with pytest.raises(RuntimeError, match="first-order"):
        (gp**2).sum().backward()
    got = []
    for fn in (
        lambda o: fnn.KDLoss(tau=2.0, double_backward=True)(o, t, y),
        lambda o: kd_eager(o, t, y, 2.0, 1.0, 1.0),
    ):
        lin.zero_grad()
        (gp,) = torch.autograd.grad(fn(lin(x)), lin.weight, create_graph=True)
        (gp**2).sum().backward()
        got.append(lin.weight.grad.clone())
    assert torch.allclose(got[0], got[1], rtol=1e-10, atol=1e-14) and got[1].abs().max() > 0


def test_teacher_detached_by_default_and_learns_on_request():
    z, t, y = _data()
    tt = t.clone().requires_grad_()
    zz = z.clone().requires_grad_()
    fnn.KDLoss(tau=2.0)(zz, tt, y).backward()
    assert tt.grad is None and zz.grad is not None
    zz.grad = None
    fnn.KDLoss(tau=2.0, kd_weight=0.5, detach_teacher=False)(zz, tt, y).backward()
    t2, z2 = t.clone().requires_grad_(), z.clone().requires_grad_()
    kd_eager(z2, t2, y, 2.0, 1.0, 0.5).backward()
    assert torch.allclose(tt.grad, t2.grad, rtol=1e-10, atol=1e-14) and t2.grad.abs().max() > 0
    assert torch.allclose(zz.grad, z2.grad, rtol=1e-10, atol=1e-14)
    with pytest.raises(TypeError, match="detach_teacher"):
        fnn.KDLoss(detach_teacher="no")


def test_autograd_path_refuses_an_explicit_fused_backend():
    z, t, y = _data()
    with pytest.raises(ValueError, match=r"backend: 'cpu' .*double_backward=True"):
        fnn.NTDLoss(backend="cpu", double_backward=True)(z.requires_grad_(), t, y)


@pytest.mark.parametrize("name,make,extra", _losses()[:2] + _losses()[3:4], ids=["kd", "ntd", "gkd"])
def test_jit_trace_records_the_right_loss(name, make, extra):
    """torch.jit.trace cannot record the fused op's stored gradient: the trace takes the autograd formulas, and the
    traced module gives the eager module's loss and gradients on new inputs."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.loss = torch.nn.Linear(5, C), make()

        def forward(self, x, t, y):
            return self.loss(self.lin(x), t, y, *extra)

    net = Net().double()
    _, t, y = _data()
    with pytest.warns(torch.jit.TracerWarning):
        traced = torch.jit.trace(net, (torch.randn(R, 5, dtype=torch.float64), t, y), check_trace=False)
    x2, t2 = torch.randn(R, 5, dtype=torch.float64), torch.randn(R, C, dtype=torch.float64)
    a, b = traced(x2, t2, y), net(x2, t2, y)
    ga = torch.autograd.grad(a, list(net.parameters()))
    gb = torch.autograd.grad(b, list(net.parameters()))
    assert torch.isfinite(a) and torch.allclose(a, b, rtol=1e-12)
    assert all(torch.allclose(u, v, rtol=1e-10, atol=1e-14) for u, v in zip(ga, gb, strict=True))


@pytest.mark.parametrize("name,make,extra", _losses(), ids=[x[0] for x in _losses()])
def test_torch_func_grad_and_vmap(name, make, extra):
    from torch.func import grad, vmap

    z, t, y = _data()
    loss = make()
    zz = z.clone().requires_grad_()
    loss(zz, t, y, *extra).backward()
    assert torch.allclose(grad(lambda a: loss(a, t, y, *extra))(z), zz.grad, rtol=1e-10, atol=1e-14)
    zs = torch.randn(3, R, C, dtype=torch.float64)
    got = vmap(lambda a: loss(a, t, y, *extra))(zs)
    assert torch.allclose(got, torch.stack([loss(a, t, y, *extra) for a in zs]), rtol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "segment"])
def test_float64_mean_is_exact_on_the_cpu_backend(reduction):
    """1/n was computed in float32 by the C++ row-scale pass (relative error 2e-8 to 5e-8); float64 now."""
    from fedfast.ops import _backend
    from fedfast.ops.distill_reference import distill_reference

    if not _backend.available("cpu", "cpu"):
        pytest.skip("the C++ extension is not built")
    z, t, y = _data()
    y = torch.randint(0, C, (R,))
    seg = torch.tensor([0] * 7 + [1] * 5)
    got = ops.distill(z, t, y, tau=2.0, segments=seg, reduction=reduction, backend="cpu")
    rows = distill_reference(z, t, y, tau=2.0)
    want = torch.stack([rows[:7].sum() / 7, rows[7:].sum() / 5])
    want = want.sum() if reduction == "mean" else want
    assert ((got - want).abs() / want.abs()).max() <= 1e-15


def test_asd_loss_defaults_are_the_official_code():
    """ASDLoss's teacher-entropy temperature defaults to 1.0 (the official FedAvg+ASD code), not the KD tau."""
    from fedfast.ops.distill_reference import asd_weights_reference

    z, t, y = _data()
    y = torch.randint(0, C, (R,))
    prior = torch.full((C,), 1.0 / C, dtype=torch.float64)
    loss = fnn.ASDLoss(tau=2.0, lam=10.0)
    assert loss.entropy_tau == 1.0
    w = asd_weights_reference(t, y, prior, entropy_tau=1.0)
    w = w / w.sum()
    ce = F.cross_entropy(z, y)
    kl = (F.softmax(t / 2, 1) * (F.log_softmax(t / 2, 1) - F.log_softmax(z / 2, 1))).sum(1)
    assert torch.allclose(loss(z, t, y, prior), ce + 10.0 * (w * kl).sum(), rtol=1e-12)
    with pytest.raises(ValueError, match="entropy_tau"):
        fnn.ASDLoss(entropy_tau=None)


def test_float64_on_a_gpu_takes_the_float64_path_when_the_backend_is_automatic(monkeypatch):
    """The GPU kernels compute in fp32 (an explicit backend='triton' refuses float64 by name); the automatic choice
    sends a float64 loss to the float64 formulas instead of failing."""
    from fedfast.ops import _backend

    monkeypatch.delenv("FEDFAST_BACKEND", raising=False)
    monkeypatch.setattr(_backend, "resolve", lambda backend, device_type: backend or "triton")
    assert _backend.resolve_for(None, "cuda", torch.float64) == "reference"
    assert _backend.resolve_for(None, "cuda", torch.float32) == "triton"
    assert _backend.resolve_for("triton", "cuda", torch.float64) == "triton"
    monkeypatch.setenv("FEDFAST_BACKEND", "triton")
    assert _backend.resolve_for(None, "cuda", torch.float64) == "triton"


def test_autograd_path_checks_its_inputs_like_the_fused_path():
    z, t, y = _data()
    for kw in ({}, {"double_backward": True}):
        with pytest.raises(ValueError, match=r"class_alpha: per-class weights must lie in \[0, 1\]"):
            fnn.CADLoss(**kw)(z.clone().requires_grad_(), t, y, torch.full((C,), 1.5, dtype=torch.float64))
