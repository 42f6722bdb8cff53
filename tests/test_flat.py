"""fedfast.flat: N models in one flat buffer, zero-copy views, torch.func batching, exact round trips."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from fedfast.flat import ClientStack
from fedfast.store.state import ClientState


def small_cnn(bn=False):
    layers = [
        nn.Conv2d(1, 4, 3),
        nn.BatchNorm2d(4) if bn else nn.Identity(),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 10),
    ]
    return nn.Sequential(*layers)


def _perturbed_stack(model, N):
    stack = ClientStack(model, N)
    with torch.no_grad():
        stack.params.add_(torch.randn_like(stack.params) * 0.1)  # every client different
    return stack


def test_views_are_zero_copy_and_cover_the_buffer():
    m = small_cnn()
    stack = ClientStack(m, 5)
    P = sum(p.numel() for p in m.parameters())
    assert stack.params.shape == (5, P) and stack.params.is_contiguous()
    views = stack.param_views()
    assert list(views) == [n for n, _ in m.named_parameters()]
    total = 0
    for (_n, p), v in zip(m.named_parameters(), views.values(), strict=True):
        assert v.shape == (5, *p.shape)
        assert v.untyped_storage().data_ptr() == stack.params.untyped_storage().data_ptr()
        total += p.numel()
    assert total == P
    views["4.bias"][2].fill_(7.0)  # writing a view writes the buffer
    assert (stack.params[2, -10:] == 7.0).all()


def test_broadcast_and_exact_round_trip():
    m = small_cnn(bn=True)
    with torch.no_grad():
        m[1].running_mean.uniform_()
        m[1].running_var.uniform_(0.5, 2)
    stack = ClientStack(m, 4)
    for k in range(4):  # constructor broadcasts the module into every row
        m2 = copy.deepcopy(m)
        for p in m2.parameters():
            p.data.zero_()
        m2[1].running_mean.zero_()
        stack.load_into(m2, k)
        for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True):
            assert torch.equal(a, b)
    # a state_dict written into a row comes back bit-exactly
    other = small_cnn(bn=True)
    stack.load_state_dict(2, other.state_dict())
    back = stack.state_dict(2)
    for n, t in other.state_dict().items():
        if t.is_floating_point():
            assert torch.equal(back[n], t)
    # broadcast of a flat vector is one copy into all rows
    flat = torch.randn(stack.P)
    stack.broadcast_(flat)
    assert torch.equal(stack.params, flat.expand(4, -1))
    with pytest.raises(ValueError, match="flat_params"):
        stack.broadcast_(torch.randn(stack.P + 1))


def test_vmap_forward_matches_per_client_modules():
    torch.manual_seed(0)
    m = small_cnn()
    N, B = 6, 5
    stack = _perturbed_stack(m, N)
    x = torch.randn(N, B, 1, 8, 8)
    out = stack.vmap_forward(x)
    for k in range(N):
        mk = stack.load_into(copy.deepcopy(m), k)
        assert torch.allclose(out[k], mk(x[k]), atol=1e-6, rtol=1e-5)


def test_gradients_land_in_a_flat_buffer():
    """With the flat buffer as the leaf, one backward gives every client's gradient as one [N, P] tensor."""
    torch.manual_seed(1)
    m = small_cnn()
    N, B = 4, 3
    stack = _perturbed_stack(m, N)
    x = torch.randn(N, B, 1, 8, 8)
    y = torch.randint(0, 10, (N, B))
    flat = stack.params.detach().requires_grad_(True)
    out = stack.vmap_forward(x, params=stack.layout.param_views(flat))
    loss = nn.functional.cross_entropy(out.reshape(N * B, 10), y.reshape(-1), reduction="sum")
    loss.backward()
    assert flat.grad.shape == (N, stack.P)
    for k in range(N):
        mk = stack.load_into(copy.deepcopy(m), k)
        nn.functional.cross_entropy(mk(x[k]), y[k], reduction="sum").backward()
        ref = torch.cat([p.grad.reshape(-1) for p in mk.parameters()])
        assert torch.allclose(flat.grad[k], ref, atol=1e-5, rtol=1e-4)


def test_partial_rows_and_bad_input():
    m = small_cnn()
    stack = ClientStack(m, 5)
    flat = torch.randn(stack.P)
    stack.broadcast_(flat, rows=slice(0, 2))
    assert torch.equal(stack.params[1], flat) and not torch.equal(stack.params[2], flat)
    assert stack.param_views(slice(1, 3))["0.weight"].shape == (2, 4, 1, 3, 3)
    with pytest.raises(ValueError, match="num_clients"):
        ClientStack(m, 0)
    with pytest.raises(TypeError, match="module"):
        ClientStack("not a model", 3)
    with pytest.raises(ValueError, match="module"):
        stack.load_into(nn.Linear(3, 3), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_client_state_gather_scatter(dtype):
    K, P = 1000, 37
    fill = torch.randn(P)
    st = ClientState(K, P, dtype=dtype, fill=fill)
    init = fill.to(dtype).float()
    assert st.written == 0 and st.shape == (K, P) and torch.equal(st.gather([5, 7]), init.expand(2, P))
    ids = torch.tensor([3, 999, 0, 512])
    rows = torch.randn(4, P)
    st.scatter_(ids, rows)
    got = st.gather(ids)
    assert got.dtype == torch.float32 and got.shape == (4, P) and st.written == 4
    assert torch.equal(got, rows.to(dtype).float())  # exactly one rounding (none in fp32)
    assert torch.equal(st.gather([1, 2]), init.expand(2, P))  # never written: the initial row
    st.scatter_([0, 4], torch.ones(2, P))  # one written again, one new
    assert st.written == 5 and torch.equal(st.gather([0, 4, 3]), torch.cat([torch.ones(2, P), got[:1]]))
    dense = st.dense()
    assert dense.shape == (K, P) and torch.equal(dense[4], torch.ones(P)) and torch.equal(dense[6], init)
    torch.testing.assert_close(st.mean(), dense.mean(0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="rows"):
        st.scatter_(ids, torch.randn(3, P))
    with pytest.raises(ValueError, match="ids: a client written twice"):
        st.scatter_([1, 1], torch.randn(2, P))
    with pytest.raises(ValueError, match=r"ids: client ids in \[0, 1000\)"):
        st.gather([1000])
    with pytest.raises(TypeError, match="dtype"):
        ClientState(K, P, dtype=torch.float16)


def test_client_state_grows_with_the_clients_written_and_round_trips():
    K, P = 1_000_000, 8
    st = ClientState(K, P, fill=0.5)
    assert st.nbytes <= 8 * K + 4 * P  # the map (8 bytes a client) and the initial row
    for r in range(5):
        ids = np.random.default_rng(r).choice(K, 100, replace=False)
        st.scatter_(ids, torch.full((100, P), float(r)))
    assert st.written <= 500 and st.nbytes == 8 * K + (st.written + 1) * P * 4
    back = ClientState(K, P, fill=0.0)
    back.load_state_dict(st.state_dict())
    probe = np.random.default_rng(9).choice(K, 1000, replace=False)
    assert back.written == st.written and torch.equal(back.gather(probe), st.gather(probe))
    small = ClientState(4, P)
    small.load_state_dict(torch.arange(4 * P, dtype=torch.float32).reshape(4, P))  # an older checkpoint: dense
    assert small.written == 4 and torch.equal(small.dense()[3], torch.arange(3 * P, 4 * P, dtype=torch.float32))
    with pytest.raises(ValueError, match="state: client_state of 1000000 clients"):
        small.load_state_dict(st.state_dict())
