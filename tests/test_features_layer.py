"""The classifier whose input is ``Step.features`` (MOON's representation, a plug-in's features) and whose weights
``engine.head`` applies: found in execution order, or named (``features_layer`` in the config, or on the model),
refused when ambiguous - never the wrong layer silently. A model that declares its head first trains exactly as
the same network declared in order."""

import copy
from dataclasses import dataclass

import pytest
import torch
from sequential_loop import sequential, setup_data
from torch import nn

import fedfast
from fedfast.flat import classifier_of, find_classifier
from fedfast.methods import FedAvg, opt, register, unregister
from fedfast.models import with_projection_head


class HeadFirst(nn.Module):
    """The classifier declared before the body: the last nn.Linear declared is body.1 (the raw 36-wide input's)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 5)
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.ReLU())

    def forward(self, x):
        return self.head(self.body(x))


class InOrder(nn.Module):
    """The same network, declared in execution order (the same parameter names)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.ReLU())
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.body(x))


class LogSoftmaxOut(InOrder):
    def forward(self, x):
        return torch.log_softmax(self.head(self.body(x)), -1)


class SharedHead(InOrder):
    def forward(self, x):
        h = self.body(x)
        return self.head(h) + self.head(h.flip(0))


def _twins():
    torch.manual_seed(0)
    a = HeadFirst()
    b = InOrder()
    b.load_state_dict(a.state_dict())
    return a, b


def test_execution_order_not_declaration_order():
    a, _ = _twins()
    x = torch.randn(2, 1, 6, 6)
    assert [n for n, m in a.named_modules() if isinstance(m, nn.Linear)][-1] == "body.1"  # the old rule's pick
    assert find_classifier(a, x) == "head"
    assert classifier_of(a, x) is a.head


class ReshapedOut(InOrder):
    def forward(self, x):
        return self.head(self.body(x)).view(x.shape[0], -1)


def test_ambiguous_models_are_refused_naming_the_fix():
    x = torch.randn(2, 1, 6, 6)
    with pytest.raises(ValueError, match="output is not the output of the last nn.Linear to run.*features_layer"):
        find_classifier(LogSoftmaxOut(), x)
    with pytest.raises(ValueError, match="'head', runs 2 times.*features_layer"):
        find_classifier(SharedHead(), x)
    assert find_classifier(LogSoftmaxOut(), x, "head") == "head"  # named: taken as given
    assert find_classifier(ReshapedOut(), x) == "head"  # a view of the classifier's output is its output


def test_named_layers():
    x = torch.randn(2, 1, 6, 6)
    m = InOrder()
    with pytest.raises(
        ValueError,
        match=r"features_layer: the model has no layer 'fc2' \(its nn.Linear layers: "
        r"'body.1', 'head'\)",
    ):
        find_classifier(m, x, "fc2")
    with pytest.raises(ValueError, match="features_layer: 'body.2' is a ReLU with no nn.Linear in it"):
        find_classifier(m, x, "body.2")
    assert find_classifier(m, x, "body") == "body.1"  # a module holding it: its last Linear to run
    m.features_layer = "head"  # the model names its own
    assert find_classifier(m, x) == "head"
    with pytest.raises(ValueError, match="features_layer"):
        fedfast.SimConfig(features_layer="")


FEATURES = []


@register("record_features")
class RecordFeatures(FedAvg):
    """FedAvg that records the shapes and dtypes of each step's features (a plug-in that needs features)."""

    needs_features = True

    @dataclass
    class Options:
        unused: int = opt(0, "nothing")

    def loss(self, ctx, b):
        FEATURES.append((tuple(b.features.shape), b.features.dtype, tuple(b.valid.shape), b.valid.dtype))
        return super().loss(ctx, b)


@pytest.fixture(autouse=True, scope="module")
def _unregister():
    yield
    unregister("record_features")


def test_a_plugin_gets_the_classifier_input_of_a_head_first_model():
    train, test, part, _ = setup_data()
    a, _ = _twins()
    FEATURES.clear()
    cfg = fedfast.SimConfig(algorithm="record_features", clients_per_round=3, rounds=1, batch_size=16)
    fedfast.Simulation(cfg, a, train, test, part).run()
    n, B = 3, 16
    assert FEATURES and all(
        f[0] == (n, B, 16) and f[1] == torch.float32 and f[2] == (n, B) and f[3] == torch.bool for f in FEATURES[:1]
    )
    assert {f[0][-1] for f in FEATURES} == {16}


@pytest.mark.parametrize("projection_dim", [0, 8])
def test_moon_on_a_head_first_model_equals_the_loop_on_the_same_network(projection_dim):
    """MOON (its features, and its projection head put in the classifier's place) on the head-first model equals
    the literal loop on the in-order twin, weight for weight."""
    train, test, part, _ = setup_data()
    a, b = _twins()
    kw = dict(
        algorithm="moon",
        clients_per_round=4,
        rounds=2,
        local_epochs=1,
        batch_size=16,
        lr=0.05,
        seed=3,
        momentum=0.9,
        options={"moon": {"mu": 1.0, "projection_dim": projection_dim}},
    )
    sim = fedfast.Simulation(fedfast.SimConfig(**kw), a, train, test, part)
    assert sim.runtime.classifier_name == ("head" if projection_dim == 0 else "head.3")
    twin = with_projection_head(b, projection_dim, 3, classifier="head") if projection_dim else b  # the same seed
    ref = sequential(fedfast.SimConfig(**kw), copy.deepcopy(twin), train, part, 2)
    sim.run()
    got = dict(sim.model.named_parameters())
    names = [n for n, _ in twin.named_parameters()]  # the twin's (declaration) order, which the loop's flat has
    g = torch.cat([got[n].detach().reshape(-1) for n in names])
    assert float((g - ref).abs().max() / ref.abs().max()) < 1e-5


def test_run_config_key_and_record(tmp_path):
    from fedfast.config import build_config

    cfg = build_config(overrides=["features_layer=fc", "algorithm=fedavg"])
    assert cfg["features_layer"] == "fc" and cfg.to_json()["features_layer"] == "fc"
    assert build_config(overrides=["algorithm=fedavg"])["features_layer"] is None


def test_a_bad_features_layer_is_refused_when_the_run_is_built():
    train, test, part, model = setup_data()
    with pytest.raises(ValueError, match="features_layer: the model has no layer 'fc9'"):
        fedfast.Simulation(fedfast.SimConfig(algorithm="fedavg", features_layer="fc9"), model, train, test, part)
