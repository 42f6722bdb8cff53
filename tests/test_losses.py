"""The drop-in modules against independent, naive PyTorch formulas written from the papers, plus the
spec's properties (methods-*.md) and reductions/segments."""

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_backends
from helpers import make_inputs, rel_err

from fedfast import nn as ffnn, ops

BACKENDS = cpu_backends()


def kl_rows(p_logits, q_logits, tau):
    """KL(softmax(p/tau) || softmax(q/tau)) per row, float64 (torch.kl_div)."""
    return F.kl_div(
        F.log_softmax(q_logits.double() / tau, 1),
        F.log_softmax(p_logits.double() / tau, 1),
        reduction="none",
        log_target=True,
    ).sum(1)


def ntd_rows_gather(z, t, y, tau):
    """FedNTD not-true KL, gather form as in the official code: drop column y, softmax over C-1."""
    R, C = z.shape
    idx = torch.stack([torch.cat([torch.arange(0, int(yi)), torch.arange(int(yi) + 1, C)]) for yi in y])
    return kl_rows(t.double().gather(1, idx), z.double().gather(1, idx), tau)


def _grad(loss_fn, z):
    zz = (
        z.detach().clone().double().requires_grad_(True)
        if z.dtype == torch.float64
        else z.detach().clone().requires_grad_(True)
    )
    out = loss_fn(zz)
    out.backward()
    return out.detach(), zz.grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_kd_loss_matches_naive(backend):
    z, t, y = make_inputs(12, 10, ignore=False)
    m = ffnn.KDLoss(tau=3.0, ce_weight=0.6, kd_weight=0.8, backend=backend)
    naive = lambda zz: 0.6 * F.cross_entropy(zz.double(), y) + 0.8 * 9.0 * kl_rows(t, zz, 3.0).mean()  # noqa
    l1, g1 = _grad(lambda zz: m(zz, t, y), z)
    l0, g0 = _grad(naive, z)
    assert rel_err(l1, l0) <= 1e-5 and rel_err(g1, g0) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tau_squared", [True, False])
def test_ntd_loss_matches_gather_form(backend, tau_squared):
    z, t, y = make_inputs(12, 10, ignore=False)
    m = ffnn.NTDLoss(tau=2.0, beta=0.7, tau_squared=tau_squared, backend=backend)
    s = 4.0 if tau_squared else 1.0
    naive = lambda zz: F.cross_entropy(zz.double(), y) + 0.7 * s * ntd_rows_gather(zz, t, y, 2.0).mean()  # noqa
    l1, g1 = _grad(lambda zz: m(zz, t, y), z)
    l0, g0 = _grad(naive, z)
    assert rel_err(l1, l0) <= 1e-5 and rel_err(g1, g0) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("not_true", [False, True])
