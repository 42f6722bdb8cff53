"""Fused server update vs the reference and vs a literal per-client state_dict loop."""

import copy

import pytest
import torch
from helpers import rel_err
from torch import nn

from fedfast import ops
from fedfast.flat import ClientStack
from fedfast.ops import _backend

BACKENDS = (
    ["reference"]
    + (["cpu"] if _backend.cpu_ext() is not None else [])
    + (["triton"] if _backend.available("triton", "cpu") else [])
)


def _mlp():
    return nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))


def _clients(N, seed=0):
    torch.manual_seed(seed)
    base = _mlp()
    stack = ClientStack(base, N)
    with torch.no_grad():
        stack.params.add_(torch.randn_like(stack.params) * 0.1)
    modules = [stack.load_into(copy.deepcopy(base), k) for k in range(N)]
    return base, stack, modules


@pytest.mark.parametrize("backend", BACKENDS)
def test_fedavg_and_fedavgm_match_state_dict_loop(backend):
    N = 6
    base, stack, modules = _clients(N)
    g = stack.layout.flatten_params(base)
    sizes = torch.tensor([10.0, 50, 20, 5, 5, 10])
    ids = [0, 2, 3, 5]  # partial participation
    w = sizes[ids] / sizes[ids].sum()
    # literal loop (what research code does)
    sd = {k: sum(float(w[i]) * modules[c].state_dict()[k] for i, c in enumerate(ids)) for k in base.state_dict()}
    avg_loop = torch.cat([sd[k].reshape(-1) for k in sd])
    out = ops.aggregate(stack.params, g, weights=sizes[ids], rows=torch.tensor(ids), backend=backend)
    assert rel_err(out["global"], avg_loop) <= 1e-6 and rel_err(out["average"], avg_loop) <= 1e-6
    # FedAvgM: v = beta v + (g - avg); g' = g - eta_s v
    v0 = torch.randn(stack.P) * 0.01
    out = ops.aggregate(
        stack.params, g, weights=sizes[ids], rows=torch.tensor(ids), beta=0.9, lr=1.5, momentum=v0, backend=backend
    )
    v1 = 0.9 * v0 + (g - avg_loop)
    assert rel_err(out["momentum"], v1) <= 1e-5 and rel_err(out["global"], g - 1.5 * v1) <= 1e-5
    # prefix participation == rows 0..n-1, uniform weights
    out = ops.aggregate(stack.params, g, rows=3, backend=backend)
    assert rel_err(out["global"], stack.params[:3].mean(0)) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_fedadc_server_rule(backend):
    """m' = D/eta + (beta_g - beta_l) m ; theta' = theta - alpha eta m' (FedADC Alg. 3). With beta_g = beta_l and
    alpha = 1 the server step is plain averaging (FedADC, Alg. 3 with beta_local = beta_global)."""
    N, P = 5, 33
    X = torch.randn(N, P)
    g = torch.randn(P)
    m = torch.randn(P)
    eta = 0.05
    out = ops.aggregate(X, g, beta=0.0, scale=1 / eta, lr=1.0 * eta, momentum=m, backend=backend)
    assert rel_err(out["global"], X.mean(0)) <= 1e-5
    assert rel_err(out["momentum"], (g - X.mean(0)) / eta) <= 1e-5
    out = ops.aggregate(X, g, beta=0.9 - 0.5, scale=1 / eta, lr=0.7 * eta, momentum=m, backend=backend)
    m1 = (g - X.mean(0)) / eta + 0.4 * m
    assert rel_err(out["momentum"], m1) <= 1e-5 and rel_err(out["global"], g - 0.7 * eta * m1) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_rows_and_ring(backend):
    """The generic state-row update (scalar and per-client coefficients, with and without a shift) and the ring
    buffer, against their formulas written out."""
    N, P = 4, 1000
    X = torch.randn(N, P)
    g = torch.randn(P)
    R = torch.randn(N, P)
    out = ops.aggregate(X, g, state_rows=R, backend=backend)  # coefficient 1, no shift
    assert rel_err(out["state_rows"], R + X - g) <= 1e-6
    assert rel_err(out["state_change"], (X - g).sum(0)) <= 1e-5
    assert rel_err(out["global"], X.mean(0)) <= 1e-6 and rel_err(out["average"], X.mean(0)) <= 1e-6
    s, a = torch.randn(P), torch.tensor([1.0, -2.0, 0.5, -4.0])
    out = ops.aggregate(X, g, state_rows=R, state_coef=a, state_shift=s, backend=backend)
    R1 = (R + s) + a[:, None] * (X - g)
    assert rel_err(out["state_rows"], R1) <= 1e-6 and rel_err(out["state_change"], (R1 - R).sum(0)) <= 1e-5
    out = ops.aggregate(X, g, state_rows=R, state_coef=-0.25, backend=backend)
    assert rel_err(out["state_rows"], R - 0.25 * (X - g)) <= 1e-6
    B = torch.randn(5, P)
    out = ops.aggregate(X, g, ring=B, ring_slot=2, ring_count=3, backend=backend)
    B1 = B.clone()
    B1[2] = X.mean(0)
    assert torch.equal(out["ring"][[0, 1, 3, 4]], B[[0, 1, 3, 4]])
    assert rel_err(out["ring"][2], X.mean(0)) <= 1e-6
    assert rel_err(out["ring_mean"], B1[:3].mean(0)) <= 1e-6
    assert "state_rows" not in out and "state_change" not in out
    with pytest.raises(ValueError, match="state_coef"):
        ops.aggregate(X, g, state_rows=R, state_coef=torch.ones(3), backend=backend)
    with pytest.raises(ValueError, match="state_shift"):
        ops.aggregate(X, g, state_shift=s, backend=backend)
    with pytest.raises(ValueError, match="state_rows"):
        ops.aggregate(X, g, state_rows=R[:3], backend=backend)
    with pytest.raises(ValueError, match="ring_slot"):
        ops.aggregate(X, g, ring=B, ring_slot=5, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_client_rows(backend):
    X = torch.randn(8, 3001)
    g = torch.randn(3001)
    out = ops.aggregate(X.to(torch.bfloat16), g, backend=backend)
    assert out["global"].dtype == torch.float32
    assert rel_err(out["global"], X.to(torch.bfloat16).float().mean(0)) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_row_is_refused_and_bad_input(backend):
    X = torch.randn(4, 50)
    g = torch.randn(50)
    X[2, 7] = float("nan")
    with pytest.raises(ValueError, match=r"clients: rows \[2\]"):
        ops.aggregate(X, g, backend=backend)
    X[2, 7] = float("inf")
    with pytest.raises(ValueError, match="clients"):
        ops.aggregate(X, g, rows=torch.tensor([1, 2]), backend=backend)
    ops.aggregate(X, g, rows=torch.tensor([0, 1, 3]), backend=backend)  # the bad row is not read
    X[2, 7] = 0
    with pytest.raises(ValueError, match="weights"):
        ops.aggregate(X, g, weights=torch.zeros(4), backend=backend)
    with pytest.raises(ValueError, match="weights"):
        ops.aggregate(X, g, weights=torch.ones(3), backend=backend)
    with pytest.raises(ValueError, match="global_params"):
        ops.aggregate(X, torch.randn(49), backend=backend)
    with pytest.raises(ValueError, match="rows"):
        ops.aggregate(X, g, rows=torch.tensor([0, 4]), backend=backend)
    with pytest.raises(ValueError, match="state_rows"):
        ops.aggregate(X, g, state_rows=torch.randn(3, 50), backend=backend)


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton (interpreter) not available")
@pytest.mark.parametrize("unroll", [2, 4])
def test_triton_unrolled_rows_give_the_same_bits(unroll):
    """The Triton aggregate with several rows loaded per iteration (n not a multiple of it, a NaN row among them):
    the same bits as one row per iteration (the sum keeps its order), the NaN row flagged."""
    from fedfast.triton.aggregate import aggregate_triton

    N, P = 7, 300
    X, g, R = torch.randn(N, P), torch.randn(P), torch.randn(5, P)
    rows = torch.tensor([6, 0, 3, 2, 5])
    w = torch.rand(5)
    X[3, 11] = float("nan")
    args = (X, rows, g, w / w.sum(), 0.9, 1.0, 1.0, torch.randn(P), R, torch.rand(5), None, None, 0, 0)
    one = aggregate_triton(*args, config=(128, 1, 4))
    many = aggregate_triton(*args, config=(128, unroll, 4))
    for a, b in zip(one, many, strict=True):
        if a is not None:
            assert (
                torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
            )
    assert many[-1].tolist() == [False, False, True, False, False, True]


def _dp_loop(X, g, clip, noise, E):
    """DP-FedAvg's round as a researcher writes it: each client's update clipped to norm clip, summed, the noise
    added, divided by the expected cohort size, added to the global model (float64)."""
    total = torch.zeros_like(g, dtype=torch.float64)
    for k in range(X.shape[0]):
        d = X[k].double() - g.double()
        n = float(d.norm())
        total += d * (min(1.0, clip / n) if n > 0 else 1.0)
    if noise is not None:
        total += noise.double()
    return g.double() + total / E


@pytest.mark.parametrize("backend", BACKENDS)
def test_dp_fedavg_equals_the_literal_loop(backend):
    """dp_clip / dp_noise / dp_denominator: clipped (a large and a zero update among them), noised and divided by
    the expected cohort size; with the server's momentum rule on top; within 1e-6 of the loop."""
    from fedfast.ops.aggregate_reference import dp_average_reference

    torch.manual_seed(0)
    N, P = 7, 1001
    g = torch.randn(P)
    X = g + torch.randn(N, P) * 0.05
    X[2] = g + torch.randn(P) * 3.0  # far past the clip
    X[5] = g  # no update
    rows = torch.tensor([0, 2, 3, 5, 6])
    noise = torch.randn(P) * 0.7
    for nz in (None, noise):
        want = _dp_loop(X[rows], g, 1.0, nz, 2.5)
        assert rel_err(dp_average_reference(X[rows].double(), g, 1.0, nz, 2.5), want) <= 1e-12
        out = ops.aggregate(X, g, rows=rows, dp_clip=1.0, dp_noise=nz, dp_denominator=2.5, backend=backend)
        assert rel_err(out["average"], want) <= 1e-6 and rel_err(out["global"], want) <= 1e-6
        # the norms given (the engine's, from the clients' last steps): the same clipped mean, no pass of its own
        norms = torch.linalg.vector_norm(X[rows] - g, dim=1)
        given = ops.aggregate(
            X, g, rows=rows, dp_clip=1.0, dp_noise=nz, dp_denominator=2.5, dp_norms=norms, backend=backend
        )
        assert rel_err(given["average"], want) <= 1e-6
        wrong = ops.aggregate(
            X, g, rows=rows, dp_clip=1.0, dp_noise=nz, dp_denominator=2.5, dp_norms=norms * 2, backend=backend
        )  # they are used: doubled norms clip harder
        assert rel_err(wrong["average"], want) > 1e-3
    m = torch.randn(P)
    out = ops.aggregate(
        X, g, rows=rows, dp_clip=1.0, dp_noise=noise, dp_denominator=2.5, beta=0.9, lr=0.5, momentum=m, backend=backend
    )
    avg = _dp_loop(X[rows], g, 1.0, noise, 2.5)
    m_new = 0.9 * m.double() + (g.double() - avg)
    assert rel_err(out["momentum"], m_new) <= 1e-6 and rel_err(out["global"], g.double() - 0.5 * m_new) <= 1e-6


def test_dp_fedavg_refuses_what_it_does_not_cover():
    X, g = torch.randn(4, 30), torch.randn(30)
    for kw, key in (
        (dict(dp_clip=0.0, dp_denominator=1.0), "dp_clip"),
        (dict(dp_clip=1.0), "dp_denominator"),
        (dict(dp_clip=1.0, dp_denominator=2.0, weights=torch.ones(4)), "weights"),
        (dict(dp_clip=1.0, dp_denominator=2.0, dp_noise=torch.zeros(29)), "dp_noise"),
        (dict(dp_noise=torch.zeros(30)), "dp_noise"),
        (dict(dp_clip=1.0, dp_denominator=2.0, dp_norms=torch.ones(3)), "dp_norms"),
        (dict(dp_norms=torch.ones(4)), "dp_norms"),
    ):
        with pytest.raises(ValueError, match=key):
            ops.aggregate(X, g, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dp_state_rows_stay_the_clients_own_and_joint_norms_clip(backend):
    """Under dp_clip per-client state rows (SCAFFOLD's c_k) are updated unclipped, R_k' = (R_k + shift) + a_k (X_k -
    g), while the average is clipped with the given norms: a joint norm larger than the update's own clips harder,
    min(1, C / joint) on the update."""
    torch.manual_seed(2)
    X, g, R = torch.randn(5, 30), torch.randn(30), torch.randn(5, 30)
    rows = torch.tensor([0, 2, 3])
    shift, coef = torch.randn(30), torch.tensor([0.5, -1.0, 2.0])
    own = (X[rows].double() - g.double()).norm(dim=1)
    joint = (own**2 + torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64)).sqrt()
    out = ops.aggregate(
        X,
        g,
        rows=rows,
        dp_clip=1.0,
        dp_denominator=2.0,
        dp_norms=joint.float(),
        state_rows=R[rows].clone(),
        state_coef=coef,
        state_shift=shift,
        backend=backend,
    )
    D = X[rows].double() - g.double()
    want_rows = (R[rows].double() + shift.double()) + coef.double()[:, None] * D
    assert rel_err(out["state_rows"], want_rows) <= 1e-6
    s = torch.clamp(1.0 / joint, max=1.0)
    assert rel_err(out["average"], g.double() + (s[:, None] * D).sum(0) / 2.0) <= 1e-6
    assert rel_err(out["average"], _dp_loop(X[rows], g, 1.0, None, 2.0)) > 1e-3  # the update's own norm: another


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_norms_equal_the_float64_norms(backend, dtype):
    """||X_k - g|| of the chosen rows: a row far from g, one equal to it, a P not a multiple of 8, bf16 rows; the
    cpu backend's C++ pass against the float64 reference to 1e-6."""
    from fedfast.ops.aggregate_reference import update_norms_reference

    torch.manual_seed(1)
    N, P = 6, 100003
    g = torch.randn(P)
    X = (g + torch.randn(N, P) * 1e-3).to(dtype)
    X[1] = (g + torch.randn(P) * 50).to(dtype)
    X[4] = g.to(dtype)
    rows = torch.tensor([4, 1, 0, 5])
    want = update_norms_reference(X[rows], g)
    got = ops.update_norms(X, g, rows, backend=backend)
    assert got.shape == (4,) and rel_err(got.double(), want) <= 1e-6
    assert float(got[0]) == float(want[0]) or abs(float(got[0]) - float(want[0])) <= 1e-6 * float(want.max())
    assert ops.update_norms(X, g, torch.tensor([], dtype=torch.long), backend=backend).numel() == 0
