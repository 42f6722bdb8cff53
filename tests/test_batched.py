"""The vmap-free grouped executor (fedfast.batched) against vmap(functional_call) and per-client modules."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err
from torch import nn

from fedfast import models
from fedfast.batched import plan
from fedfast.flat import ClientStack, classifier_of

CASES = [
    ("fedavg_cnn_mnist", lambda: models.FedAvgCNN(1, 10, 28), (1, 28, 28)),
    ("lenet5", lambda: models.LeNet5(10), (3, 32, 32)),
    ("fedadc_cnn", lambda: models.FedADCCNN(10), (3, 32, 32)),
    (
        "gn_avgpool",
        lambda: nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.GroupNorm(2, 8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2, groups=2),
            nn.AdaptiveAvgPool2d(2),
            nn.Sequential(nn.Flatten(), nn.Linear(32, 6), nn.Tanh()),
            nn.Linear(6, 5, bias=False),
        ),
        (3, 9, 9),
    ),
    ("mlp", lambda: models.MLP(20, (7,), 3), (20,)),
    ("mlp_on_images", lambda: models.MLP(18, (7,), 3), (2, 3, 3)),  # Plan.dense_input: no grouped image layout
    ("wrapped_sequential", lambda: _Wrap(models.LeNet5(10)), (3, 32, 32)),
    ("resnet8_gn", lambda: models.CifarResNet8(10), (3, 32, 32)),
    ("fedgen_cnn_mnist", lambda: models.FedGenCNN(10), (1, 28, 28)),  # stride-2 convs, BN with batch statistics
    ("resnet10_bn", lambda: models.resnet10(7, "bn"), (3, 16, 16)),
    ("resnet18_gn", lambda: models.resnet18(5, "gn", gn_groups=8), (3, 8, 8)),
    ("functional", lambda: _Functional(), (2, 6, 6)),
    (
        "bn1d_mlp",
        lambda: nn.Sequential(
            nn.Linear(12, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.ReLU(), nn.Linear(8, 3)
        ),
        (12,),
    ),
]


class _Wrap(nn.Module):
    """The same Sequential behind a wrapper's forward (researchers' models are rarely bare Sequentials)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


class _Functional(nn.Module):
    """Functional calls, a residual add, x.view(x.size(0), -1)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(36, 3)

    def forward(self, x):
        h = torch.relu(self.c1(x))
        h = F.relu(self.c2(h) + h)
        h = self.pool(h)
        return self.fc(h.view(h.size(0), -1))


@pytest.mark.parametrize("name,make,shape", CASES, ids=[c[0] for c in CASES])
def test_executor_matches_vmap_and_modules(name, make, shape):
    torch.manual_seed(0)
    model = make()
    n, B = 3, 4
    stacks = [ClientStack(model, n, use_executor=u) for u in (True, False)]
    assert stacks[0].plan is not None and stacks[1].plan is None
    assert stacks[0].plan.dense_input == name.startswith("mlp")
    for st in stacks:
        st.params.add_(torch.randn_like(st.params) * 0.01)  # distinct clients
        st.params.copy_(stacks[0].params)
    x = torch.randn(n, B, *shape)
    outs, grads, feats = [], [], []
    for st in stacks:
        leaves = st.leaf_views(slice(0, n))
        f, z = st.vmap_forward(x, params=leaves, features=classifier_of(model))
        loss = (z.float() ** 2).sum() + f.sum()
        pieces = st.flat_grad(loss, leaves, None)  # per-parameter gradients, what the CPU client step reads
        grads.append(torch.cat(pieces, 1))
        assert [p.shape for p in pieces] == [(n, v.numel() // n) for v in leaves.values()]
        outs.append(z.detach())
        feats.append(f.detach())
    assert outs[0].shape == outs[1].shape and rel_err(outs[0], outs[1]) <= 1e-5
    assert rel_err(feats[0], feats[1]) <= 1e-5
    assert rel_err(grads[0], grads[1]) <= 1e-5
    for k in range(n):  # and each row equals a plain nn.Module with that client's weights
        m = stacks[0].load_into(copy.deepcopy(model), k)
        assert rel_err(outs[0][k], m(x[k]).detach()) <= 1e-5


def test_what_has_no_batched_form_runs_per_client_and_only_untraceable_models_fall_back():
    """A layer or function without a batched form (string padding, Flatten from dim 0, ``torch.cat`` of non-program
    values, an LSTM) runs per client inside the program, named in ``per_client``; only a forward torch.fx cannot
    trace (a branch on a tensor's value) has no program."""

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 2)

        def forward(self, x):
            return self.l(x) if x.sum() > 0 else -self.l(x)

    for model, node in (
        (nn.Sequential(nn.Conv2d(1, 2, 3, padding="same")), "call_module 0"),
        (nn.Sequential(nn.Flatten(0)), "call_module 0"),
        (nn.Sequential(nn.LSTM(3, 3)), "call_module 0"),
    ):
        prog, reason = plan(model)
        assert prog is not None and any(node in w for w in prog.per_client), (model, reason)
    prog, reason = plan(Branchy())
    assert prog is None and "torch.fx" in reason, reason
    x = torch.randn(2, 3, 1, 5, 5)
    conv = nn.Conv2d(1, 2, 3, padding="same")
    prog, _ = plan(nn.Sequential(conv))
    pv = {k: torch.stack([v.detach(), 2 * v.detach()]) for k, v in conv.named_parameters()}
    want = torch.stack([torch.func.functional_call(conv, {k: v[i] for k, v in pv.items()}, (x[i],)) for i in range(2)])
    got = prog.forward({f"0.{k}": v for k, v in pv.items()}, x, True)
    assert rel_err(got, want) <= 1e-6


def test_engine_uses_the_executor_for_wrapped_and_residual_models_and_warns_otherwise():
    import fedfast
    from fedfast import data

    train, test = data.synthetic(3, 60, 20, (3, 8, 8), seed=0)
    part = data.iid(train.y, 4, seed=0)
    cfg = fedfast.SimConfig(clients_per_round=2, batch_size=15)
    for model in (
        _Wrap(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3))),
        models.resnet18(3, "gn", gn_groups=4),
    ):
        sim = fedfast.Simulation(cfg, model, train, test, part)
        assert sim.trainer.stack.plan is not None
    sim = fedfast.Simulation(
        cfg, nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 3)), train, test, part
    )
    assert sim.trainer.stack.plan is not None  # BatchNorm with running statistics: per-client buffers
    sim = fedfast.Simulation(
        cfg, nn.Sequential(nn.Conv2d(3, 4, 3, padding="same"), nn.Flatten(), nn.Linear(256, 3)), train, test, part
    )
    assert sim.trainer.stack.plan is not None  # the string-padded convolution runs per client inside the program

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(192, 3)

        def forward(self, x):
            return self.l(x.flatten(1)) if x.sum() > 0 else -self.l(x.flatten(1))

    sim = fedfast.Simulation(cfg, Branchy(), train, test, part)  # fx cannot trace it: the grouped copy runs it
    assert plan(Branchy())[0] is None and sim.trainer.stack.plan is not None
