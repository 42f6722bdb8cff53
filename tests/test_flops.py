"""fedfast.flops: the layer count equals torch's FlopCounterMode on a real training step (forward + backward)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fedfast import flops, models

CASES = [
    ("simple_cnn_cifar", lambda: models.SimpleCNN(10, 3, 0.0, 32), (3, 32, 32)),
    ("simple_cnn_mnist", lambda: models.SimpleCNN(10, 1, 0.0, 28), (1, 28, 28)),
    ("fedavg_cnn_mnist", lambda: models.FedAvgCNN(1, 10, 28), (1, 28, 28)),
    ("resnet8_gn", lambda: models.CifarResNet8(10), (3, 32, 32)),
    ("mlp", lambda: models.MLP(784, (200, 200), 10), (1, 28, 28)),
]


def _measured(model, x):
    y = torch.zeros(x.shape[0], dtype=torch.long)
    with FlopCounterMode(display=False) as fc:
        F.cross_entropy(model(x), y).backward()
    step = fc.get_total_flops()
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(x)
    return fc.get_total_flops(), step


@pytest.mark.parametrize("name,make,shape", CASES, ids=[c[0] for c in CASES])
def test_counts_equal_flop_counter(name, make, shape):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(4, *shape)
    fwd, step = flops.training_flops(model, x)
    mf, ms = _measured(model, x)
    assert fwd * 4 == mf and step * 4 == ms, (fwd * 4, mf, step * 4, ms)


def test_known_values_and_round():
    # pfl-research's simple_cnn on 3x32x32 (issue 26: "about 100 MFLOP per training sample")
    m = models.SimpleCNN(10, 3, 0.0, 32)
    fwd, step = flops.training_flops(m, torch.randn(1, 3, 32, 32))
    conv1, conv2 = 2 * 32 * 27 * 30 * 30, 2 * 64 * 288 * 28 * 28
    dense = 2 * 12544 * 128 + 2 * 128 * 10
    assert fwd == conv1 + conv2 + dense
    assert step == fwd + conv1 + 2 * (conv2 + dense)  # no input gradient for the first layer
    assert 95e6 < step < 105e6
    assert flops.round_flops(m, torch.randn(1, 3, 32, 32), 100, teacher_forwards=10) == 100 * step + 10 * fwd
    assert "MFLOP per training sample" in flops.describe(m, torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match="sample"):
        flops.layer_flops(m, torch.randn(0, 3, 32, 32))


def test_a_broken_count_would_fail():
    """The first layer's input gradient is not computed: counting it would differ from FlopCounterMode."""
    m = models.SimpleCNN(10, 3, 0.0, 32)
    x = torch.randn(2, 3, 32, 32)
    layers = flops.layer_flops(m, x)
    assert layers[0].backward == layers[0].forward and all(l.backward == 2 * l.forward for l in layers[1:])
    _, ms = _measured(m, x)
    assert 2 * sum(l.forward * 3 for l in layers) != ms
