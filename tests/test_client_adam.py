"""Fused all-client Adam / AdamW step vs torch.optim.Adam / AdamW on per-client nn.Modules, step by step."""

import pytest
import torch
from helpers import client_modules as _setup, flat_params as _flat, rel_err, set_grads as _set_grads

from fedfast import ops
from fedfast.ops import _backend
from fedfast.ops.client_adam_reference import client_adam_reference

BACKENDS = (
    ["reference"]
    + (["cpu"] if _backend.cpu_ext() is not None else [])
    + (["triton"] if _backend.available("triton", "cpu") else [])
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_matches_torch_optim_per_client_with_own_step_counts(backend, decoupled, clip):
    """4 clients, 5 steps; client 3 skips steps 1 and 3 (no batch): its moments, parameters and bias-correction
    count stay put, as a client whose optimizer did not step. FedProx term, clipping, per-client lr."""
    N, mu, wd, betas, eps = 4, 0.1, 1e-2, (0.8, 0.99), 1e-6
    base, stack, mods = _setup(N)
    anchor = stack.layout.flatten_params(base).clone()
    lrs = [1e-2, 5e-3, 2e-2, 1e-3]
    Opt = torch.optim.AdamW if decoupled else torch.optim.Adam
    opts = [Opt(m.parameters(), lr=lrs[k], betas=betas, eps=eps, weight_decay=wd) for k, m in enumerate(mods)]
    theta = stack.params
    m1, m2 = torch.zeros_like(theta), torch.zeros_like(theta)
    count = torch.zeros(N)
    for s in range(5):
        G = torch.randn_like(theta)
        active = torch.tensor([True, True, True, s not in (1, 3)])
        for k, m in enumerate(mods):
            if not active[k]:
                continue
            _set_grads(m, G[k] + mu * (_flat(m) - anchor))
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            opts[k].step()
        count += active.float()
        ops.client_adam(
            theta,
            G,
            m1,
            m2,
            count.clamp_min(1),
            lr=torch.tensor(lrs),
            betas=betas,
            eps=eps,
            weight_decay=wd,
            decoupled=decoupled,
            prox_mu=mu,
            anchor=anchor,
            max_norm=clip,
            active=active,
            backend=backend,
        )
        for k, m in enumerate(mods):
            assert rel_err(theta[k], _flat(m)) <= 1e-6, (s, k)
            st = [opts[k].state[p] for p in m.parameters()]
            if st and "exp_avg" in st[0]:
                assert rel_err(m1[k], torch.cat([x["exp_avg"].reshape(-1) for x in st])) <= 1e-6
                assert rel_err(m2[k], torch.cat([x["exp_avg_sq"].reshape(-1) for x in st])) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_pieces_feddyn_term_and_large_rows_equal_the_reference(backend):
    torch.manual_seed(1)
    n, sizes = 3, [1, 4096 * 2 + 3, 4095, 2]
    P = sum(sizes)
    theta0, G = torch.randn(n, P), torch.randn(n, P)
    m0, v0 = torch.randn(n, P) * 0.1, torch.rand(n, P) * 0.1
    kw = dict(
        lr=0.01,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=torch.tensor([0.0, 0.1, 0.01]),
        loss_rows=torch.randn(n, P) * 0.1,
        max_norm=20.0,
        active=torch.tensor([True, False, True]),
    )
    step = torch.tensor([1.0, 7.0, 30.0])
    ref = client_adam_reference(theta0.double(), G.double(), m0.double(), v0.double(), step, **kw)
    pieces, off = [], 0
    for j, s in enumerate(sizes):
        pieces.append(G[:, off : off + s] if j % 2 else G[:, off : off + s].contiguous())
        off += s
    theta, m, v = theta0.clone(), m0.clone(), v0.clone()
    start, out = torch.randn(P), torch.full((n,), -1.0)
    ops.client_adam(theta, pieces, m, v, step, backend=backend, delta_from=start, delta_norm=out, **kw)
    for got, want in zip((theta, m, v), ref, strict=True):
        assert rel_err(got, want.float()) <= 1e-6
    assert torch.equal(theta[1], theta0[1]) and torch.equal(m[1], m0[1]) and torch.equal(v[1], v0[1])
    # delta_norm: the active rows' ||theta' - start|| from the step's pass; the inactive row's value kept
    want = torch.linalg.vector_norm(theta.double() - start.double(), dim=1)
    assert float(((out.double() - want).abs() / want)[[0, 2]].max()) <= 1e-6 and out[1] == -1.0


def test_bad_input():
    th = torch.randn(3, 10)
    m, v = torch.zeros(3, 10), torch.zeros(3, 10)
    with pytest.raises(ValueError, match="grad"):
        ops.client_adam(th, torch.randn(3, 9), m, v, 1, lr=0.1)
    with pytest.raises(TypeError, match="exp_avg_sq"):
        ops.client_adam(th, torch.randn(3, 10), m, torch.zeros(3, 9), 1, lr=0.1)
    with pytest.raises(ValueError, match="betas"):
        ops.client_adam(th, torch.randn(3, 10), m, v, 1, lr=0.1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="eps"):
        ops.client_adam(th, torch.randn(3, 10), m, v, 1, lr=0.1, eps=0.0)
    with pytest.raises(ValueError, match="step"):
        ops.client_adam(th, torch.randn(3, 10), m, v, torch.ones(2), lr=0.1)
    with pytest.raises(ValueError, match="anchor"):
        ops.client_adam(th, torch.randn(3, 10), m, v, 1, lr=0.1, prox_mu=0.1)
