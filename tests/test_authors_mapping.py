"""docs/kernels.md's "From the authors' code" table, row by row (issue 47: its RepDistiller row swapped the flags): each
row's fedfast call, read from the docs file and evaluated, equals the authors' formula written out here (their
flag names, their reductions), in value and in the student's gradient, in float64."""

import os
import re

import pytest
import torch
import torch.nn.functional as F

import fedfast.nn as ffnn

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "kernels.md")


def _rows() -> dict[str, str]:
    """{the authors' column's start: the fedfast column's first code span} of the table."""
    text = open(DOCS).read()
    table = text.split("**From the authors' code.**", 1)[1].split("\n\n", 2)[1]
    out = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        out[cells[0][:40]] = re.search(r"`([^`]+)`", cells[1]).group(1)
    return out


def _row(prefix: str) -> str:
    hits = [v for k, v in _rows().items() if k.startswith(prefix)]
    assert len(hits) == 1, (prefix, list(_rows()))
    return hits[0]


def _not_true(x, y, C):
    """FedNTD's refine_as_not_true: the C-1 not-true columns of each row."""
    pos = torch.arange(C).repeat(x.shape[0], 1)
    return torch.gather(x, 1, pos[pos != y.view(-1, 1)].view(-1, C - 1))


def _kl_batchmean(log_q, p):
    return F.kl_div(log_q, p, reduction="batchmean")


R, C = 12, 7


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(4)
    z = torch.randn(R, C, generator=g, dtype=torch.float64) * 2
    t = torch.randn(R, C, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, C, (R,), generator=g)
    return z, t, y


