"""Models: parameter counts against the papers, and every model runs under functional_call + vmap."""

import copy

import pytest
import torch

from fedfast import models
from fedfast.flat import ClientStack


def nparams(m):
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize(
    "ctor,count",
    [
        (lambda: models.FedAvgCNN(1, 10, 28), 1_663_370),  # FedNTD / McMahan, MNIST
        (lambda: models.FedAvgCNN(3, 10, 32), 2_156_490),  # CIFAR-10
        (lambda: models.FedAvgCNN(3, 100, 32), 2_202_660),  # CIFAR-100
        (lambda: models.ASDCifarCNN(10), 797_962),  # ASD Table 5
        (lambda: models.ASDCifarCNN(100), 815_332),
        (lambda: models.LeNet5(10), 62_006),  # FedCAD
        (lambda: models.CifarResNet8(10), 78_042),  # FedGKD
        (lambda: models.CifarResNet8(100), 83_892),
        (lambda: models.SimpleCNN(10), 1_626_442),  # pfl-research simple_cnn (~1.6M)
        (lambda: models.MLP(), 199_210),  # McMahan 2NN
        (lambda: models.resnet50(1000, stem="imagenet"), 25_557_032),  # torchvision resnet50()
        (lambda: models.resnet50(10, stem="imagenet"), 23_528_522),  # torchvision resnet50(num_classes=10)
        (lambda: models.resnet50(10, "gn", stem="imagenet"), 23_528_522),  # GN: as many affine parameters as BN
        (lambda: models.resnet50(100), 25_557_032 - 9408 + 1728 - 2_049_000 + 204_900),  # CIFAR stem, C=100
    ],
)
def test_parameter_counts(ctor, count):
    assert nparams(ctor()) == count


def test_approximate_counts():
    assert abs(nparams(models.resnet10()) - 4.9e6) < 0.05e6  # FedNTD App. G.3: "about 4.9M"
    assert abs(nparams(models.ASDTinyImageNetCNN()) - 2.45e6) < 0.01e6  # ASD: "about 2.45M"
    assert all(
        not list(m.buffers())
        for m in (
            models.resnet10(),
            models.resnet18(norm="gn"),
            models.CifarResNet8(),
            models.resnet50(),
            models.resnet50(norm="gn"),
        )
    )


def test_resnet50_stems_and_batched_executor():
    """The CIFAR stem keeps 32x32 (and FEMNIST's 1x28x28) at full resolution into stage 1, the ImageNet stem
    divides by 4; two clients through fedfast's traced batched executor equal their own modules, gradients too."""
    from fedfast.flat import classifier_of

    feats = {}
    for stem, shape, side in (("cifar", (3, 32, 32), 32), ("imagenet", (3, 32, 32), 8), ("cifar", (1, 28, 28), 28)):
        m = models.resnet50(10, "gn", stem=stem, in_channels=shape[0])
        h = m.layers[0].register_forward_pre_hook(lambda _m, i: feats.__setitem__("x", i[0]))
        assert m(torch.randn(2, *shape)).shape == (2, 10)
        h.remove()
        assert feats["x"].shape[-1] == side
    with pytest.raises(ValueError, match="stem"):
        models.resnet50(stem="tiny")

    # In fp32, deep BatchNorm over 4 samples is ill-conditioned (the fp32 module's own gradients differ from fp64
    # by 0.5-1.6 %, machine-dependent), so the executor is checked in fp64, where it must equal the modules to
    # rounding (measured 4e-13).
    def err(a, b):
        return float((a - b).abs().max() / b.abs().max())

    for norm, side in (("gn", 8), ("bn", 32)):
        torch.manual_seed(0)
        m = models.resnet50(7, norm).double()
        st = ClientStack(m, 2, dtype=torch.float64)
        assert st.plan is not None
        with torch.no_grad():
            st.params.add_(torch.randn_like(st.params) * 0.01)
        x = torch.randn(2, 4, 3, side, side, dtype=torch.float64)
        leaves = st.leaf_views(slice(0, 2))
        z = st.vmap_forward(x, params=leaves)
        g = torch.cat(st.flat_grad((z**2).sum(), leaves, None), 1)
        for k in range(2):
            mk = st.load_into(copy.deepcopy(m), k)
            zk = mk(x[k])
            (zk**2).sum().backward()
            gk = torch.cat([p.grad.reshape(-1) for p in mk.parameters()])
            assert err(z[k].detach(), zk.detach()) <= 1e-10, norm
            assert err(g[k], gk) <= 1e-10, norm
        assert classifier_of(m) is m.fc


