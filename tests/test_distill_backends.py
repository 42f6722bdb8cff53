"""Every backend that runs here against the float64 reference (autograd through distill_reference)."""
import pytest
import torch

from fedfast import ops
from fedfast.ops import distill_reference

from conftest import cpu_backends
from helpers import make_inputs, rel_err

BACKENDS = cpu_backends()
SHAPES = [(1, 2), (3, 2), (5, 3), (17, 10), (9, 100), (4, 1000), (3, 1023)]
SHAPES_SLOW = [(2, 32000)]


def _oracle(z, t, y, **kw):
    """float64 loss rows and autograd gradient of sum(loss) w.r.t. the student."""
    z64 = z.detach().double().requires_grad_(True)
    conv = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kw.items()}
    loss = distill_reference(z64, t.double(), y, **conv)
    (g,) = torch.autograd.grad(loss.sum(), z64)
    return loss.detach(), g


def _run(backend, z, t, y, **kw):
    """Per-row loss and gradient through the public op (reduction='none', backward of the sum)."""
    zz = z.detach().clone().requires_grad_(True)
    loss = ops.distill(zz, t, y, reduction="none", backend=backend, **kw)
    loss.sum().backward()
    return loss.detach(), zz.grad


MODES = {
    "kd": dict(kind="full", tau=4.0, ce_weight=1.0, kd_weight=16.0),
    "ntd": dict(kind="not_true", tau=2.0, kd_weight=4.0),
    "cad": dict(kind="full", tau=2.0, soft_ce=True, class_alpha="alpha"),
    "adc": dict(kind="full", tau=4.0, ce_weight=0.65, kd_weight=0.35 * 16, rho="rho"),
    "asdrow": dict(kind="full", tau=2.0, kd_weight=10.0, row_weight="rw"),
    "ntd_asdrow": dict(kind="not_true", tau=2.0, kd_weight=10.0, row_weight="rw"),
}


def _mode_kwargs(mode, R, C, y):
    kw = dict(MODES[mode])
    g = torch.Generator().manual_seed(R + C)
    if kw.get("class_alpha") == "alpha":
        kw["class_alpha"] = torch.rand(C, generator=g)
    if kw.get("rho") == "rho":
        kw["rho"] = torch.rand(C, generator=g)
    if kw.get("row_weight") == "rw":
        kw["row_weight"] = torch.rand(R, generator=g) * 2
    ref_kw = {k: v for k, v in kw.items() if k != "kind"}
    ref_kw["not_true"] = kw["kind"] == "not_true"
    return kw, ref_kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("R,C", SHAPES)
def test_backend_matches_reference_fp32(backend, mode, R, C):
    z, t, y = make_inputs(R, C)
    kw, ref_kw = _mode_kwargs(mode, R, C, y)
    l0, g0 = _oracle(z, t, y, **ref_kw)
    l1, g1 = _run(backend, z, t, y, **kw)
    assert l1.dtype == torch.float32 and g1.dtype == torch.float32
    assert rel_err(l1, l0) <= 1e-5, (rel_err(l1, l0), l1, l0)
    assert rel_err(g1, g0) <= 1e-5, rel_err(g1, g0)
    if R >= 3:  # the ignored row contributes nothing
        assert l1[1] == 0 and (g1[1] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["kd", "ntd", "adc"])
@pytest.mark.parametrize("R,C", SHAPES_SLOW)
def test_backend_large_C(backend, mode, R, C):
    z, t, y = make_inputs(R, C, ignore=False)
    kw, ref_kw = _mode_kwargs(mode, R, C, y)
    l0, g0 = _oracle(z, t, y, **ref_kw)
    l1, g1 = _run(backend, z, t, y, **kw)
    assert rel_err(l1, l0) <= 1e-5 and rel_err(g1, g0) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sdt,tdt", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                     (torch.float32, torch.bfloat16), (torch.float32, torch.float16)])
