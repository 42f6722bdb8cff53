"""Liger-Kernel's options on fedfast's losses (issue 59, item 4): the generalised JSD (``jsd_beta``), label
smoothing and class weights on the hard term, logit softcaps, a larger teacher vocabulary, the terms apart.

Each is held to a float64 reference written here from outside the library's formula: the hard term is
``F.cross_entropy`` itself, the divergence is Liger-Kernel's own expression (``F.kl_div`` with log targets, the
mixture through ``logsumexp``), the cap is ``c * tanh(z / c)`` under autograd, and the linear layer is ``F.linear``.
Where Liger-Kernel is installed, its chunked loss is compared directly."""

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

import fedfast.nn as fnn
from fedfast.ops import linear_distill
from fedfast.ops.distill_options import option_rows, option_rows_grad, option_scales

D = torch.float64


def _liger_divergence(s_logits, t_logits, beta):
    """Liger-Kernel 0.8.5's ``LigerFusedLinearJSDFunction.distillation_loss_fn`` per row (its expression)."""
    ls, lt = F.log_softmax(s_logits, -1), F.log_softmax(t_logits, -1)
    if beta == 0:
        d = F.kl_div(ls, lt, reduction="none", log_target=True)
    elif beta == 1:
        d = F.kl_div(lt, ls, reduction="none", log_target=True)
    else:
        lm = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), 0)
        d = beta * F.kl_div(lm, lt, reduction="none", log_target=True) + (1 - beta) * F.kl_div(
            lm, ls, reduction="none", log_target=True
        )
    return d.sum(-1)


def reference(z, t, y, *, tau, beta, eps, w, cap, tcap, vocab, not_true, ce_weight, kd_weight, reduction, seg=None):
    """The loss from F.cross_entropy and Liger's divergence, float64, differentiable in z."""
    V = z.shape[1]
    u = cap * torch.tanh(z / cap) if cap else z
    tt = tcap * torch.tanh(t / tcap) if tcap else t
    valid = y != -100
    yc = torch.where(valid, y, 0)
    hard = F.cross_entropy(u, y, weight=w, label_smoothing=eps, reduction="none")
    s, r = u / tau, tt / tau
    if r.shape[1] > V:
        if vocab == "pad":
            s = torch.cat([s, torch.zeros(s.shape[0], r.shape[1] - V, dtype=s.dtype)], 1)
        else:
            r = r[:, :V]
    rows = []
    for i in range(z.shape[0]):  # a literal loop: the not-true columns dropped one row at a time
        si, ri = s[i], r[i]
        if not_true:
            keep = [c for c in range(s.shape[1]) if c != int(yc[i])]
            si, ri = si[keep], ri[keep]
        rows.append(_liger_divergence(si, ri, beta))
    soft = torch.where(valid, torch.stack(rows), 0.0)
    hard = torch.where(valid, hard, 0.0)
    if reduction == "none":
        return ce_weight * hard + kd_weight * soft
    if reduction == "sum":
        return (ce_weight * hard + kd_weight * soft).sum()
    groups = (
        [torch.arange(len(y))] if seg is None else [torch.nonzero(seg == k)[:, 0] for k in range(int(seg.max()) + 1)]
    )
    out = []
    for g in groups:
        wy = valid[g].to(D) if w is None else torch.where(valid[g], w[yc[g]], 0.0)
        out.append(ce_weight * hard[g].sum() / wy.sum() + kd_weight * soft[g].sum() / valid[g].sum())
    out = torch.stack(out)
    return out.sum() if reduction == "mean" else out


CASES = [
    dict(beta=0.0, eps=0.0, w=False, cap=0.0, tcap=0.0, vocab=None, not_true=False),
    dict(beta=1.0, eps=0.0, w=False, cap=0.0, tcap=0.0, vocab=None, not_true=False),
    dict(beta=0.5, eps=0.0, w=False, cap=0.0, tcap=0.0, vocab=None, not_true=False),
    dict(beta=0.3, eps=0.1, w=True, cap=4.0, tcap=0.0, vocab="pad", not_true=False),
    dict(beta=0.0, eps=0.2, w=True, cap=0.0, tcap=3.0, vocab="drop", not_true=True),
    dict(beta=1.0, eps=0.0, w=True, cap=2.0, tcap=2.0, vocab="pad", not_true=True),
    dict(beta=0.7, eps=0.05, w=False, cap=0.0, tcap=0.0, vocab="drop", not_true=True),
]


