"""fedfast.nn's last corners (issue 47): vmap(grad) over models with their own data and labels, ASD's full teacher
gradient in mutual distillation, targets checked inside traced, exported and compiled graphs, and KDLoss as
DistillKL without labels. Each against the authors' code or numerical derivatives, or a refusal by name."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import fedfast.nn as fnn
from fedfast import bench

N, B, D, C = 3, 8, 5, 6


def _per_model():
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(D, C).double()
    params = {k: torch.randn(N, *v.shape, generator=g, dtype=torch.float64) for k, v in model.named_parameters()}
    x = torch.randn(N, B, D, generator=g, dtype=torch.float64)
    t = torch.randn(N, B, C, generator=g, dtype=torch.float64) * 2
    t3 = torch.randn(N, 3, B, C, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, C, (N, B), generator=g)
    prior = torch.rand(N, C, generator=g, dtype=torch.float64) + 0.1
    return model, params, x, t, t3, y, prior / prior.sum(1, keepdim=True)


def _authors_cad(z, t, y, a, tau):
    ay = a[y]
    return (
        (1 - ay) * F.cross_entropy(z, y, reduction="none")
        + ay * -(F.softmax(t / tau, 1) * F.log_softmax(z / tau, 1)).sum(1)
    ).mean()


def _authors_adc(z, t, y, freq, tau, lam):
    rho = freq / freq.max()
    p = F.softmax(t / tau, 1)
    onehot = F.one_hot(y, z.shape[1]).bool()
    r = rho[None].expand_as(p).masked_fill(onehot, 0.0)
    phat = torch.where(onehot, (p * onehot).sum(1, keepdim=True) + (r * p).sum(1, keepdim=True), (1 - r) * p)
    return (1 - lam) * F.cross_entropy(z, y) + lam * F.kl_div(
        F.log_softmax(z / tau, 1), phat, reduction="sum"
    ) * tau**2 / z.shape[0]


CASES = {  # name: (fedfast loss of (z, t, t3, y, prior_k), the authors' code of the same)
    "kd": (
        lambda z, t, t3, y, p: fnn.KDLoss(tau=bench.TAU["kd"])(z, t, y),
        lambda z, t, t3, y, p: bench.kd_authors(z, t, y, {}),
    ),
    "ntd": (
        lambda z, t, t3, y, p: fnn.NTDLoss(tau=bench.TAU["ntd"], beta=bench.BETA, tau_squared=False)(z, t, y),
        lambda z, t, t3, y, p: bench.ntd_authors(z, t, y, {}),
    ),
    "asd": (
        lambda z, t, t3, y, p: fnn.ASDLoss(tau=bench.TAU["asd"], lam=bench.LAM)(z, t, y, p),
        lambda z, t, t3, y, p: bench.asd_authors(z, t, y, {"prior": p}),
    ),
    "gkd_vote": (
        lambda z, t, t3, y, p: fnn.GKDLoss(tau=1.0, gamma=bench.GAMMA, tau_squared=False)(
            z, t3, y, teacher_weights=torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
        ),
        lambda z, t, t3, y, p: bench.gkd_authors(
            z, t3, y, {"weights": torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)}
        ),
    ),
    "gkd": (
        lambda z, t, t3, y, p: fnn.GKDLoss(tau=1.0, gamma=0.2)(z, t, y),
        lambda z, t, t3, y, p: (
            F.cross_entropy(z, y) + 0.1 * F.kl_div(F.log_softmax(z, 1), F.softmax(t, 1), reduction="batchmean")
        ),
    ),
    "cad": (
        lambda z, t, t3, y, p: fnn.CADLoss(tau=2.0)(z, t, y, p),
        lambda z, t, t3, y, p: _authors_cad(z, t, y, p, 2.0),
    ),
    "adc": (
        lambda z, t, t3, y, p: fnn.ADCLoss(tau=3.0, lam=0.35)(z, t, y, p * 10 + 1),
        lambda z, t, t3, y, p: _authors_adc(z, t, y, p * 10 + 1, 3.0, 0.35),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_vmap_of_grad_over_models_with_their_own_labels(name):
    """``vmap(grad(loss))`` over N models, each with its own inputs, teacher logits, labels and label prior (the
    per-client batches of a federated round): the reference path used F.one_hot, whose host read of the labels'
    maximum vmap refuses ("data-dependent control flow"), and the value checks read batched values. Each model's
    gradient equals a loop of the authors' code."""
    model, params, x, t, t3, y, prior = _per_model()
    ours, theirs = CASES[name]

    def loss_of(fn):
        return lambda p, xk, tk, t3k, yk, pk: fn(functional_call(model, p, (xk,)), tk, t3k, yk, pk)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no slow per-sample fallback of a custom op either
        got = vmap(grad(loss_of(ours)))(params, x, t, t3, y, prior)
    for k in range(N):
        pk = {n: v[k] for n, v in params.items()}
        want = grad(loss_of(theirs))(pk, x[k], t[k], t3[k], y[k], prior[k])
        for n in pk:
            torch.testing.assert_close(got[n][k], want[n], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("not_true", [False, True])
@pytest.mark.parametrize("segmented", [False, True])
def test_asd_teacher_gradient_runs_through_the_row_weights(not_true, segmented):
    """Mutual distillation (``detach_teacher=False``): the teacher's gradient includes the path through ASD's
    entropy row weights (it was dropped: 24 % off, gradcheck failed). Against numerical derivatives, and against
    the ASD code's loss lines written out with the weights not detached."""
    g = torch.Generator().manual_seed(1)
    R = 10
    z = torch.randn(R, C, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(R, C, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, C, (R,), generator=g)
    prior = torch.rand(C, generator=g, dtype=torch.float64) + 0.1
    seg = torch.tensor([0] * 4 + [1] * 6) if segmented else None
    pr = torch.stack([prior, prior.flip(0)]) if segmented else prior
    loss = fnn.ASDLoss(tau=2.0, lam=1.5, not_true=not_true, detach_teacher=False)
    call = (
        (lambda a, b: loss(a, b, y, pr, segments=seg, num_segments=2))
        if segmented
        else (lambda a, b: loss(a, b, y, pr))
    )
    assert torch.autograd.gradcheck(call, (z, t))
    if segmented:
        return

    def written_out(zz, tt):
        p = F.softmax(tt, 1)
        w = torch.exp((p * F.log_softmax(tt, 1)).sum(1)) / prior[y]
        w = w / w.sum()
        zs, ts = (bench.refine_as_not_true(zz, y, C), bench.refine_as_not_true(tt, y, C)) if not_true else (zz, tt)
        kl = (F.softmax(ts / 2.0, 1) * (F.log_softmax(ts / 2.0, 1) - F.log_softmax(zs / 2.0, 1))).sum(1)
        return F.cross_entropy(zz, y) + 1.5 * (w * kl).sum()

    a = torch.autograd.grad(call(z, t), (z, t))
    b = torch.autograd.grad(written_out(z, t), (z, t))
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-13)


class _Net(torch.nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.loss = loss

    def forward(self, z, t, y):
        return self.loss(z, t, y)


def _bad_inputs():
    g = torch.Generator().manual_seed(2)
    z, t = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    return z, t, torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 7, 3])