def test_low_precision_inputs(backend, sdt, tdt):
    """bf16/fp16 students and teachers: fp32 math on the rounded inputs, gradient stored in the student dtype."""
    R, C = 11, 37
    z, t, y = make_inputs(R, C)
    z, t = z.to(sdt), t.to(tdt)
    for mode in ("kd", "ntd"):
        kw, ref_kw = _mode_kwargs(mode, R, C, y)
        l0, g0 = _oracle(z.float(), t.float(), y, **ref_kw)
        l1, g1 = _run(backend, z, t, y, **kw)
        assert g1.dtype == sdt and l1.dtype == torch.float32
        assert rel_err(l1, l0) <= 1e-5
        tol = 1e-5 if sdt == torch.float32 else (8e-3 if sdt == torch.bfloat16 else 1e-3)  # one rounding of dz
        assert rel_err(g1, g0) <= tol


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["full", "not_true"])
def test_extreme_logits(backend, kind):
    """Logits of +-1e4, -inf teacher entries, a true-class probability of 1: finite, exact results."""
    R, C = 6, 7
    z = torch.randn(R, C)
    t = torch.randn(R, C)
    y = torch.tensor([0, 1, 2, 3, 4, 5])
    z[0] = 1e4; z[0, 3] = -1e4                 # huge logits
    z[1, 1] = 1e4                               # q_y -> 1 (trained local model)
    t[2] = float("-inf"); t[2, 5] = 0.0         # teacher one-hot via -inf
    t[3, 0] = float("-inf")                     # a -inf teacher logit
    t[4, 4] = 1e4                               # teacher true-class prob -> 1
    z[5] = -1e4; t[5] = 1e4
    l0, g0 = _oracle(z, t, y, tau=2.0, kd_weight=1.5, not_true=(kind == "not_true"))
    l1, g1 = _run(backend, z, t, y, kind=kind, tau=2.0, kd_weight=1.5)
    assert torch.isfinite(l1).all() and torch.isfinite(g1).all()
    assert torch.isfinite(l0).all()
    assert rel_err(l1, l0) <= 1e-5 and rel_err(g1, g0) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_teacher_mixture_matches_reference(backend):
    for (M, R, C) in [(1, 3, 2), (3, 9, 10), (5, 4, 1023)]:
        T = torch.randn(M, R, C) * 3
        w = torch.rand(M)
        y = torch.randint(0, C, (R,))
        y[0] = -100
        for nt in (False, True):
            P0, n0 = ops.teacher_mixture_reference(T.double(), w.double(), y, tau=2.0, not_true=nt)
            P1, n1 = ops.teacher_mixture(T, w, y, tau=2.0, not_true=nt, backend=backend)
            assert rel_err(P1, P0) <= 1e-5 and rel_err(n1, n0) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_asd_weights_match_reference(backend):
    for (R, C, S) in [(1, 2, 1), (12, 10, 3), (6, 1000, 2)]:
        t = torch.randn(R, C) * 3
        t[0, 0] = float("-inf")
        y = torch.randint(0, C, (R,))
        if R > 2:
            y[2] = -100
        seg = torch.sort(torch.randint(0, S, (R,))).values
        prior = torch.rand(S, C) + 0.05
        a0 = ops.asd_weights_reference(t.double(), y, prior.double(), seg, entropy_tau=2.0)
        a1 = ops.asd_weights(t, y, prior, seg, entropy_tau=2.0, backend=backend)
        assert rel_err(a1, a0) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_vote_through_op_matches_sum_of_kls(backend):
    """distill with M teachers equals sum_m w_m KL_m (loss and gradient), computed term by term in fp64."""
    M, R, C = 3, 8, 10
    z, _, y = make_inputs(R, C)
    T = torch.randn(M, R, C) * 2
    w = torch.tensor([0.5, 0.3, 0.2])
    l1, g1 = _run(backend, z, T, y, tau=2.0, kd_weight=0.4, teacher_weights=w)
    z64 = z.double().requires_grad_(True)
    tot = distill_reference(z64, T[0].double(), y, tau=2.0, ce_weight=1.0, kd_weight=0.0)
    for m in range(M):
        tot = tot + distill_reference(z64, T[m].double(), y, tau=2.0, ce_weight=0.0, kd_weight=0.4 * float(w[m]))
    (g0,) = torch.autograd.grad(tot.sum(), z64)
    assert rel_err(l1, tot.detach()) <= 1e-5 and rel_err(g1, g0) <= 1e-5
