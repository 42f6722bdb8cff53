"""Every backend that runs here against the float64 reference (autograd through distill_reference)."""

import pytest
import torch
from conftest import cpu_backends
from helpers import make_inputs, rel_err

from fedfast import ops
from fedfast.ops import distill_reference

BACKENDS = cpu_backends()
# the cpu backend runs rows of C <= 128 sixteen at a time (csrc/distill_cpu.cpp): whole and partial blocks on both
# sides of that bound
SHAPES = [(1, 2), (3, 2), (5, 3), (17, 10), (9, 100), (37, 128), (18, 129), (4, 1000), (3, 1023)]
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
@pytest.mark.parametrize(
    "sdt,tdt",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
)
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
    z[0] = 1e4
    z[0, 3] = -1e4  # huge logits
    z[1, 1] = 1e4  # q_y -> 1 (trained local model)
    t[2] = float("-inf")
    t[2, 5] = 0.0  # teacher one-hot via -inf
    t[3, 0] = float("-inf")  # a -inf teacher logit
    t[4, 4] = 1e4  # teacher true-class prob -> 1
    z[5] = -1e4
    t[5] = 1e4
    l0, g0 = _oracle(z, t, y, tau=2.0, kd_weight=1.5, not_true=(kind == "not_true"))
    l1, g1 = _run(backend, z, t, y, kind=kind, tau=2.0, kd_weight=1.5)
    assert torch.isfinite(l1).all() and torch.isfinite(g1).all()
    assert torch.isfinite(l0).all()
    assert rel_err(l1, l0) <= 1e-5 and rel_err(g1, g0) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_teacher_mixture_matches_reference(backend):
    for M, R, C in [(1, 3, 2), (3, 9, 10), (5, 4, 1023)]:
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
    for R, C, S in [(1, 2, 1), (12, 10, 3), (6, 1000, 2)]:
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
@pytest.mark.parametrize("R,C", [(8, 10), (35, 10), (5, 300)])
@pytest.mark.parametrize("not_true", [False, True])
def test_vote_through_op_matches_sum_of_kls(backend, R, C, not_true):
    """distill with M teachers equals sum_m w_m KL_m (loss and gradient), computed term by term in fp64 (the cpu
    backend mixes the teachers inside the row op: narrow blocks and wide rows)."""
    M = 3
    z, _, y = make_inputs(R, C)
    T = torch.randn(M, R, C) * 2
    w = torch.tensor([0.5, 0.3, 0.2])
    kind = "not_true" if not_true else "full"
    l1, g1 = _run(backend, z, T, y, tau=2.0, kd_weight=0.4, teacher_weights=w, kind=kind)
    z64 = z.double().requires_grad_(True)
    tot = distill_reference(z64, T[0].double(), y, tau=2.0, ce_weight=1.0, kd_weight=0.0)
    for m in range(M):
        tot = tot + distill_reference(
            z64, T[m].double(), y, tau=2.0, ce_weight=0.0, kd_weight=0.4 * float(w[m]), not_true=not_true
        )
    (g0,) = torch.autograd.grad(tot.sum(), z64)
    assert rel_err(l1, tot.detach()) <= 1e-5 and rel_err(g1, g0) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_asd_row_weights_in_one_call_match_the_two_ops(backend):
    """ops.asd_row_weights (one C++ pass on the cpu backend) equals asd_weights + asd_row_weight in float64, with
    per-client priors, segments and an ignored row; and distill(class_prior=...) equals distill(row_weight=...),
    with the loss's other terms too (the cpu kernel's one call dropped class_alpha, soft_ce and rho before they
    shared its one entry point)."""
    R, C, S = 37, 10, 3
    dt, tol = (torch.float64, 1e-12) if backend in ("cpu", "reference") else (torch.float32, 1e-5)  # GPU kernels: fp32
    g = torch.Generator().manual_seed(5)
    z = torch.randn(R, C, generator=g, dtype=torch.float64)
    t = torch.randn(R, C, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, C, (R,), generator=g)
    y[4] = -100
    seg = torch.sort(torch.randint(0, S, (R,), generator=g)).values
    prior = torch.rand(S, C, generator=g, dtype=torch.float64) + 0.05
    want = ops.asd_row_weight(ops.asd_weights_reference(t, y, prior, seg, entropy_tau=1.5), y, C, seg)
    z, t, prior = z.to(dt), t.to(dt), prior.to(dt)
    got = ops.asd_row_weights(t, y, prior, seg, entropy_tau=1.5, backend=backend)
    assert rel_err(got, want) <= tol and got[4] == 0
    alpha = torch.rand(C, generator=g, dtype=torch.float64).to(dt)
    rho = (0.9 * torch.rand(S, C, generator=g, dtype=torch.float64)).to(dt)
    for kind, extra in (
        ("full", {}),
        ("not_true", {}),
        ("full", dict(class_alpha=alpha)),
        ("full", dict(soft_ce=True)),
        ("full", dict(rho=rho)),
        ("not_true", dict(class_alpha=alpha)),
    ):
        kw = dict(tau=2.0, kd_weight=3.0, segments=seg, kind=kind, backend=backend, **extra)
        a = z.clone().requires_grad_()
        la = ops.distill(a, t, y, class_prior=prior, entropy_tau=1.5, **kw)
        la.backward()
        b = z.clone().requires_grad_()
        lb = ops.distill(b, t, y, row_weight=want.to(dt), **kw)
        lb.backward()
        assert rel_err(la, lb) <= tol and rel_err(a.grad, b.grad) <= tol