@pytest.mark.parametrize(
    "name,shape",
    [
        ("fedavg_cnn_mnist", (1, 28, 28)),
        ("asd_cnn_cifar", (3, 32, 32)),
        ("resnet8_gn", (3, 32, 32)),
        ("resnet10_bn", (3, 32, 32)),
        ("lenet5", (3, 32, 32)),
        ("mlp", (1, 28, 28)),
    ],
)
def test_vmap_over_stacked_clients(name, shape):
    torch.manual_seed(0)
    m = models.build(name)
    N, B = 3, 4
    st = ClientStack(m, N)
    with torch.no_grad():
        st.params.add_(torch.randn_like(st.params) * 0.01)
    x = torch.randn(N, B, *shape)
    out = st.vmap_forward(x)
    for k in range(N):
        ref = st.load_into(copy.deepcopy(m), k)(x[k])
        assert torch.allclose(out[k], ref, atol=1e-5, rtol=1e-4)


def test_dropout_model_under_vmap_trains_per_client():
    m = models.SimpleCNN(10, dropout=0.25)
    st = ClientStack(m, 2)
    out = st.vmap_forward(torch.randn(2, 3, 3, 32, 32))
    assert out.shape == (2, 3, 10) and torch.isfinite(out).all()


def test_projection_head():
    """with_projection_head: a copy whose classifier F -> C becomes Linear(F, F), ReLU, Linear(F, dim),
    Linear(dim, C) (MOON's l1, l2, l3), seeded without touching the global random state; the batched executor
    runs it and equals the module."""
    torch.manual_seed(5)
    m = models.MLP(12, (6,), 3)
    state = torch.get_rng_state()
    a, b = models.with_projection_head(m, 4, seed=1), models.with_projection_head(m, 4, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    head = [x for x in a.modules() if isinstance(x, models.ProjectionClassifier)][0]
    assert [tuple(x.weight.shape) for x in head if isinstance(x, torch.nn.Linear)] == [(6, 6), (4, 6), (3, 4)]
    assert sum(p.numel() for p in m.parameters()) == 12 * 6 + 6 + 6 * 3 + 3  # the original is unchanged
    x = torch.randn(2, 5, 12)
    st = ClientStack(a, 2)
    assert st.plan is not None
    with torch.no_grad():
        st.params.add_(torch.randn_like(st.params) * 0.1)
        for k in range(2):
            assert torch.allclose(st.vmap_forward(x)[k], st.load_into(copy.deepcopy(a), k)(x[k]), atol=1e-6)
    with pytest.raises(ValueError, match="already has a projection head"):
        models.with_projection_head(a)
    with pytest.raises(ValueError, match="no nn.Linear"):
        models.with_projection_head(torch.nn.Sequential(torch.nn.ReLU()))
    with pytest.raises(ValueError, match="dim"):
        models.with_projection_head(m, 0)


def test_mlp_options_size_it():
    """The MLP's [mlp] table: layers x hidden units (default 784-200-200-10; layers = 0: logistic regression);
    bad values name the key."""
    from fedfast.models import MLPOptions

    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(models.build("mlp", 10, (1, 28, 28))) == 199210
    assert count(models.build("mlp", 10, (1, 28, 28), MLPOptions(hidden=32, layers=1))) == 784 * 32 + 32 + 330
    assert count(models.build("mlp", 10, (1, 28, 28), MLPOptions(layers=0))) == 7850
    with pytest.raises(ValueError, match="mlp.hidden"):
        MLPOptions(hidden=0)