def _check(authors, fedfast_expr, names, z, student="z"):
    """The authors' loss of ``z`` against the table's fedfast expression, its student variable ``student``."""
    za, zf = z.clone().requires_grad_(), z.clone().requires_grad_()
    a = authors(za)
    f = eval(fedfast_expr, {**vars(ffnn), "softmax": lambda v: torch.softmax(v, 0)}, {**names, student: zf})
    a.backward()
    f.backward()
    a, f = a.detach(), f.detach()
    assert abs(float(a - f)) <= 1e-12 * abs(float(a)), (float(a), float(f), fedfast_expr)
    torch.testing.assert_close(zf.grad, za.grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("tau_squared", [True, False])
def test_fedntd_row(data, tau_squared):
    z, t, y = data
    tau, beta = 3.0, 0.7  # NTD_Loss's own default tau is 3

    def authors(zz):
        kl = _kl_batchmean(F.log_softmax(_not_true(zz, y, C) / tau, 1), F.softmax(_not_true(t, y, C) / tau, 1))
        return F.cross_entropy(zz, y) + beta * (tau**2 if tau_squared else 1.0) * kl

    expr = _row("FedNTD, `NTD_Loss")
    if not tau_squared:
        expr = expr.replace("beta=beta)", "beta=beta, tau_squared=False)")
    _check(authors, expr, dict(tau=tau, beta=beta, dg_logits=t, targets=y), z, "logits")


@pytest.mark.parametrize("gamma,alpha", [(1.0, 0.9), (0.1, 0.9), (0.5, 2.0)])
def test_repdistiller_row(data, gamma, alpha):
    """train_student.py: loss = opt.gamma * loss_cls + opt.alpha * loss_div + opt.beta * loss_kd (loss_kd = 0 for
    --distill kd): gamma weighs the cross-entropy, alpha the KD term."""
    z, t, y = data
    kd_T = 4.0

    def distill_kl(y_s, y_t, T):
        return F.kl_div(F.log_softmax(y_s / T, 1), F.softmax(y_t / T, 1), reduction="sum") * T**2 / y_s.shape[0]

    def authors(zz):
        return gamma * F.cross_entropy(zz, y) + alpha * distill_kl(zz, t, kd_T) + 0.3 * 0.0

    _check(
        authors,
        _row("RepDistiller, `train_student.py"),
        dict(kd_T=kd_T, gamma=gamma, alpha=alpha, y_t=t, y=y),
        z,
        "y_s",
    )
    # DistillKL alone: no labels
    _check(lambda zz: distill_kl(zz, t, 2.0), _row("RepDistiller, `DistillKL"), dict(T=2.0, y_t=t), z, "y_s")


def test_fedgkd_row(data):
    """FedGKD's code: CE + distillation_coefficient * temperature^2 * KL_batchmean; the paper's gamma/2."""
    z, t, y = data
    coef, temperature = 0.1, 1.5

    def authors(zz):
        kl = _kl_batchmean(F.log_softmax(zz / temperature, 1), F.softmax(t / temperature, 1))
        return F.cross_entropy(zz, y) + coef * temperature**2 * kl

    _check(
        authors,
        _row("FedGKD, `CE + distillation"),
        dict(temperature=temperature, distillation_coefficient=coef, t=t, y=y),
        z,
    )


def test_fedgkd_vote_row(data):
    z, _, y = data
    M, tau, gamma = 3, 1.0, 0.2
    g = torch.Generator().manual_seed(9)
    teachers = torch.randn(M, R, C, generator=g, dtype=torch.float64)
    val_losses = torch.rand(M, generator=g, dtype=torch.float64)

    def authors(zz):
        w = gamma / 2 * torch.softmax(-M * val_losses, 0)
        log_q = F.log_softmax(zz / tau, 1)
        return F.cross_entropy(zz, y) + tau**2 * sum(
            w[m] * _kl_batchmean(log_q, F.softmax(teachers[m] / tau, 1)) for m in range(M)
        )

    _check(
        authors,
        _row("FedGKD-VOTE"),
        dict(tau=tau, gamma=gamma, teachers_MRC=teachers, y=y, M=M, val_losses=val_losses),
        z,
    )


@pytest.mark.parametrize("not_true", [False, True])
def test_asd_rows(data, not_true):
    """The ASD code's loss lines: entropy weights of the plain teacher softmax over the prior, normalised over the
    batch; the KL at tau (over the not-true classes with --ntd=1)."""
    z, t, y = data
    tau, lamda = 2.0, 10.0
    prior = torch.bincount(y, minlength=C).double() + 1.0
    prior = prior / prior.sum()

    def authors(zz):
        p = F.softmax(t, 1)
        w = torch.exp((p * F.log_softmax(t, 1)).sum(1)) / prior[y]
        w = w / w.sum()
        zs, ts = (_not_true(zz, y, C), _not_true(t, y, C)) if not_true else (zz, t)
        kl = (F.softmax(ts / tau, 1) * (F.log_softmax(ts / tau, 1) - F.log_softmax(zs / tau, 1))).sum(1)
        return F.cross_entropy(zz, y) + lamda * (w * kl).sum()

    expr = _row("FedNTD + ASD" if not_true else "ASD (FedAvg+ASD)")
    _check(authors, expr, dict(tau=tau, lamda=lamda, t=t, y=y, prior=prior), z)


def test_fedcad_row(data):
    z, t, y = data
    tau = 2.0
    a = torch.rand(C, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def authors(zz):
        ay = a[y]
        ce = F.cross_entropy(zz, y, reduction="none")
        soft = -(F.softmax(t / tau, 1) * F.log_softmax(zz / tau, 1)).sum(1)
        return ((1 - ay) * ce + ay * soft).mean()

    _check(authors, _row("FedCAD"), dict(tau=tau, t=t, y=y, a=a), z)


def test_fedadc_plus_row(data):
    z, t, y = data
    tau, lam = 3.0, 0.35
    class_freq = torch.bincount(y, minlength=C).double() + 0.5

    def authors(zz):
        rho = class_freq / class_freq.max()
        p = F.softmax(t / tau, 1)
        onehot = F.one_hot(y, C).bool()
        r = rho[None].expand(R, C).masked_fill(onehot, 0.0)
        phat = torch.where(onehot, (p * onehot).sum(1, keepdim=True) + (r * p).sum(1, keepdim=True), (1 - r) * p)
        kd = F.kl_div(F.log_softmax(zz / tau, 1), phat, reduction="sum") * tau**2 / R
        return (1 - lam) * F.cross_entropy(zz, y) + lam * kd

    _check(authors, _row("FedADC+"), dict(tau=tau, lam=lam, t=t, y=y, class_freq=class_freq), z)


def test_every_row_is_tested():
    """A row added to the table without a test here fails this (one prefix per test above)."""
    tested = (
        "FedNTD, `NTD_Loss",
        "RepDistiller, `train_student.py",
        "RepDistiller, `DistillKL",
        "FedGKD, `CE + distillation",
        "FedGKD-VOTE",
        "ASD (FedAvg+ASD)",
        "FedNTD + ASD",
        "FedCAD",
        "FedADC+",
    )
    rows = list(_rows())
    assert len(rows) == len(tested) and all(any(r.startswith(p) for r in rows) for p in tested), rows