def test_asd_row_weights_refuse_bad_inputs_by_name():
    R, C = 6, 4
    t, y = torch.randn(R, C), torch.randint(0, C, (R,))
    zero = torch.ones(C)
    zero[int(y[0])] = 0.0
    with pytest.raises(ValueError, match="class_prior: must be finite"):
        ops.asd_row_weights(t, y, zero)
    with pytest.raises(ValueError, match="class_prior: must be finite"):
        ops.distill(torch.randn(R, C, requires_grad=True), t, y, class_prior=zero)
    with pytest.raises(ValueError, match="target: class indices"):
        ops.asd_row_weights(t, torch.full((R,), C), torch.ones(C))
    with pytest.raises(ValueError, match="segments: client ids must be sorted"):
        ops.asd_row_weights(t, y, torch.ones(C), torch.tensor([1, 0, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="class_prior: ASD computes the KD row weights"):
        ops.distill(torch.randn(R, C), t, y, class_prior=torch.ones(C), row_weight=torch.ones(R))
    with pytest.raises(ValueError, match="class_prior: ASD's weights need a single teacher"):
        ops.distill(torch.randn(R, C), torch.randn(2, R, C), y, class_prior=torch.ones(C))
    with pytest.raises(ValueError, match="entropy_tau"):
        ops.distill(torch.randn(R, C), t, y, class_prior=torch.ones(C), entropy_tau=0.0)


def test_vote_teacher_weights_checked_on_the_fused_path():
    R, C = 5, 4
    with pytest.raises(ValueError, match="teacher_weights: weights must be finite and >= 0"):
        ops.distill(
            torch.randn(R, C, requires_grad=True),
            torch.randn(2, R, C),
            torch.zeros(R, dtype=torch.long),
            teacher_weights=torch.tensor([0.5, -0.5]),
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none", "segment"])
def test_backward_twice_with_retain_graph(backend, reduction):
    """The eager backward scales the stored gradient in place only on its last use: with retain_graph=True the
    gradient stays intact for a second backward (equal results), and a kept graph (create_graph) gets a copy."""
    R, C = 9, 7
    z, t, y = make_inputs(R, C)
    seg = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2])
    zz = z.clone().requires_grad_()
    loss = ops.distill(zz, t, y, tau=2.0, kd_weight=2.0, reduction=reduction, segments=seg, backend=backend)
    w = torch.linspace(0.5, 2.0, loss.numel()).reshape(loss.shape)
    (loss * w).sum().backward(retain_graph=True)
    first = zz.grad.clone()
    zz.grad = None
    (loss * w).sum().backward()
    assert torch.equal(zz.grad, first)
    z2 = z.clone().requires_grad_()
    l2 = ops.distill(z2, t, y, tau=2.0, kd_weight=2.0, reduction=reduction, segments=seg, backend=backend)
    (g,) = torch.autograd.grad((l2 * w).sum(), z2)
    assert torch.equal(g, first)


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton not available")
def test_triton_rows_refuse_the_cpu_kernels_own_arguments_by_name():
    """FEDFAST_DISTILL_ROWS's argument order is every compiled backend's; the teacher mixture, ASD's prior and the
    in-place gradient are the C++ kernel's (fedfast.ops.distill does them in ops of their own elsewhere)."""
    from fedfast.triton.distill import distill_rows_triton

    z, t, y = torch.randn(4, 3), torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    base = [z, t, y, None, None, None, None, None, 1.0, None, None, None, 2.0, 1.0, 1.0, -100, False, False, False]
    loss, grad, status = distill_rows_triton(*base)
    ref_loss, ref_grad = ops.distill_rows_reference(z, t, y, tau=2.0)
    assert status == 0 and rel_err(loss, ref_loss) <= 1e-5 and rel_err(grad, ref_grad) <= 1e-5
    for i, name, value in (
        (4, "mix_weights", torch.ones(1)),
        (7, "class_prior", torch.ones(3)),
        (18, "in_place", True),
    ):
        args = list(base)
        args[i] = value
        with pytest.raises(ValueError, match=f"^{name}: the CPU kernel's argument"):
            distill_rows_triton(*args)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["full", "not_true"])
