"""Fused all-client optimizer step vs the reference and vs torch.optim.SGD on per-client nn.Modules."""

import pytest
import torch
from helpers import client_modules as _setup, flat_params as _flat, rel_err, set_grads as _set_grads

from fedfast import ops
from fedfast.ops import _backend
from fedfast.ops.client_step import drift_shift_
from fedfast.ops.client_step_reference import client_step_reference

BACKENDS = (
    ["reference"]
    + (["cpu"] if _backend.cpu_ext() is not None else [])
    + (["triton"] if _backend.available("triton", "cpu") else [])
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("clip", [None, 0.5])
def test_sgd_momentum_wd_prox_clip_match_torch_optim(backend, clip):
    N = 4
    base, stack, mods = _setup(N)
    anchor = stack.layout.flatten_params(base).clone()
    lrs = [0.1, 0.05, 0.2, 0.01]
    opts = [torch.optim.SGD(m.parameters(), lr=lrs[k], momentum=0.9, weight_decay=1e-3) for k, m in enumerate(mods)]
    theta = stack.params
    buf = torch.zeros_like(theta)
    mu = 0.1
    for step in range(3):
        G = torch.randn_like(theta)
        for k, m in enumerate(mods):  # literal: loss gradient + prox, clip, SGD(momentum, wd)
            _set_grads(m, G[k] + mu * (_flat(m) - anchor))
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            opts[k].step()
        ops.client_step(
            theta,
            G,
            lr=torch.tensor(lrs),
            momentum=0.9,
            momentum_buf=buf,
            weight_decay=1e-3,
            prox_mu=mu,
            anchor=anchor,
            max_norm=clip,
            backend=backend,
        )
        for k, m in enumerate(mods):
            assert rel_err(theta[k], _flat(m)) <= 1e-6, (step, k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_generic_terms_mask_and_offset(backend):
    """Every term at once (loss rows, a scaled correction vector plus coefficient times correction rows, a scaled
    step offset, per-client weight decay, a mask), against the reference and against the formula written out."""
    n, P = 5, 2000
    theta0 = torch.randn(n, P)
    G = torch.randn(n, P)
    v, C = torch.randn(P), torch.randn(n, P)
    L = torch.randn(n, P) * 0.1
    u = torch.randn(P) * 0.01
    active = torch.tensor([True, False, True, True, False])
    buf0 = torch.randn(n, P)
    wd = torch.tensor([0.0, 1e-3, 0.1, 1e-2, 0.0])
    s_k = torch.tensor([1.0, 0.3, 0.7, 2.0, 1.0])
    o_k = torch.tensor([1.0, 0.5, 0.25, 2.0, 1.0])
    kw = dict(
        lr=0.05,
        momentum=0.5,
        weight_decay=wd,
        loss_rows=L,
        corr_vec=v,
        corr_vec_scale=s_k,
        corr_rows=C,
        corr_rows_coef=-0.75,
        step_vec=u,
        step_vec_scale=o_k,
        active=active,
    )
    ref, rbuf = client_step_reference(theta0.clone(), G, momentum_buf=buf0.clone(), **kw)
    theta, buf = theta0.clone(), buf0.clone()
    ops.client_step(theta, G, momentum_buf=buf, backend=backend, **kw)
    assert rel_err(theta, ref) <= 1e-6 and rel_err(buf, rbuf) <= 1e-6
    assert torch.equal(theta[1], theta0[1]) and torch.equal(buf[4], buf0[4])  # masked rows untouched
    # explicit formula for one active row
    k = 2
    g = G[k] + L[k] + wd[k] * theta0[k] + (0.7 * v - 0.75 * C[k])
    b = 0.5 * buf0[k] + g
    assert rel_err(theta[k], theta0[k] - 0.05 * (b + 0.25 * u)) <= 1e-6
    with pytest.raises(ValueError, match="step_vec_scale"):
        ops.client_step(theta, G, lr=0.1, step_vec_scale=o_k, backend=backend)
    with pytest.raises(ValueError, match="corr_vec_scale"):
        ops.client_step(theta, G, lr=0.1, corr_vec_scale=s_k, backend=backend)
    with pytest.raises(ValueError, match="step_vec_scale"):
        ops.client_step(theta, G, lr=0.1, step_vec=u, step_vec_scale=torch.ones(3), backend=backend)
    with pytest.raises(TypeError, match="corr_rows_coef"):
        ops.client_step(theta, G, lr=0.1, corr_rows=C, corr_rows_coef=torch.tensor(1.0), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("terms", ["corr_vec", "corr_vec_scaled", "corr_rows", "vec_minus_rows", "step_vec"])
def test_each_term_alone_is_its_formula(backend, terms):
    """Each correction alone, with momentum and clipping, against the formula written out (a term that a kernel
    drops or misplaces, before clipping or after momentum, fails here)."""
    torch.manual_seed(11)
    n, P = 4, 777
    theta0, G, buf0 = torch.randn(n, P), torch.randn(n, P), torch.randn(n, P)
    v, C, sk = torch.randn(P), torch.randn(n, P), torch.rand(n) + 0.5
    kw = {
        "corr_vec": dict(corr_vec=v),
        "corr_vec_scaled": dict(corr_vec=v, corr_vec_scale=sk),
        "corr_rows": dict(corr_rows=C, corr_rows_coef=0.5),
        "vec_minus_rows": dict(corr_vec=v, corr_rows=C, corr_rows_coef=-1.0),
        "step_vec": dict(step_vec=v, step_vec_scale=sk),
    }[terms]
    theta, buf = theta0.clone(), buf0.clone()
    ops.client_step(theta, G, lr=0.1, momentum=0.9, momentum_buf=buf, max_norm=5.0, backend=backend, **kw)
    g = G * torch.clamp(5.0 / (G.norm(dim=1, keepdim=True) + 1e-6), max=1.0)
    corr = {
        "corr_vec": v[None],
        "corr_vec_scaled": sk[:, None] * v[None],
        "corr_rows": 0.5 * C,
        "vec_minus_rows": v[None] - C,
        "step_vec": 0,
    }[terms]
    b = 0.9 * buf0 + g + corr
    step = b + (sk[:, None] * v[None] if terms == "step_vec" else 0)
    assert rel_err(buf, b) <= 1e-6 and rel_err(theta, theta0 - 0.1 * step) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_fedadc_nesterov_ordering_equals_literal_loop(backend):
    """Red (Nesterov-like) FedADC: theta_half = theta - lr d; g = grad f(theta_half); theta = theta_half - lr g.
    Engine form: drift_shift_(-1), H heavy-ball steps with drift at the shifted point, drift_shift_(+1)."""
    torch.manual_seed(3)
    n, P, H, lr = 3, 20, 4, 0.1
    A = torch.randn(n, P, P) / P**0.5
    bvec = torch.randn(n, P)
    grad_f = lambda th: torch.einsum("kij,kj->ki", A.transpose(1, 2), torch.einsum("kij,kj->ki", A, th) - bvec)  # noqa
    d = torch.randn(P) * 0.05
    theta0 = torch.randn(n, P)
    lit = theta0.clone()
    for _ in range(H):
        half = lit - lr * d
        lit = half - lr * grad_f(half)
    th = theta0.clone()
    drift_shift_(th, d, lr, sign=-1.0)
    for _ in range(H):
        ops.client_step(th, grad_f(th), lr=lr, step_vec=d, backend=backend)
    drift_shift_(th, d, lr, sign=+1.0)
    assert rel_err(th, lit) <= 1e-5
    # heavy-ball (blue): theta = theta - lr (g(theta) + d)
    lit = theta0.clone()
    for _ in range(H):
        lit = lit - lr * (grad_f(lit) + d)
    th = theta0.clone()
    for _ in range(H):
        ops.client_step(th, grad_f(th), lr=lr, step_vec=d, backend=backend)
    assert rel_err(th, lit) <= 1e-5


def test_bad_input():
    th = torch.randn(3, 10)
    with pytest.raises(ValueError, match="grad"):
        ops.client_step(th, torch.randn(3, 9), lr=0.1)
    with pytest.raises(ValueError, match="lr"):
        ops.client_step(th, torch.randn(3, 10), lr=torch.ones(2))
    with pytest.raises(ValueError, match="anchor"):
        ops.client_step(th, torch.randn(3, 10), lr=0.1, prox_mu=0.1)
    with pytest.raises(TypeError, match="theta"):
        ops.client_step(th.double(), torch.randn(3, 10), lr=0.1)
    with pytest.raises(ValueError, match="max_norm"):
        ops.client_step(th, torch.randn(3, 10), lr=0.1, max_norm=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["plain", "momentum_wd", "clip", "prox_clip", "all_terms"])
def test_gradient_pieces_equal_the_flat_gradient(backend, variant):
    """The per-parameter pieces autograd returns (what the engine passes on the CPU backend) give the same step
    as their concatenation: pieces longer than the kernel's 4096-column block, of one column, and shaped."""
    torch.manual_seed(7)
    n, sizes = 3, [1, 4096 * 2 + 5, 7, 4095, 1]
    P = sum(sizes)
    theta0, G, buf0 = torch.randn(n, P), torch.randn(n, P), torch.randn(n, P)
    kw = {
        "plain": dict(lr=0.1),
        "momentum_wd": dict(lr=torch.tensor([0.1, 0.2, 0.05]), momentum=0.9, weight_decay=1e-2),
        "clip": dict(lr=0.1, max_norm=3.0),
        "prox_clip": dict(lr=0.1, prox_mu=0.3, anchor=torch.randn(P), max_norm=3.0),
        "all_terms": dict(
            lr=0.1,
            momentum=0.5,
            loss_rows=torch.randn(n, P),
            corr_vec=torch.randn(P),
            corr_vec_scale=torch.rand(n),
            corr_rows=torch.randn(n, P),
            corr_rows_coef=-1.0,
            step_vec=torch.randn(P),
            step_vec_scale=torch.rand(n),
            max_norm=50.0,
            active=torch.tensor([True, False, True]),
        ),
    }[variant]
    ref, rbuf = client_step_reference(theta0.clone(), G, momentum_buf=buf0.clone(), **kw)
    pieces, off = [], 0
    for j, s in enumerate(sizes):
        p = G[:, off : off + s]
        pieces.append(p.reshape(n, 1, s) if j == 3 else p.contiguous() if j % 2 else p)  # contiguous or not
        off += s
    theta, buf = theta0.clone(), buf0.clone()
    ops.client_step(theta, pieces, momentum_buf=buf, backend=backend, **kw)
    assert rel_err(theta, ref) <= 1e-6 and rel_err(buf, rbuf) <= 1e-6
    if "active" in kw:
        assert torch.equal(theta[1], theta0[1])


def test_gradient_pieces_bad_input():
    th = torch.randn(3, 10)
    with pytest.raises(ValueError, match="grad: the pieces have 9 columns"):
        ops.client_step(th, [torch.randn(3, 4), torch.randn(3, 5)], lr=0.1)
    with pytest.raises(ValueError, match="grad: piece 1"):
        ops.client_step(th, [torch.randn(3, 4), torch.randn(2, 6)], lr=0.1)
    with pytest.raises(ValueError, match="grad: piece 0"):
        ops.client_step(th, ["x"], lr=0.1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["plain", "momentum_wd", "all_terms"])
@pytest.mark.parametrize("pieces", [False, True])
def test_delta_norm_is_the_distance_of_the_new_row(backend, variant, pieces):
    """``delta_norm``: each active row's ||theta' - delta_from|| after the step, summed in the step's own pass
    (DP-FedAvg's update norms), equal to float64's norm of the stepped rows; inactive rows keep their value. The
    plain path, the general one (every term), flat gradients and per-parameter pieces past the 4096-column block."""
    torch.manual_seed(11)
    n, sizes = 4, [1, 4096 * 2 + 5, 7, 4095]
    P = sum(sizes)
    theta0, G, start = torch.randn(n, P), torch.randn(n, P), torch.randn(P)
    act = torch.tensor([True, False, True, True])
    kw = {
        "plain": dict(lr=0.1),
        "momentum_wd": dict(
            lr=torch.tensor([0.1, 0.2, 0.05, 0.1]),
            momentum=0.9,
            weight_decay=1e-2,
            momentum_buf=torch.randn(n, P),
            active=act,
        ),
        "all_terms": dict(
            lr=0.1,
            momentum=0.5,
            momentum_buf=torch.randn(n, P),
            loss_rows=torch.randn(n, P),
            corr_vec=torch.randn(P),
            corr_rows=torch.randn(n, P),
            step_vec=torch.randn(P),
            prox_mu=0.2,
            anchor=torch.randn(P),
            max_norm=50.0,
            active=act,
        ),
    }[variant]
    grad = list(G.split(sizes, dim=1)) if pieces else G
    buf0 = kw["momentum_buf"].clone() if "momentum_buf" in kw else None
    theta, out = theta0.clone(), torch.full((n,), -1.0)
    ops.client_step(theta, grad, delta_from=start, delta_norm=out, backend=backend, **kw)
    want = torch.linalg.vector_norm(theta.double() - start.double(), dim=1)
    mask = kw.get("active", torch.ones(n, dtype=torch.bool))
    assert float(((out.double() - want).abs() / want)[mask].max()) <= 1e-6
    assert (out[~mask] == -1.0).all()
    # the same step without the output: the same parameters, bit for bit
    theta2 = theta0.clone()
    ops.client_step(theta2, grad, backend=backend, **{**kw, **({"momentum_buf": buf0} if "momentum_buf" in kw else {})})
    assert torch.equal(theta2, theta)


def test_delta_norm_bad_input():
    th, g = torch.randn(3, 10), torch.randn(3, 10)
    with pytest.raises(ValueError, match="delta_from/delta_norm"):
        ops.client_step(th, g, lr=0.1, delta_norm=torch.zeros(3))
    with pytest.raises(TypeError, match="delta_norm"):
        ops.client_step(th, g, lr=0.1, delta_from=torch.zeros(10), delta_norm=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="delta_from"):
        ops.client_step(th, g, lr=0.1, delta_from=torch.zeros(9), delta_norm=torch.zeros(3))
