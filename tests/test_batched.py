"""The vmap-free grouped executor (fedfast.batched) against vmap(functional_call) and per-client modules."""
import copy

import pytest
import torch
from torch import nn

from fedfast import models
from fedfast.batched import plan
from fedfast.flat import ClientStack, classifier_of

from helpers import rel_err

CASES = [
    ("fedavg_cnn_mnist", lambda: models.FedAvgCNN(1, 10, 28), (1, 28, 28)),
    ("lenet5", lambda: models.LeNet5(10), (3, 32, 32)),
    ("fedadc_cnn", lambda: models.FedADCCNN(10), (3, 32, 32)),
    ("gn_avgpool", lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.GroupNorm(2, 8), nn.ReLU(),
                                         nn.Conv2d(8, 8, 3, stride=2, groups=2), nn.AdaptiveAvgPool2d(2),
                                         nn.Sequential(nn.Flatten(), nn.Linear(32, 6), nn.Tanh()),
                                         nn.Linear(6, 5, bias=False)), (3, 9, 9)),
    ("mlp", lambda: models.MLP(20, (7,), 3), (20,)),
]


@pytest.mark.parametrize("name,make,shape", CASES, ids=[c[0] for c in CASES])
def test_executor_matches_vmap_and_modules(name, make, shape):
    torch.manual_seed(0)
    model = make()
    n, B = 3, 4
    stacks = [ClientStack(model, n, use_executor=u) for u in (True, False)]
    assert stacks[0].plan is not None and stacks[1].plan is None
    for st in stacks:
        st.params.add_(torch.randn_like(st.params) * 0.01)  # distinct clients
        st.params.copy_(stacks[0].params)
    x = torch.randn(n, B, *shape)
    outs, grads, feats = [], [], []
    for st in stacks:
        leaves = st.leaf_views(slice(0, n))
        f, z = st.vmap_forward(x, params=leaves, features=classifier_of(model))
        loss = (z.float() ** 2).sum() + f.sum()
        grads.append(st.flat_grad(loss, leaves, torch.empty_like(st.params)))
        outs.append(z.detach())
        feats.append(f.detach())
    assert outs[0].shape == outs[1].shape and rel_err(outs[0], outs[1]) <= 1e-5
    assert rel_err(feats[0], feats[1]) <= 1e-5
    assert rel_err(grads[0], grads[1]) <= 1e-5
    for k in range(n):  # and each row equals a plain nn.Module with that client's weights
        m = stacks[0].load_into(copy.deepcopy(model), k)
        assert rel_err(outs[0][k], m(x[k]).detach()) <= 1e-5


def test_unsupported_models_fall_back_to_vmap():
    assert plan(models.resnet10(10)) is None  # residual: not a plain Sequential
    assert plan(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))) is None
    assert plan(nn.Sequential(nn.Conv2d(1, 2, 3, padding="same"))) is None
    assert plan(nn.Sequential(nn.Flatten(0))) is None