@pytest.mark.parametrize("how", ["trace", "export", "compile"])
def test_a_traced_graph_checks_every_calls_targets(how):
    """A trace recorded the eager target check as a constant, so a later call's out-of-range target row was silently
    dropped; exported and compiled graphs checked nothing. The check is an op of the graph now
    (``fedfast::checked_target``): a bad target raises the eager ValueError when the graph runs."""
    z, t, y, bad = _bad_inputs()
    net = _Net(fnn.KDLoss(tau=2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "trace":
            run = torch.jit.trace(net, (z, t, y))
        elif how == "export":
            run = torch.export.export(net, (z, t, y)).module()
        else:
            run = torch.compile(net, fullgraph=True)
        torch.testing.assert_close(run(z, t, y), net(z, t, y), rtol=1e-6, atol=1e-7)
        with pytest.raises((ValueError, RuntimeError), match=r"target: class indices must lie in \[0, 5\)"):
            run(z, t, bad)
    with pytest.raises(ValueError, match="target"):
        net(z, t, bad)  # eager, as before


def test_traced_segments_are_checked_in_the_graph():
    z, t, y, _ = _bad_inputs()
    loss = fnn.KDLoss(tau=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = torch.jit.trace(
            lambda a, b, c, s: loss(a, b, c, segments=s, num_segments=2), (z, t, y, torch.tensor([0, 0, 1, 1]))
        )
    with pytest.raises(RuntimeError, match="segments: client ids must be sorted"):
        run(z, t, y, torch.tensor([1, 0, 1, 1]))


def test_kd_loss_without_labels_is_distill_kl():
    """RepDistiller's ``DistillKL(T)(y_s, y_t)``: ``KDLoss(tau=T, ce_weight=0, kd_weight=1)(y_s, y_t)``, no target
    (every row counts); with a cross-entropy weight the labels are required, by name."""
    g = torch.Generator().manual_seed(3)
    ys = torch.randn(9, 7, generator=g, dtype=torch.float64, requires_grad=True)
    yt = torch.randn(9, 7, generator=g, dtype=torch.float64)
    T = 4.0
    want = F.kl_div(F.log_softmax(ys / T, 1), F.softmax(yt / T, 1), reduction="sum") * T**2 / ys.shape[0]
    got = fnn.KDLoss(tau=T, ce_weight=0, kd_weight=1)(ys, yt)
    (ga,) = torch.autograd.grad(want, ys)
    (gb,) = torch.autograd.grad(got, ys)
    assert abs(float(want.detach() - got.detach())) <= 1e-12 and torch.allclose(ga, gb, rtol=1e-10, atol=1e-14)
    with pytest.raises(ValueError, match=r"target: KDLoss's cross-entropy \(ce_weight=0.5\) needs the labels"):
        fnn.KDLoss(ce_weight=0.5)(ys, yt)


def test_segment_means_under_vmap_need_num_segments():
    """reduction='segment' under vmap: with num_segments the per-model segment means; without, refused by name
    (the count would be read from the batched ids: PyTorch's generic .item() error before)."""
    g = torch.Generator().manual_seed(2)
    z, t = torch.randn(2, 6, 5, generator=g), torch.randn(2, 6, 5, generator=g)
    y = torch.randint(0, 5, (2, 6), generator=g)
    s = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 2]])
    loss = fnn.KDLoss(reduction="segment")
    got = torch.func.vmap(lambda *a: loss(*a[:3], segments=a[3], num_segments=3))(z, t, y, s)
    for i in range(2):
        assert torch.allclose(got[i], loss(z[i], t[i], y[i], segments=s[i]), rtol=1e-5, atol=1e-6)
    for m in (loss, fnn.LinearKDLoss(reduction="segment")):
        args = (z, t, y, s) if m is loss else (z, torch.eye(5).expand(2, 5, 5), y, t, s)
        fn = (lambda *a: m(*a[:3], segments=a[3])) if m is loss else (lambda *a: m(*a[:4], segments=a[4]))
        with pytest.raises(ValueError, match="num_segments: reduction='segment' under torch.func.vmap"):
            torch.func.vmap(fn)(*args)
