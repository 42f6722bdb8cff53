"""``fedfast.ops.distill``'s fast lane (issue 59, item 5): the common eager CPU call skips the general path's Python
but must compute exactly what it computes, check what it checks, and step aside for everything else."""

import sys

import numpy as np
import pytest
import torch

import fedfast.nn as fnn
import fedfast.ops  # noqa: F401

D = sys.modules["fedfast.ops.distill"]


def _data(R=33, C=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(R, C, generator=g) * 2
    t = torch.randn(R, C, generator=g) * 2
    y = torch.randint(0, C, (R,), generator=g)
    y[4] = -100
    prior = torch.rand(C, generator=g) + 0.1
    return z, t, y, prior / prior.sum()


MODULES = {
    "kd": lambda: fnn.KDLoss(tau=3.0, ce_weight=0.7, kd_weight=1.3),
    "kd_sum": lambda: fnn.KDLoss(tau=3.0, reduction="sum"),
    "ntd": lambda: fnn.NTDLoss(tau=2.0, beta=0.8),
    "gkd": lambda: fnn.GKDLoss(tau=1.5, gamma=0.4),
    "asd": lambda: fnn.ASDLoss(tau=2.0, lam=0.6),
}


def _run(name, z, t, y, prior):
    m = MODULES[name]()
    zz = z.clone().requires_grad_(True)
    loss = m(zz, t, y, prior) if name == "asd" else m(zz, t, y)
    loss.backward()
    return loss.detach(), zz.grad


@pytest.mark.parametrize("name", list(MODULES))
def test_the_fast_lane_is_taken_and_equals_the_general_path(name, monkeypatch):
    z, t, y, prior = _data()
    calls = []
    real = D._fast_lane

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(D, "_fast_lane", spy)
    monkeypatch.setattr(fnn, "_fast_lane", spy)  # the modules call it first
    fast = _run(name, z, t, y, prior)
    assert calls == [True], calls
    monkeypatch.setenv("FEDFAST_VALIDATE", "eager")  # any setting in the environment: the general path
    calls.clear()
    general = _run(name, z, t, y, prior)
    assert calls and not any(calls), calls
    assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1])


def test_the_fast_lane_checks_targets_and_priors_by_name():
    z, t, y, prior = _data()
    bad = y.clone()
    bad[3] = 7
    with pytest.raises(ValueError, match=r"target: class indices must lie in \[0, 7\)"):
        fnn.KDLoss()(z.requires_grad_(), t, bad)
    with pytest.raises(ValueError, match="class_prior"):
        fnn.ASDLoss()(z, t, y, torch.zeros(7))


@pytest.mark.parametrize(
    "case",
    ["float64", "int32 labels", "strided teacher", "teacher shape", "numpy tau", "segments", "no grad", "bf16"],
)
def test_everything_else_takes_the_general_path(case, monkeypatch):
    z, t, y, prior = _data()
    seen = []
    real = D._fast_lane
    monkeypatch.setattr(D, "_fast_lane", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    kw = dict(tau=2.0)
    if case == "float64":
        z, t = z.double(), t.double()
    elif case == "int32 labels":
        y = y.int()
    elif case == "strided teacher":
        t = torch.randn(7, 33).T
    elif case == "teacher shape":
        with pytest.raises(ValueError, match="teacher: expected"):
            fedfast.ops.distill(z, t[:, :5], y)
        return
    elif case == "numpy tau":
        kw = dict(tau=np.float32(2.0))
    elif case == "bf16":
        z = z.bfloat16()
    want = fedfast.ops.distill(z, t, y, **kw)
    if case == "segments":
        seg = torch.tensor([0] * 10 + [1] * 23)
        out = fedfast.ops.distill(z, t, y, segments=seg, **kw)
        assert out.shape == () and not torch.equal(out, want)
        assert len(seen) == 1 and seen[0] is not None  # the call without segments took it
        return
    if case == "no grad":
        with torch.no_grad():
            assert torch.equal(fedfast.ops.distill(z, t, y, **kw), want)
        return
    assert all(s is None for s in seen)
