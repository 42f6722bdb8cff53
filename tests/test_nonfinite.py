"""NaN and +inf in the logits (issue 59: a NaN teacher logit in the target's column dropped the row's KD term and
returned a finite loss). IEEE arithmetic on the formula gives NaN for such a row (softmax of a row with NaN or +inf
is NaN), so every backend must: a row whose student, or whose teacher in a class the loss reads, holds a NaN or +inf
has a NaN loss and NaN in its gradient row; every other row is exactly what it is without the poisoned rows; a -inf
teacher logit stays valid (a class the teacher excludes), and so does a NaN in the true class under not-true KD
(FedNTD never reads it). Rows with an ignored target stay 0 whatever they hold."""

import math

import pytest
import torch
from conftest import cpu_backends
from helpers import rel_err

import fedfast.nn as fnn
from fedfast import ops

# every backend that runs here on the CPU, and the GPU backends on a CUDA device (test_gpu's marker)
CASES = [(b, "cpu") for b in cpu_backends()] + [
    pytest.param(b, "cuda", marks=pytest.mark.gpu, id=f"{b}-cuda") for b in ("triton", "cuda")
]
NAN, INF = float("nan"), float("inf")
# R = 5: the row kernel; R = 37 (C <= 128): the cpu backend's 16-row blocks; C = 200: the row kernel again
SHAPES = [(5, 10), (37, 10), (37, 200)]


def _inputs(R, C, seed=0):
    g = torch.Generator().manual_seed(seed + R + C)
    z = torch.randn(R, C, generator=g) * 3
    t = torch.randn(R, C, generator=g) * 3
    y = torch.randint(0, C, (R,), generator=g)
    y[1] = (y[1] + 1) % C  # rows 0-4 have distinct targets from their neighbours' poison columns
    return z, t, y


def _poison(z, t, y, *, target_col_nan_ok):
    """Rows 0-4 poisoned: 0 a -inf teacher logit (valid), 1 a NaN teacher logit at the target, 2 a +inf teacher logit
    elsewhere, 3 a NaN student logit elsewhere, 4 a +inf student logit at the target; the rows expected NaN."""
    z, t = z.clone(), t.clone()
    other = lambda i: int((y[i] + 1) % z.shape[1])  # noqa: E731
    t[0, other(0)] = -INF
    t[1, int(y[1])] = NAN
    t[2, other(2)] = INF
    z[3, other(3)] = NAN
    z[4, int(y[4])] = INF
    bad = [2, 3, 4] if target_col_nan_ok else [1, 2, 3, 4]
    return z, t, bad


def _check(loss, grad, clean_loss, clean_grad, bad, R):
    good = [i for i in range(R) if i not in bad]
    for i in bad:
        assert math.isnan(loss[i].item()), (i, loss[i])
        assert torch.isnan(grad[i]).any(), (i, grad[i])
    assert torch.isfinite(loss[good]).all() and torch.isfinite(grad[good]).all()
    assert rel_err(loss[good], clean_loss[good]) <= 1e-6 and rel_err(grad[good], clean_grad[good]) <= 1e-6


MODES = {
    "kd": dict(kind="full", tau=4.0, kd_weight=16.0),
    "ntd": dict(kind="not_true", tau=2.0, kd_weight=4.0),
    "cad": dict(kind="full", tau=2.0, soft_ce=True, class_alpha="alpha"),
    "adc": dict(kind="full", tau=4.0, ce_weight=0.65, kd_weight=5.6, rho="rho"),
    "pure_kd": dict(kind="full", tau=2.0, ce_weight=0.0),
}


def _kw(mode, C):
    kw = dict(MODES[mode])
    g = torch.Generator().manual_seed(C)
    if kw.get("class_alpha") == "alpha":
        kw["class_alpha"] = torch.rand(C, generator=g)
    if kw.get("rho") == "rho":
        kw["rho"] = torch.rand(C, generator=g)
    return kw


