"""fedfast.nn's inputs, issue 59's rows: NumPy scalars as numbers, non-finite weights refused at construction by name,
a half-precision teacher with an fp32 head, and forward-mode AD (jvp) either computed or refused by name."""

import math

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import fedfast.nn as fnn

R, C, H = 6, 10, 8


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    z, t = torch.randn(R, C, generator=g), torch.randn(R, C, generator=g)
    return z, t, torch.randint(0, C, (R,), generator=g)


def _calls():
    """(module factory taking tau, call(module, z, t, y)) for every loss module."""
    prior = torch.full((C,), 1.0 / C)
    alpha = torch.rand(C, generator=torch.Generator().manual_seed(1))
    freq = torch.arange(1.0, C + 1)
    w = torch.tensor([0.6, 0.4])
    return {
        "KDLoss": (lambda tau: fnn.KDLoss(tau=tau), lambda m, z, t, y: m(z, t, y)),
        "NTDLoss": (lambda tau: fnn.NTDLoss(tau=tau), lambda m, z, t, y: m(z, t, y)),
        "ASDLoss": (lambda tau: fnn.ASDLoss(tau=tau), lambda m, z, t, y: m(z, t, y, prior)),
        "GKDLoss": (lambda tau: fnn.GKDLoss(tau=tau), lambda m, z, t, y: m(z, torch.stack([t, t.flip(0)]), y, w)),
        "CADLoss": (lambda tau: fnn.CADLoss(tau=tau), lambda m, z, t, y: m(z, t, y, alpha)),
        "ADCLoss": (lambda tau: fnn.ADCLoss(tau=tau), lambda m, z, t, y: m(z, t, y, freq)),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_numpy_scalars_are_numbers(name):
    """``tau=np.float32(2)`` was refused ("must be a finite number > 0, got np.float32(2.0)")."""
    make, call = _calls()[name]
    z, t, y = _data()
    ref = call(make(2.0), z, t, y)
    for tau in (np.float32(2), np.float64(2), np.int64(2)):
        m = make(tau)
        assert type(m.tau) is float and call(m, z, t, y).item() == ref.item()
    with pytest.raises(ValueError, match="tau: must be a finite number > 0"):
        make(True)
    with pytest.raises(ValueError, match="tau: must be a finite number > 0"):
        make(np.float32("nan"))


@pytest.mark.parametrize(
    "factory,key",
    [
        (lambda v: fnn.KDLoss(kd_weight=v), "kd_weight"),
        (lambda v: fnn.KDLoss(ce_weight=v), "ce_weight"),
        (lambda v: fnn.NTDLoss(beta=v), "beta"),
        (lambda v: fnn.ASDLoss(lam=v), "lam"),
        (lambda v: fnn.GKDLoss(gamma=v), "gamma"),
        (lambda v: fnn.ADCLoss(lam=v), "lam"),
        (lambda v: fnn.LinearKDLoss(kd_weight=v), "kd_weight"),
        (lambda v: fnn.LinearKDLoss(ce_weight=v), "ce_weight"),
    ],
)
def test_non_finite_weights_refused_at_construction(factory, key):
    """``LinearKDLoss(kd_weight=nan)`` was accepted (and the plain losses refused it only at the first call)."""
    for bad in (float("nan"), float("inf"), -float("inf"), "1", None, True):
        with pytest.raises(ValueError, match=f"{key}: must "):  # "be a finite number" (ASD's lam: "lie in [0, 1]")
            factory(bad)
    assert getattr(factory(np.float32(0.5)), key) == 0.5


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_half_precision_teacher_with_fp32_head(low):
    """bf16 teacher hidden states with an fp32 teacher weight raised the matmul's own dtype error; the head is now
    cast to the states' dtype, as the student's is: the loss equals the one from those logits, given directly."""
    g = torch.Generator().manual_seed(2)
    h, W = torch.randn(R, H, generator=g), torch.randn(C, H, generator=g)
    th, tW, tb = torch.randn(R, H, generator=g).to(low), torch.randn(C, H, generator=g), torch.randn(C, generator=g)
    y = torch.randint(0, C, (R,), generator=g)
    lin = fnn.LinearKDLoss(tau=2.0)
    got = lin(h, W, y, teacher_hidden=th, teacher_weight=tW, teacher_bias=tb)
    t = F.linear(th, tW.to(low), tb.to(low))  # what F.linear makes of the head cast to the states' dtype
    want = lin(h, W, y, t)
    assert torch.isfinite(got) and abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
    # the student the same way round: fp32 head on low-precision states
    got_s = lin(h.to(low), W, y, t.float())
    want_s = fnn.KDLoss(tau=2.0)((h.to(low) @ W.to(low).T).float(), t.float(), y)
    assert abs(got_s.item() - want_s.item()) <= 1e-3 * abs(want_s.item())


@pytest.mark.parametrize("name", list(_calls()))
def test_jvp_equals_the_directional_derivative(name):
    """``torch.func.jvp`` and ``forward_ad`` dual tensors through every loss: the tangent equals grad . v from
    float64 autograd on the unfused reference (an outside check: the fused ops have no forward derivative of their
    own; the losses take PyTorch's formulas under forward-mode AD)."""
    make, call = _calls()[name]
    z, t, y = _data(3)
    v = torch.randn(R, C, generator=torch.Generator().manual_seed(4))
    m = make(2.0)
    val, tan = torch.func.jvp(lambda zz: call(m, zz, t, y), (z,), (v,))
    ref_m = make(2.0)
    ref_m.backend = "reference"
    z64 = z.double().requires_grad_(True)
    ref = call(ref_m, z64, t.double(), y)
    (g,) = torch.autograd.grad(ref, z64)
    want = (g * v.double()).sum().item()
    assert abs(val.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert abs(tan.item() - want) <= 1e-5 * max(abs(want), 1e-3), (tan.item(), want)
    with fwAD.dual_level():
        out = call(m, fwAD.make_dual(z, v), t, y)
        assert abs(fwAD.unpack_dual(out).tangent.item() - want) <= 1e-5 * max(abs(want), 1e-3)


def test_linear_kd_refuses_forward_mode_by_name():
    g = torch.Generator().manual_seed(5)
    h, W, t = torch.randn(R, H, generator=g), torch.randn(C, H, generator=g), torch.randn(R, C, generator=g)
    y = torch.randint(0, C, (R,), generator=g)
    for reduction in ("mean", "none"):
        lin = fnn.LinearKDLoss(reduction=reduction)
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            torch.func.jvp(lambda hh: lin(hh, W, y, t).sum(), (h,), (torch.ones_like(h),))
        with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
            lin(fwAD.make_dual(h, torch.ones_like(h)), W, y, t)
    # the unfused layer the message points to does it
    val, tan = torch.func.jvp(lambda hh: fnn.KDLoss()(F.linear(hh, W), t, y), (h,), (torch.ones_like(h),))
    assert math.isfinite(tan.item())


@pytest.mark.parametrize("teacher", ["logits", "hidden"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_kd_under_autocast_is_f_linear_under_autocast(teacher, reduction):
    """``LinearKDLoss`` ignored ``torch.autocast`` (it computed in fp32 where ``F.linear`` + the loss computes bf16
    logits). Now the same: value and every gradient against the unfused layer under the same autocast, and fp32
    parameters keep fp32 gradients."""
    g = torch.Generator().manual_seed(6)
    V, Ht = 50, 5
    h, W, b = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g), torch.randn(V, generator=g)
    th, tW = torch.randn(R, Ht, generator=g), torch.randn(V, Ht, generator=g)
    t, y = torch.randn(R, V, generator=g), torch.randint(0, V, (R,), generator=g)

    def run(fused):
        leaves = [x.clone().requires_grad_(True) for x in (h, W, b)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                kw = {"teacher_hidden": th, "teacher_weight": tW} if teacher == "hidden" else {}
                out = fnn.LinearKDLoss(tau=2.0, reduction=reduction)(
                    leaves[0], leaves[1], y, t if teacher == "logits" else None, bias=leaves[2], **kw
                )
            else:
                tt = F.linear(th, tW) if teacher == "hidden" else t
                out = fnn.KDLoss(tau=2.0, reduction=reduction)(F.linear(leaves[0], leaves[1], leaves[2]), tt, y)
        out.sum().backward()
        return out.detach(), [x.grad for x in leaves]

    (lf, gf), (lu, gu) = run(True), run(False)
    assert lf.dtype == torch.float32 and all(gr.dtype == torch.float32 for gr in gf)
    assert torch.allclose(lf, lu, rtol=1e-5, atol=1e-6), (lf, lu)
    for a, u in zip(gf, gu, strict=True):
        assert torch.allclose(a, u, rtol=1e-2, atol=1e-3 * u.abs().max().item())  # one bf16 rounding apart at most
    # and it is not the fp32 computation (what the fused layer returned under autocast before)
    fp32 = fnn.LinearKDLoss(tau=2.0, reduction=reduction)(
        h,
        W,
        y,
        t if teacher == "logits" else None,
        bias=b,
        **({"teacher_hidden": th, "teacher_weight": tW} if teacher == "hidden" else {}),
    )
    assert not torch.allclose(lf, fp32.detach(), rtol=1e-6, atol=0)