@pytest.mark.parametrize("R,C", [(64, 10), (32, 200), (4, 3000)])
def test_large_temperature_as_accurate_as_the_authors_code(backend, kind, R, C):
    """tau >= 100 (issue 59: the fp32 loss drifted 1.3e-4 from float64 where the authors' fp32 ``F.kl_div`` code
    drifts 1.5e-5): near-uniform rows, whose two log-sum-exps cancelled. Each backend's fp32 KL term, against float64,
    is at least as accurate as the authors' fp32 code on the same inputs (median over seeds), and within 1e-4 at
    tau = 1000 where theirs is ~2e-3. C = 3000 runs the Triton kernel's multi-tile path."""
    import statistics

    import torch.nn.functional as F

    for tau in (100.0, 1000.0):
        ours, theirs = [], []
        for seed in range(4):
            z, t, y = make_inputs(R, C, ignore=False, seed=seed)
            nt = kind == "not_true"

            def authors(zz, tt):  # their KL term: kl_div over the kept classes, tau^2, batchmean
                if nt:  # FedNTD's released code: the true class removed before the softmaxes
                    keep = torch.ones_like(zz, dtype=torch.bool).scatter_(1, y[:, None], False)
                    zz, tt = zz[keep].view(R, C - 1), tt[keep].view(R, C - 1)
                lq, p = F.log_softmax(zz / tau, 1), F.softmax(tt / tau, 1)
                return tau * tau * F.kl_div(lq, p, reduction="batchmean")

            exact = authors(z.double(), t.double()).item()
            theirs.append(abs(authors(z, t).item() - exact) / exact)
            got = ops.distill(z, t, y, tau=tau, ce_weight=0.0, kd_weight=tau * tau, kind=kind, backend=backend)
            ours.append(abs(got.item() - exact) / exact)
        assert statistics.median(ours) <= statistics.median(theirs), (tau, ours, theirs)
        assert max(ours) <= (1e-5 if tau == 100.0 else 1e-4), (tau, ours)