def _run(backend, z, t, y, device="cpu", **kw):
    """Per-row loss and gradient (on the CPU) of the op run on ``device``."""
    to = lambda v: v.to(device) if torch.is_tensor(v) else v  # noqa: E731
    kw = {k: (tuple(to(x) for x in v) if isinstance(v, tuple) else to(v)) for k, v in kw.items()}
    zz = z.to(device).clone().requires_grad_(True)
    loss = ops.distill(zz, to(t), to(y), reduction="none", backend=backend, **kw)
    loss.sum().backward()
    return loss.detach().cpu(), zz.grad.cpu()


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("R,C", SHAPES)
def test_poisoned_rows_are_nan_and_the_rest_untouched(backend, device, mode, R, C):
    z0, t0, y = _inputs(R, C)
    kw = _kw(mode, C)
    z, t, bad = _poison(z0, t0, y, target_col_nan_ok=mode == "ntd")
    clean_z, clean_t = z.clone(), t.clone()
    clean_z[bad], clean_t[bad] = z0[bad], t0[bad]
    loss, grad = _run(backend, z, t, y, device, **kw)
    cl, cg = _run(backend, clean_z, clean_t, y, device, **kw)
    _check(loss, grad, cl, cg, bad, R)
    # the valid rows (the -inf teacher logit included) against the float64 reference
    good = [i for i in range(R) if i not in bad]
    rl, rg = _run("reference", clean_z.double(), clean_t.double(), y, **kw)
    assert rel_err(loss[good], rl[good]) <= 1e-5 and rel_err(grad[good], rg[good]) <= 1e-5
    # an ignored row stays 0, NaN or not
    y2 = y.clone()
    y2[bad] = -100
    l2, g2 = _run(backend, z, t, y2, device, **kw)
    assert (l2[bad] == 0).all() and (g2[bad] == 0).all() and torch.isfinite(l2).all()


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("not_true", [False, True])
@pytest.mark.parametrize("R,C", SHAPES)
def test_vote_mixture_with_a_poisoned_teacher(backend, device, not_true, R, C):
    """FedGKD-VOTE: one of three teachers poisoned in a row makes that row NaN (its weight is not 0), fused and
    through the precomputed mixture; ``teacher_mixture`` itself returns NaN for that row."""
    z, t0, y = _inputs(R, C)
    g = torch.Generator().manual_seed(1)
    ts = torch.stack([t0, torch.randn(R, C, generator=g), torch.randn(R, C, generator=g)])
    w = torch.tensor([0.5, 0.2, 0.3])
    ts_bad = ts.clone()
    ts_bad[1, 1, int(y[1])] = NAN  # target column: read unless not-true
    ts_bad[2, 2, int((y[2] + 1) % C)] = INF
    ts_bad[0, 0, int((y[0] + 1) % C)] = -INF  # valid
    bad = [2] if not_true else [1, 2]
    kind = "not_true" if not_true else "full"
    kw = dict(kind=kind, tau=2.0, teacher_weights=w)
    loss, grad = _run(backend, z, ts_bad, y, device, **kw)
    clean = ts_bad.clone()
    clean[:, bad] = ts[:, bad]
    cl, cg = _run(backend, z, clean, y, device, **kw)
    _check(loss, grad, cl, cg, bad, R)
    P, negent = ops.teacher_mixture(
        ts_bad.to(device), w.to(device), y.to(device), tau=2.0, not_true=not_true, backend=backend
    )
    P, negent = P.cpu(), negent.cpu()
    for i in range(R):
        row_nan = bool(torch.isnan(negent[i])) and bool(torch.isnan(P[i]).all())
        assert row_nan == (i in bad), (i, negent[i], P[i])
    mloss, mgrad = _run(backend, z, None, y, device, kind=kind, tau=2.0, mixture=(P, negent))
    _check(mloss, mgrad, cl, cg, bad, R)
    # soft targets only (no negative entropy term read): the NaN reaches the loss through P
    sl, _ = _run(backend, z, None, y, device, kind=kind, tau=2.0, soft_ce=True, mixture=(P, negent))
    assert all(math.isnan(sl[i].item()) for i in bad)


@pytest.mark.parametrize("backend,device", CASES)
@pytest.mark.parametrize("R,C", SHAPES)
def test_asd_weights_of_a_poisoned_teacher_are_nan(backend, device, R, C):
    """ASD: a NaN or +inf teacher logit makes that row's entropy weight NaN, and, through the per-client
    normalisation, its client's rows; the other client's rows are untouched."""
    z, t, y = _inputs(R, C)
    seg = torch.tensor([0] * 3 + [1] * (R - 3))
    prior = torch.softmax(torch.randn(2, C, generator=torch.Generator().manual_seed(2)), 1)
    d = lambda *ts: [v.to(device) for v in ts]  # noqa: E731
    w = ops.asd_weights(*d(t, y, prior, seg), backend=backend).cpu()
    assert torch.isfinite(w).all()
    tb = t.clone()
    tb[4, int(y[4])] = NAN
    tb[3, 0] = INF
    tb[0, int((y[0] + 1) % C)] = -INF
    wb = ops.asd_weights(*d(tb, y, prior, seg), backend=backend).cpu()
    assert torch.isnan(wb[[3, 4]]).all() and torch.isfinite(wb[[0, 1, 2]]).all()
    loss, _ = _run(backend, z, tb, y, device, kind="full", tau=2.0, class_prior=prior, segments=seg)
    assert torch.isnan(loss[3:]).all() and torch.isfinite(loss[:3]).all()


@pytest.mark.parametrize("backend,device", CASES)
def test_nn_losses_and_linear_kd_give_nan(backend, device):
    """The modules users call, reduced: a NaN teacher logit at a row's target makes the mean NaN (KD, GKD with
    VOTE teachers, ASD, LinearKDLoss); -inf teacher logits alone keep it finite."""
    R, C, H = 6, 10, 8
    z, t, y = (v.to(device) for v in _inputs(R, C))
    tn = t.clone()
    tn[1, int(y[1])] = NAN
    ti = t.clone()
    ti[1, int((y[1] + 1) % C)] = -INF
    prior = torch.full((C,), 1.0 / C, device=device)
    cases = [
        (fnn.KDLoss(tau=2.0, backend=backend), {}),
        (fnn.GKDLoss(tau=2.0, backend=backend), "vote"),
        (fnn.ASDLoss(tau=2.0, backend=backend), {"class_prior": prior}),
    ]
    for loss_fn, extra in cases:
        if extra == "vote":
            w = torch.tensor([0.5, 0.5], device=device)
            out = loss_fn(z, torch.stack([tn, t]), y, teacher_weights=w)
            ok = loss_fn(z, torch.stack([ti, t]), y, teacher_weights=w)
        else:
            out, ok = loss_fn(z, tn, y, **extra), loss_fn(z, ti, y, **extra)
        assert math.isnan(out.item()) and math.isfinite(ok.item()), type(loss_fn).__name__
    g = torch.Generator().manual_seed(3)
    h, W = torch.randn(R, H, generator=g).to(device), torch.randn(C, H, generator=g).to(device)
    lin = fnn.LinearKDLoss(tau=2.0, backend=backend)
    assert math.isnan(lin(h, W, y, tn).item()) and math.isfinite(lin(h, W, y, ti).item())
    hb = h.clone()
    hb[2, 0] = NAN
    assert math.isnan(lin(hb, W, y, t).item())
