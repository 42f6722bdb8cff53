"""Models: parameter counts against the papers, and every model runs under functional_call + vmap."""
import copy

import pytest
import torch

from fedfast import models
from fedfast.flat import ClientStack


def nparams(m):
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("ctor,count", [
    (lambda: models.FedAvgCNN(1, 10, 28), 1_663_370),          # FedNTD / McMahan, MNIST
    (lambda: models.FedAvgCNN(3, 10, 32), 2_156_490),          # CIFAR-10
    (lambda: models.FedAvgCNN(3, 100, 32), 2_202_660),         # CIFAR-100
    (lambda: models.ASDCifarCNN(10), 797_962),                 # ASD Table 5
    (lambda: models.ASDCifarCNN(100), 815_332),
    (lambda: models.LeNet5(10), 62_006),                       # FedCAD
    (lambda: models.CifarResNet8(10), 78_042),                 # FedGKD
    (lambda: models.CifarResNet8(100), 83_892),
    (lambda: models.SimpleCNN(10), 1_626_442),                 # pfl-research simple_cnn (~1.6M)
    (lambda: models.MLP(), 199_210),                           # McMahan 2NN
])
def test_parameter_counts(ctor, count):
    assert nparams(ctor()) == count


def test_approximate_counts():
    assert abs(nparams(models.resnet10()) - 4.9e6) < 0.05e6       # FedNTD App. G.3: "about 4.9M"
    assert abs(nparams(models.ASDTinyImageNetCNN()) - 2.45e6) < 0.01e6  # ASD: "about 2.45M"
    assert all(not list(m.buffers()) for m in (models.resnet10(), models.resnet18(norm="gn"), models.CifarResNet8()))


@pytest.mark.parametrize("name,shape", [("fedavg_cnn_mnist", (1, 28, 28)), ("asd_cnn_cifar", (3, 32, 32)),
                                        ("resnet8_gn", (3, 32, 32)), ("resnet10_bn", (3, 32, 32)),
                                        ("lenet5", (3, 32, 32)), ("mlp", (1, 28, 28))])
def test_vmap_over_stacked_clients(name, shape):
    torch.manual_seed(0)
    m = models.MODELS[name]()
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