def _data(R=10, V=9, Vt=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(R, V, generator=g, dtype=D) * 3
    t = torch.randn(R, Vt or V, generator=g, dtype=D) * 3
    y = torch.randint(0, V, (R,), generator=g)
    y[3] = -100
    return z, t, y


@pytest.mark.parametrize("case", CASES)
def test_rows_and_closed_form_gradient_match_the_outside_formula(case):
    Vt = 12 if case["vocab"] else 9
    z, t, y = _data(Vt=Vt)
    w = torch.rand(9, dtype=D) + 0.2 if case["w"] else None
    z.requires_grad_()
    kw = dict(tau=2.5, beta=case["beta"], eps=case["eps"], w=w, cap=case["cap"], tcap=case["tcap"])
    kw.update(vocab=case["vocab"], not_true=case["not_true"])
    want = reference(z, t, y, ce_weight=0.6, kd_weight=1.7, reduction="mean", **kw)
    g_want = torch.autograd.grad(want, z)[0]
    opts = dict(
        tau=2.5,
        not_true=case["not_true"],
        ignore_index=-100,
        class_weight=w,
        jsd_beta=case["beta"],
        label_smoothing=case["eps"],
        softcap=case["cap"],
        teacher_softcap=case["tcap"],
        teacher_vocab=case["vocab"],
    )
    sc = option_scales(y, 9, -100, None, 10, w, True, D)
    hard, soft, g = option_rows_grad(z.detach(), t, y, sc, ce_weight=0.6, kd_weight=1.7, **opts)
    got = (0.6 * sc[0] * hard + 1.7 * sc[1] * soft).sum()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g_want, rtol=1e-10, atol=1e-12)
    h2, s2 = option_rows(z, t, y, **opts)  # the autograd form the plain losses use
    torch.testing.assert_close((0.6 * sc[0] * h2 + 1.7 * sc[1] * s2).sum(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none", "segment"])
@pytest.mark.parametrize("case", CASES[2:6])
@pytest.mark.parametrize("teacher_as", ["logits", "hidden"])
def test_linear_kd_with_options_matches_f_linear_and_the_reference(case, reduction, teacher_as):
    g = torch.Generator().manual_seed(1)
    R, H, V, Ht = 10, 6, 9, 5
    Vt = 12 if case["vocab"] else V
    h = torch.randn(R, H, generator=g, dtype=D, requires_grad=True)
    W = torch.randn(V, H, generator=g, dtype=D, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=D, requires_grad=True)
    th, tW, tb = (
        torch.randn(R, Ht, generator=g, dtype=D),
        torch.randn(Vt, Ht, generator=g, dtype=D),
        torch.randn(Vt, dtype=D),
    )
    y = torch.randint(0, V, (R,), generator=g)
    y[2] = -100
    seg = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2])
    w = torch.rand(V, generator=g, dtype=D) + 0.2 if case["w"] else None
    loss = fnn.LinearKDLoss(
        tau=2.0,
        ce_weight=0.6,
        kd_weight=1.7,
        tau_squared=False,
        not_true=case["not_true"],
        reduction=reduction,
        chunk_rows=3,
        jsd_beta=case["beta"],
        label_smoothing=case["eps"],
        class_weight=w,
        softcap=case["cap"] or None,
        teacher_softcap=case["tcap"] or None,
        teacher_vocab=case["vocab"],
    )
    teacher = (
        dict(teacher_logits=F.linear(th, tW, tb))
        if teacher_as == "logits"
        else dict(teacher_hidden=th, teacher_weight=tW, teacher_bias=tb)
    )
    segs = dict(segments=seg, num_segments=3) if reduction in ("segment", "mean") else {}
    got = loss(h, W, y, bias=b, **teacher, **segs)
    want = reference(
        F.linear(h, W, b),
        F.linear(th, tW, tb),
        y,
        tau=2.0,
        beta=case["beta"],
        eps=case["eps"],
        w=w,
        cap=case["cap"],
        tcap=case["tcap"],
        vocab=case["vocab"],
        not_true=case["not_true"],
        ce_weight=0.6,
        kd_weight=1.7,
        reduction=reduction,
        seg=seg if segs else None,
    )
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)
    go = torch.randn_like(got)
    g1 = torch.autograd.grad((got * go).sum(), (h, W, b))
    g2 = torch.autograd.grad((want * go).sum(), (h, W, b))
    for a, c in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", [CASES[3], CASES[4]])