@pytest.mark.parametrize("entropy_tau", [2.0, 1.0])
def test_asd_loss_matches_naive(backend, not_true, entropy_tau):
    """CE_mean + lam * sum_i alpha_i KL_i per segment, alpha = exp(-H)/prior[y] normalised per segment."""
    R, C = 14, 10
    z, t, y = make_inputs(R, C, ignore=False)
    seg = torch.tensor([0] * 5 + [1] * 6 + [2] * 3)
    prior = torch.rand(3, C) + 0.1
    prior = prior / prior.sum(1, keepdim=True)
    m = ffnn.ASDLoss(tau=2.0, lam=10.0, not_true=not_true, entropy_tau=entropy_tau, backend=backend)
    et = entropy_tau

    def naive(zz):
        pt = F.softmax(t.double() / et, 1)
        H = -(pt * pt.log()).sum(1)
        ahat = torch.exp(-H) / prior.double()[seg, y]
        kl = ntd_rows_gather(zz, t, y, 2.0) if not_true else kl_rows(t, zz, 2.0)
        ce = F.cross_entropy(zz.double(), y, reduction="none")
        tot = 0
        for s in range(3):
            k = seg == s
            alpha = ahat[k] / ahat[k].sum()
            tot = tot + ce[k].mean() + 10.0 * (alpha * kl[k]).sum()
        return tot

    l1, g1 = _grad(lambda zz: m(zz, t, y, prior, segments=seg), z)
    l0, g0 = _grad(naive, z)
    assert rel_err(l1, l0) <= 1e-5 and rel_err(g1, g0) <= 1e-5
    per = ffnn.ASDLoss(
        tau=2.0, lam=10.0, not_true=not_true, entropy_tau=entropy_tau, backend=backend, reduction="segment"
    )(z, t, y, prior, segments=seg, num_segments=3)
    assert per.shape == (3,) and rel_err(per.sum(), l0) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_gkd_loss_single_and_vote(backend):
    R, C, M = 10, 10, 4
    z, _, y = make_inputs(R, C, ignore=False)
    T = torch.randn(M, R, C) * 2
    vl = torch.rand(M)
    w = torch.softmax(-M * vl, 0)  # VOTE weights softmax(-M * val_loss)
    m = ffnn.GKDLoss(tau=1.0, gamma=0.2, backend=backend)
    naive1 = lambda zz: F.cross_entropy(zz.double(), y) + 0.1 * kl_rows(T[0], zz, 1.0).mean()  # noqa
    l1, g1 = _grad(lambda zz: m(zz, T[0], y), z)
    l0, g0 = _grad(naive1, z)
    assert rel_err(l1, l0) <= 1e-5 and rel_err(g1, g0) <= 1e-5
    naivev = lambda zz: (
        F.cross_entropy(zz.double(), y)
        + 0.1
        * sum(  # noqa
            float(w[k]) * kl_rows(T[k], zz, 1.0).mean() for k in range(M)
        )
    )
    l1, g1 = _grad(lambda zz: m(zz, T, y, teacher_weights=w), z)
    l0, g0 = _grad(naivev, z)
    assert rel_err(l1, l0) <= 1e-5 and rel_err(g1, g0) <= 1e-5
    # a precomputed mixture (the engine caches it once per round) gives the same loss and gradient
    mix = ops.teacher_mixture(T, w, y, tau=1.0, backend=backend)
    l2, g2 = _grad(lambda zz: ops.distill(zz, None, y, kd_weight=0.1, mixture=mix, backend=backend), z)
    assert rel_err(l2, l0) <= 1e-5 and rel_err(g2, g0) <= 1e-5
    with pytest.raises(ValueError, match="mixture"):
        ops.distill(z, T[0], y, mixture=mix, backend=backend)
    with pytest.raises(ValueError, match="mixture"):
        ops.distill(z, None, y, mixture=(mix[0][:3], mix[1]), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vote_gradient_equals_kd_to_mixture(backend):
    """FedGKD-VOTE mixture identity: grad of sum_m g_m KL(p_m||q) == grad of G * KL(pbar||q), pbar = sum g_m p_m / G."""
    R, C, M = 9, 10, 3
    z, _, y = make_inputs(R, C, ignore=False)
    T = torch.randn(M, R, C) * 2
    w = torch.tensor([0.2, 0.5, 0.3])
    _, g1 = _grad(lambda zz: ffnn.GKDLoss(tau=2.0, gamma=0.4, backend=backend)(zz, T, y, teacher_weights=w), z)
    pbar = (w[:, None, None] * F.softmax(T.double() / 2.0, 2)).sum(0)

    def naive(zz):
        kl = (pbar * (pbar.log() - F.log_softmax(zz.double() / 2.0, 1))).sum(1)
        return F.cross_entropy(zz.double(), y) + 0.2 * 4.0 * kl.mean()

    _, g0 = _grad(naive, z)
    assert rel_err(g1, g0) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_cad_loss_matches_naive_and_alpha0_is_ce(backend):
    R, C = 12, 10
    z, t, y = make_inputs(R, C, ignore=False)
    alpha = torch.rand(C)
    m = ffnn.CADLoss(tau=2.0, backend=backend)

    def naive(zz):
        a = alpha.double()[y]
        soft = -(F.softmax(t.double() / 2.0, 1) * F.log_softmax(zz.double() / 2.0, 1)).sum(1)
        return ((1 - a) * F.cross_entropy(zz.double(), y, reduction="none") + a * soft).mean()

    l1, g1 = _grad(lambda zz: m(zz, t, y, alpha), z)
    l0, g0 = _grad(naive, z)
    assert rel_err(l1, l0) <= 1e-5 and rel_err(g1, g0) <= 1e-5
    l1, g1 = _grad(lambda zz: m(zz, t, y, torch.zeros(C)), z)
    l0, g0 = _grad(lambda zz: F.cross_entropy(zz.double(), y), z)
    assert rel_err(l1, l0) <= 1e-6 and rel_err(g1, g0) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_adc_loss_matches_naive(backend):
    R, C = 12, 10
    z, t, y = make_inputs(R, C, ignore=False)
    seg = torch.tensor([0] * 7 + [1] * 5)
    freq = torch.randint(0, 50, (2, C)).float()
    freq[:, 0] = 0  # a class absent locally (rho = 0)
    m = ffnn.ADCLoss(tau=4.0, lam=0.35, backend=backend)

    def naive(zz):
        rho = (freq / freq.max(1, keepdim=True).values).double()[seg]
        p = F.softmax(t.double() / 4.0, 1)
        onehot = F.one_hot(y, C).bool()
        phat = torch.where(onehot, 0.0, (1 - rho) * p)
        phat = phat + onehot * (1 - phat.sum(1, keepdim=True))  # Eq. 9: 1 - sum_{c!=y} (1-rho_c) p_c
        kl = (torch.xlogy(phat, phat) - phat * F.log_softmax(zz.double() / 4.0, 1)).sum(1)
        ce = F.cross_entropy(zz.double(), y, reduction="none")
        rows = 0.65 * ce + 0.35 * 16.0 * kl
        return rows[seg == 0].mean() + rows[seg == 1].mean()

    l1, g1 = _grad(lambda zz: m(zz, t, y, freq, segments=seg), z)
    l0, g0 = _grad(naive, z)
    assert rel_err(l1, l0) <= 1e-5 and rel_err(g1, g0) <= 1e-5


def test_adc_target_properties():
    """phat sums to 1 and is >= 0; rho = 1 everywhere gives one-hot (loss = (1-lam) CE + lam*s*CE-like)."""
    R, C = 6, 5
    z, t, y = make_inputs(R, C, ignore=False)
    iid = ffnn.ADCLoss(tau=1.0, lam=0.35, tau_squared=False, backend="reference")(z, t, y, torch.ones(C)).detach()
    ce = F.cross_entropy(z.double(), y)
    assert abs(float(iid) - float(ce)) <= 1e-5 * float(ce)  # one-hot target: KL(e_y || q) = CE at tau=1
    kd = ffnn.KDLoss(tau=2.0, ce_weight=0.65, kd_weight=0.35, backend="reference")(z, t, y)
    freq = torch.zeros(C)
    freq[y[0]] = 1.0  # rho = 0 for every class except one that is never a non-true class of row 0
    adc = ffnn.ADCLoss(tau=2.0, lam=0.35, backend="reference")(z[:1], t[:1], y[:1], freq)
    kd1 = ffnn.KDLoss(tau=2.0, ce_weight=0.65, kd_weight=0.35, backend="reference")(z[:1], t[:1], y[:1])
    assert abs(float(adc) - float(kd1)) <= 1e-5 * float(kd1)
    assert torch.isfinite(kd)


# ---- FedNTD properties (Lee et al. 2022, Eq. 10-11) ----
@pytest.mark.parametrize("backend", BACKENDS)
def test_ntd_properties(backend):
    R, C = 8, 10
    z, t, y = make_inputs(R, C, ignore=False)
    ntd_only = lambda zz, tt: ops.distill(
        zz,
        tt,
        y,
        kind="not_true",
        tau=2.0,
        ce_weight=0.0,
        kd_weight=1.0,  # noqa
        backend=backend,
        reduction="none",
    )
    # 1. student == teacher: zero loss and zero gradient
    zz = t.clone().requires_grad_(True)
    l = ntd_only(zz, t)
    l.sum().backward()
    assert l.abs().max() <= 1e-6 and zz.grad.abs().max() <= 1e-7
    # zero gradient on the true class (exactly)
    zz = z.clone().requires_grad_(True)
    l = ntd_only(zz, t)
    l.sum().backward()
    assert (zz.grad.gather(1, y[:, None]) == 0).all()
    # 2. changing true-class logits of either model does not change the loss
    z2, t2 = z.clone(), t.clone()
    z2[torch.arange(R), y] += 50.0
    t2[torch.arange(R), y] -= 30.0
    assert rel_err(ntd_only(z2, t2).detach(), l.detach()) <= 1e-5
    # 3. shift invariance per row
    sh = torch.randn(R, 1) * 100
    assert rel_err(ntd_only(z + sh, t - sh).detach(), l.detach()) <= 1e-4
    # 4. C = 2: the NTD term vanishes identically
    z2c, t2c, y2c = make_inputs(R, 2, ignore=False)
    l2 = ops.distill(
        z2c, t2c, y2c, kind="not_true", tau=2.0, ce_weight=0.0, kd_weight=1.0, backend=backend, reduction="none"
    )
    assert l2.abs().max() == 0
    # 5. beta = 0 is CE
    ce = ffnn.NTDLoss(beta=0.0, backend=backend)(z, t, y)
    assert rel_err(ce, F.cross_entropy(z.double(), y)) <= 1e-6


# ---- ASD properties (Yashwanth et al., Eq. 5-11) ----
@pytest.mark.parametrize("backend", BACKENDS)
def test_asd_weight_properties(backend):
    R, C = 10, 7
    z, t, y = make_inputs(R, C, ignore=False)
    seg = torch.tensor([0] * 4 + [1] * 6)
    prior = torch.full((2, C), 1.0 / C)
    ahat = ops.asd_weights(t, y, prior, seg, entropy_tau=2.0, backend=backend)
    rw = ops.asd_row_weight(ahat, y, C, seg)
    n = torch.tensor([4.0] * 4 + [6.0] * 6)
    alpha = rw / n
    assert abs(float(alpha[:4].sum()) - 1) <= 1e-6 and abs(float(alpha[4:].sum()) - 1) <= 1e-6
    H = -torch.log(ahat * prior[0, 0])  # ahat = exp(-H) / prior
    assert (H >= -1e-6).all() and (H <= torch.log(torch.tensor(float(C))) + 1e-5).all()
    # all rows alike (same label, same teacher row): uniform alpha, and ASD == uniform-weight KD
    t1 = t[:1].expand(R, C).contiguous()
    y1 = torch.full((R,), 3)
    a1 = ops.asd_row_weight(ops.asd_weights(t1, y1, prior[0], None, backend=backend), y1, C)
    assert (a1 - 1).abs().max() <= 1e-6
    asd = ffnn.ASDLoss(tau=2.0, lam=10.0, backend=backend)(z, t1, y1, prior[0])
    uni = ffnn.KDLoss(tau=2.0, kd_weight=10.0, tau_squared=False, backend=backend)(z, t1, y1)
    assert rel_err(asd, uni) <= 1e-6
    # lam = 0 is CE
    assert rel_err(ffnn.ASDLoss(lam=0.0, backend=backend)(z, t, y, prior[0]), F.cross_entropy(z.double(), y)) <= 1e-6


# ---- reductions, ignore_index and segments ----
@pytest.mark.parametrize("backend", BACKENDS)
def test_reductions_and_segments(backend):
    R, C = 13, 6
    z, t, y = make_inputs(R, C, ignore=False)
    y[[2, 9]] = -100
    seg = torch.tensor([0] * 5 + [1] * 4 + [2] * 4)
    m = lambda red: ffnn.NTDLoss(tau=2.0, beta=1.0, reduction=red, backend=backend)  # noqa
    rows = m("none")(z, t, y)
    assert rows[2] == 0 and rows[9] == 0
    valid = y != -100
    assert rel_err(m("mean")(z, t, y), rows.sum() / valid.sum()) <= 1e-6
    assert rel_err(m("sum")(z, t, y), rows.sum()) <= 1e-6
    per = m("segment")(z, t, y, segments=seg)
    exp = torch.stack([rows[seg == s].sum() / (valid & (seg == s)).sum() for s in range(3)])
    assert rel_err(per, exp) <= 1e-6
    assert rel_err(m("mean")(z, t, y, segments=seg), exp.sum()) <= 1e-6
    # each client's gradient is exactly that of its own minibatch mean loss
    zz = z.clone().requires_grad_(True)
    m("mean")(zz, t, y, segments=seg).backward()
    for s in range(3):
        k = seg == s
        zs = z[k].clone().requires_grad_(True)
        m("mean")(zs, t[k], y[k]).backward()
        assert rel_err(zz.grad[k], zs.grad) <= 1e-6
    # all rows ignored: mean is 0 (not NaN), gradient 0
    yi = torch.full((R,), -100)
    zz = z.clone().requires_grad_(True)
    out = m("mean")(zz, t, yi)
    out.backward()
    assert float(out.detach()) == 0 and (zz.grad == 0).all()


def test_one_row_and_int32_targets():
    for be in BACKENDS:
        z, t, _ = make_inputs(1, 5)
        y = torch.tensor([4], dtype=torch.int32)
        a = ffnn.KDLoss(backend=be)(z, t, y)
        b = ffnn.KDLoss(backend="reference")(z, t, y.long())
        assert rel_err(a, b) <= 1e-6


def test_gradcheck_reference():
    """gradcheck (float64) on the reference, every mode."""
    R, C = 4, 5
    z = torch.randn(R, C, dtype=torch.float64, requires_grad=True)
    t = torch.randn(R, C, dtype=torch.float64)
    y = torch.tensor([0, 4, -100, 2])
    seg = torch.tensor([0, 0, 1, 1])
    for kw in [
        dict(),
        dict(not_true=True),
        dict(soft_ce=True, class_alpha=torch.rand(C, dtype=torch.float64)),
        dict(rho=torch.rand(2, C, dtype=torch.float64), segments=seg),
        dict(row_weight=torch.rand(R, dtype=torch.float64), not_true=True),
    ]:
        f = lambda zz: ops.distill_reference(zz, t, y, tau=2.0, kd_weight=1.7, **kw)  # noqa
        assert torch.autograd.gradcheck(f, (z,))
    # and the op's own autograd (closed-form gradient) through gradcheck in float64
    f = lambda zz: ops.distill(zz, t, y, kind="not_true", tau=2.0, backend="reference", reduction="none")  # noqa
    assert torch.autograd.gradcheck(f, (z,))
    f = lambda zz: ops.distill(
        zz,
        t,
        y,
        tau=2.0,
        backend="cpu" if "cpu" in BACKENDS else "reference",  # noqa
        reduction="none",
    )
    assert torch.autograd.gradcheck(f, (z,))


def test_closed_form_gradient_matches_autograd():
    """The reference backend's closed form == autograd through the spec (float64), every mode."""
    R, C = 7, 6
    z = torch.randn(R, C, dtype=torch.float64)
    t = torch.randn(R, C, dtype=torch.float64) * 2
    y = torch.tensor([0, 5, -100, 2, 3, 1, 1])
    seg = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    for kw in [
        dict(),
        dict(not_true=True),
        dict(soft_ce=True, class_alpha=torch.rand(C, dtype=torch.float64)),
        dict(rho=torch.rand(2, C, dtype=torch.float64), segments=seg),
        dict(row_weight=torch.rand(R).double()),
    ]:
        zz = z.clone().requires_grad_(True)
        l0 = ops.distill_reference(zz, t, y, tau=3.0, ce_weight=0.3, kd_weight=2.0, **kw)
        (g0,) = torch.autograd.grad(l0.sum(), zz)
        l1, g1 = ops.distill_rows_reference(z, t, y, tau=3.0, ce_weight=0.3, kd_weight=2.0, **kw)
        assert rel_err(l1, l0.detach()) <= 1e-12 and rel_err(g1, g0) <= 1e-12