def test_plain_losses_with_options_match_the_reference(case):
    z, t, y = _data(Vt=12 if case["vocab"] else 9)
    z.requires_grad_()
    w = torch.rand(9, dtype=D) + 0.2 if case["w"] else None
    opts = dict(
        jsd_beta=case["beta"],
        label_smoothing=case["eps"],
        class_weight=w,
        softcap=case["cap"] or None,
        teacher_softcap=case["tcap"] or None,
        teacher_vocab=case["vocab"],
    )
    kw = dict(tau=3.0, beta=case["beta"], eps=case["eps"], w=w, cap=case["cap"], tcap=case["tcap"], vocab=case["vocab"])
    if case["not_true"]:
        got = fnn.NTDLoss(tau=3.0, beta=0.8, **opts)(z, t, y)
        want = reference(z, t, y, not_true=True, ce_weight=1.0, kd_weight=0.8 * 9, reduction="mean", **kw)
    else:
        got = fnn.KDLoss(tau=3.0, ce_weight=0.4, kd_weight=0.8, **opts)(z, t, y)
        want = reference(z, t, y, not_true=False, ce_weight=0.4, kd_weight=0.8 * 9, reduction="mean", **kw)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        torch.autograd.grad(got, z, retain_graph=True)[0],
        torch.autograd.grad(want, z, retain_graph=True)[0],
        rtol=1e-10,
        atol=1e-12,
    )
    # any order of derivative: a Hessian-vector product against the reference's
    v = torch.randn_like(z)
    hv = [torch.autograd.grad((torch.autograd.grad(L, z, create_graph=True)[0] * v).sum(), z)[0] for L in (got, want)]
    torch.testing.assert_close(hv[0], hv[1], rtol=1e-9, atol=1e-11)


def test_default_options_are_the_fused_loss_and_terms_add_up():
    z, t, y = _data()
    z.requires_grad_()
    for mod, terms in (
        (
            fnn.KDLoss(tau=3.0, ce_weight=0.5, kd_weight=2.0),
            fnn.KDLoss(tau=3.0, ce_weight=0.5, kd_weight=2.0, return_terms=True),
        ),
        (fnn.NTDLoss(tau=2.0, beta=0.7), fnn.NTDLoss(tau=2.0, beta=0.7, return_terms=True)),
    ):
        plain, out = mod(z, t, y), terms(z, t, y)
        torch.testing.assert_close(out.loss, plain, rtol=1e-12, atol=0)
        ce_w = getattr(terms, "ce_weight", 1.0) if isinstance(terms, fnn.KDLoss) else 1.0
        kd_w = terms.kd_weight if isinstance(terms, fnn.KDLoss) else terms.beta
        torch.testing.assert_close(ce_w * out.ce + kd_w * out.kd, out.loss, rtol=1e-12, atol=0)
        assert not out.ce.requires_grad and not out.kd.requires_grad and out.loss.requires_grad
        torch.testing.assert_close(out.ce, F.cross_entropy(z, y), rtol=1e-12, atol=0)
    g = torch.Generator().manual_seed(3)
    h, W = torch.randn(10, 5, generator=g, requires_grad=True), torch.randn(9, 5, generator=g, requires_grad=True)
    tl = torch.randn(10, 9, generator=g)
    base = fnn.LinearKDLoss(tau=2.0, kd_weight=0.3)(h, W, y, tl)
    out = fnn.LinearKDLoss(tau=2.0, kd_weight=0.3, return_terms=True)(h, W, y, tl)
    torch.testing.assert_close(out.loss, base, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(out.ce + 0.3 * out.kd, out.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.ce, F.cross_entropy(h @ W.T, y), rtol=2e-6, atol=1e-6)


def test_options_are_refused_by_name():
    z, t, y = _data()
    bad = [
        (dict(jsd_beta=1.5), "jsd_beta"),
        (dict(jsd_beta=float("nan")), "jsd_beta"),
        (dict(label_smoothing=-0.1), "label_smoothing"),
        (dict(softcap=0.0), "softcap"),
        (dict(teacher_softcap=-1.0), "teacher_softcap"),
        (dict(class_weight=[1.0, 2.0]), "class_weight"),
        (dict(teacher_vocab="truncate"), "teacher_vocab"),
        (dict(return_terms=1), "return_terms"),
    ]
    for kw, name in bad:
        for cls in (fnn.KDLoss, fnn.NTDLoss, fnn.LinearKDLoss):
            with pytest.raises((ValueError, TypeError), match=name):
                cls(**kw)
    with pytest.raises(ValueError, match="class_weight: expected shape"):
        fnn.KDLoss(class_weight=torch.ones(4, dtype=D))(z, t, y)
    with pytest.raises(ValueError, match="class_weight: class weights must be finite"):
        fnn.KDLoss(class_weight=-torch.ones(9, dtype=D))(z, t, y)
    wide = torch.randn(10, 12, dtype=D)
    with pytest.raises(ValueError, match="teacher_vocab='drop'"):
        fnn.KDLoss(label_smoothing=0.1)(z, wide, y)
    with pytest.raises(ValueError, match="teacher_weight: 12 classes"):
        linear_distill(
            torch.randn(10, 4),
            torch.randn(9, 4),
            y,
            teacher_hidden=torch.randn(10, 3),
            teacher_weight=torch.randn(12, 3),
        )
    with pytest.raises(ValueError, match="backend"):
        fnn.KDLoss(jsd_beta=0.5, backend="cpu")(z, t, y)


def test_a_negative_class_weight_is_refused_inside_compiled_and_exported_graphs():
    g = torch.Generator().manual_seed(4)
    h, W = torch.randn(8, 5, generator=g, requires_grad=True), torch.randn(7, 5, generator=g, requires_grad=True)
    y, tl = torch.randint(0, 7, (8,), generator=g), torch.randn(8, 7, generator=g)

    class M(torch.nn.Module):
        def forward(self, h, W, y, tl, w):
            return linear_distill(h, W, y, tl, class_weight=w, label_smoothing=0.1, jsd_beta=0.5)

    ok = torch.rand(7) + 0.1
    eager = M()(h, W, y, tl, ok)
    compiled = torch.compile(M(), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(h, W, y, tl, ok), eager)
    ep = torch.export.export(M(), (h.detach(), W.detach(), y, tl, ok)).module()
    torch.testing.assert_close(ep(h.detach(), W.detach(), y, tl, ok), eager.detach())
    neg = ok.clone()
    neg[2] = -1.0
    for f in (compiled, ep):
        with pytest.raises(Exception, match="class weights must be finite"):
            f(h.detach(), W.detach(), y, tl, neg)


def test_options_compose_with_compile_trace_and_func():
    g = torch.Generator().manual_seed(5)
    R, H, V = 12, 6, 8
    h, W = torch.randn(R, H, generator=g, requires_grad=True), torch.randn(V, H, generator=g, requires_grad=True)
    y, th, tW = (
        torch.randint(0, V, (R,), generator=g),
        torch.randn(R, 4, generator=g),
        torch.randn(V + 2, 4, generator=g),
    )
    loss = fnn.LinearKDLoss(tau=2.0, jsd_beta=0.4, softcap=5.0, teacher_vocab="pad", chunk_rows=5)

    def f(h, W):
        return loss(h, W, y, teacher_hidden=th, teacher_weight=tW)

    e = f(h, W)
    ge = torch.autograd.grad(e, (h, W))
    c = torch.compile(f, fullgraph=True, backend="aot_eager")(h, W)
    torch.testing.assert_close(c, e)
    for a, b in zip(torch.autograd.grad(c, (h, W)), ge, strict=True):
        torch.testing.assert_close(a, b)
    tr = torch.jit.trace(f, (h, W), check_trace=False)
    torch.testing.assert_close(tr(h, W), e)
    hs, Ws = torch.randn(3, R, H, generator=g), torch.randn(3, V, H, generator=g)
    per = torch.func.vmap(torch.func.grad(f, argnums=(0, 1)))(hs, Ws)
    for i in range(3):
        hi, Wi = hs[i].clone().requires_grad_(), Ws[i].clone().requires_grad_()
        want = torch.autograd.grad(f(hi, Wi), (hi, Wi))
        torch.testing.assert_close(per[0][i], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(per[1][i], want[1], rtol=1e-5, atol=1e-6)


def test_autocast_with_options_computes_in_the_autocast_dtype():
    g = torch.Generator().manual_seed(6)
    h, W = torch.randn(16, 8, generator=g, requires_grad=True), torch.randn(11, 8, generator=g, requires_grad=True)
    y, tl = torch.randint(0, 11, (16,), generator=g), torch.randn(16, 11, generator=g)
    opts = dict(jsd_beta=0.5, label_smoothing=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fnn.LinearKDLoss(tau=2.0, **opts)(h, W, y, tl)
        z = F.linear(h, W)
    assert got.dtype == torch.float32 and z.dtype == torch.bfloat16
    want = fnn.KDLoss(tau=2.0, **opts)(z.float(), tl, y)  # the bf16 logits, the loss in fp32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    gW = torch.autograd.grad(got, W)[0]
    assert gW.dtype == torch.float32


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="Liger-Kernel not installed")
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_pad_rule_and_jsd_equal_liger_kernels_chunked_loss(beta):
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    g = torch.Generator().manual_seed(7)
    R, H, V, Vt = 16, 8, 10, 13
    h, W = torch.randn(R, H, generator=g, requires_grad=True), torch.randn(V, H, generator=g, requires_grad=True)
    th, tW = torch.randn(R, 6, generator=g), torch.randn(Vt, 6, generator=g)
    y = torch.randint(0, V, (R,), generator=g)
    y[5] = -100
    liger = LigerFusedLinearJSDLoss(
        weight_hard_loss=0.3,
        weight_soft_loss=0.7,
        beta=beta,
        temperature=2.0,
        compiled=False,
        chunk_size=4,
        return_soft_hard_loss=True,
    )
    want, soft, hard = liger(h, W, th, tW, y)
    gw = torch.autograd.grad(want, (h, W))
    got = fnn.LinearKDLoss(
        tau=2.0, ce_weight=0.3, kd_weight=0.7, tau_squared=False, jsd_beta=beta, teacher_vocab="pad", return_terms=True
    )(h, W, y, teacher_hidden=th, teacher_weight=tW)
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.ce, hard, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.kd, soft, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got.loss, (h, W)), gw, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_an_out_of_range_label_with_checks_off_is_an_ignored_row_as_in_the_kernels():
    """validate='off': a label outside [0, C) counts as ignore_index on the options' path too (the fused kernels'
    rule), never an index error."""
    g = torch.Generator().manual_seed(8)
    z, t = torch.randn(6, 5, generator=g, dtype=D, requires_grad=True), torch.randn(6, 5, generator=g, dtype=D)
    h, W = torch.randn(6, 3, generator=g, dtype=D, requires_grad=True), torch.randn(5, 3, generator=g, dtype=D)
    bad, ignored = torch.tensor([0, 1, 9, 2, -3, 4]), torch.tensor([0, 1, -100, 2, -100, 4])
    opts = dict(jsd_beta=0.5, label_smoothing=0.1, class_weight=torch.rand(5, generator=g, dtype=D) + 0.1)
    for loss in (fnn.KDLoss(validate="off", **opts), fnn.NTDLoss(validate="off", **opts)):
        torch.testing.assert_close(loss(z, t, bad), loss(z, t, ignored), rtol=1e-14, atol=0)
    lin = fnn.LinearKDLoss(validate="off", chunk_rows=4, **opts)
    torch.testing.assert_close(lin(h, W, bad, t), lin(h, W, ignored, t), rtol=1e-14, atol=0)
    g1, g2 = (torch.autograd.grad(lin(h, W, y, t), h)[0] for y in (bad, ignored))
    torch.testing.assert_close(g1, g2, rtol=1e-14, atol=0)
