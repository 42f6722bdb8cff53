"""A user's own model (issue 70, item 3): what the engine runs equals a per-client loop, and what it cannot run is
refused when the Simulation is built, with the model's line or layer named (docs/own-model.md). Every case here
trained silently wrong, or raised a KeyError / ZeroDivisionError / raw PyTorch error, on fdbd254."""

import copy

import numpy as np
import pytest
import torch
from sequential_loop import PlainLoop, engine_vs, setup_data
from torch import nn

import fedfast
from fedfast import batched, data, models


def _mlp(C=5):
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 12), nn.ReLU(), nn.Linear(12, C))


def _sim(model, **kw):
    train, test, part, _ = setup_data()
    cfg = fedfast.SimConfig(algorithm="fedavg", clients_per_round=4, rounds=1, batch_size=16, lr=0.05, seed=3, **kw)
    return fedfast.Simulation(cfg, model, train, test, part)


class _Tied(nn.Module):
    """Two Linears sharing one weight (weight tying): one parameter, two uses."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(36, 36), nn.Linear(36, 36), nn.Linear(36, 5)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x.flatten(1))))))


def _weight_norm():
    return nn.Sequential(
        nn.Flatten(), nn.utils.parametrizations.weight_norm(nn.Linear(36, 12)), nn.ReLU(), nn.Linear(12, 5)
    )


@pytest.mark.parametrize("make", [_Tied, _weight_norm], ids=["tied", "weight_norm"])
def test_tied_and_parametrized_weights_equal_the_loop_on_the_program(make):
    """A tied weight gets the gradient of both its uses; ``weight_norm``'s parametrized Linear runs per client inside
    the program (its ``original0`` / ``original1`` trained): both equal the literal loop (fp32, 2 rounds, partial
    batches). fdbd254: KeyError 'b.weight' / '1.weight' from the command line."""
    torch.manual_seed(0)
    err, sim, _ = engine_vs(PlainLoop, "fedavg", model=make(), momentum=0.0)
    assert isinstance(sim.runtime.plan, batched.Plan)
    assert err <= 2e-5, err


class _Hidden(nn.Module):
    """The forward's own function of its input (the batch standardisation, the branch on the batch size...)."""

    def __init__(self, fn):
        super().__init__()
        self.fn, self.m = fn, _mlp()

    def forward(self, x):
        return self.fn(self.m, x)


def _standardise(m, x):  # a hand-written batch standardisation
    return m((x - x.mean(0, keepdim=True)) / (x.std(0, keepdim=True, unbiased=False) + 1))


def _by_size(m, x):  # a branch on the minibatch's size
    return m(x) * 2 if x.shape[0] > 10 else m(x)


@pytest.mark.parametrize("fn", [_standardise, _by_size], ids=["standardise", "branch_on_size"])
def test_a_forward_reading_across_samples_is_refused_with_partial_batches_and_runs_with_full_ones(fn):
    """Padded rows would enter the model (0.23 / 0.087 of the update from the loop on fdbd254): refused naming the
    model's class and file while a client's last minibatch is partial; with ``drop_last`` it equals the loop."""
    with pytest.raises(ValueError, match=r"its forward \(_Hidden \(.*test_own_model.py:\d+\)\).*drop_last = true"):
        _sim(_Hidden(fn))
    torch.manual_seed(0)
    err, _, _ = engine_vs(_FullBatches, "fedavg", model=_Hidden(fn), momentum=0.0, drop_last=True)
    assert err <= 2e-5, err


class _FullBatches(PlainLoop):
    def batches(self, rnd, k, e):
        b = self.cfg.batch_size
        return [t for t in super().batches(rnd, k, e) if len(t) == b]


def test_batch_norm_and_dropout_are_not_cross_sample():
    """The probe makes BatchNorm per-sample and turns dropout off: such a model builds (and a layer that mixes rows
    inside a submodule is named by its path)."""
    layers = (nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.5), nn.Flatten(), nn.Linear(64, 5))
    _sim(nn.Sequential(*layers))

    class Mix(nn.Module):
        def forward(self, x):
            return x - x.mean(0)

    with pytest.raises(ValueError, match=r"layer '1' \(Mix \("):
        _sim(nn.Sequential(nn.Flatten(), Mix(), nn.Linear(36, 5)))


class _Ema(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.m = _mlp()
        self.register_buffer("seen", torch.zeros((), dtype=dtype))

    def forward(self, x):
        if self.training:
            self.seen += 1  # an integer counter, or (float) a running quantity
        return self.m(x)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_a_buffer_the_forward_changes_is_refused_naming_it(dtype):
    """fdbd254 counted an integer buffer once where the loop counts every step, and let padded rows into a float
    buffer's update: refused, naming the buffer and its layer (BatchNorm's statistics alone are per client)."""
    with pytest.raises(ValueError, match=rf"changes buffer 'seen' \({dtype}\) of _Ema \("):
        _sim(_Ema(dtype))
    spectral = nn.Sequential(nn.Flatten(), nn.utils.parametrizations.spectral_norm(nn.Linear(36, 5)))
    with pytest.raises(ValueError, match=r"changes buffer '1.parametrizations.weight.0._u'"):
        _sim(spectral)


class _Host(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how, self.m = how, _mlp()

    def forward(self, x):
        y = self.m(x)
        if self.how == "if":
            return y if y.sum() > 0 else -y
        if self.how == "item":
            return y * y.mean().item()
        return y + torch.from_numpy(np.asarray(x.detach().numpy().mean(), dtype=np.float32))


class _Lstm(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.fc = nn.LSTM(6, 8, batch_first=True), nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(self.rnn(x.view(x.shape[0], 6, 6))[0][:, -1])


@pytest.mark.parametrize("make", [lambda: _Host("if"), lambda: _Host("item"), lambda: _Host("numpy"), _Lstm])
def test_a_forward_no_executor_can_run_is_refused_naming_its_line(make):
    """A host read (an ``if`` on a tensor, ``.item()``, NumPy) or a layer without a batching rule (LSTM): the grouped
    copy would read one value for all clients (the ``if`` and NumPy trained silently wrong on fdbd254), vmap
    cannot run it; refused naming this file's line."""
    with pytest.raises(ValueError, match=r"cannot run it for many clients at once.*test_own_model.py:\d+"):
        _sim(make())


def _script():
    return torch.jit.script(_mlp())


def _meta():
    return _mlp().to("meta")


class _NoParams(nn.Module):
    def forward(self, x):
        return x.flatten(1)[:, :5]


@pytest.mark.parametrize(
    "make, match",
    [
        (_script, "a TorchScript module"),
        (lambda: torch.jit.trace(_mlp(), torch.randn(2, 1, 6, 6)), "a TorchScript module"),
        (lambda: nn.DataParallel(_mlp()), "DataParallel wrapper; pass the model inside it"),
        (_meta, "parameter '1.weight' is on the meta device"),
        (_NoParams, "_NoParams has no parameters"),
        (lambda: _mlp().double(), "is torch.float64; the engine trains float32"),
    ],
    ids=["script", "trace", "data_parallel", "meta", "no_params", "float64"],
)
def test_a_module_the_engine_cannot_run_is_refused_by_name(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _sim(make())


def test_register_model_refuses_a_module_instance():
    with pytest.raises(TypeError, match=r"register_model\('mine'\): build must be a function.*_Tied"):
        models.register_model("mine", _Tied())


class _Versioned(nn.Module):
    """A layer that reads its version from the state dict's ``_metadata`` (as torchvision's MNASNet does)."""

    _version = 2

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(36, 5)

    def forward(self, x):
        return self.fc(x.flatten(1))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        if local_metadata.get("version") != 2:
            raise ValueError("version should be set")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def test_the_state_dict_keeps_its_metadata():
    """``model.load_state_dict(sim.state_dict())``, the documented way to keep the model, failed for MNASNet on
    fdbd254: the state dict lost ``_metadata``."""
    sim = _sim(_Versioned())
    sim.round()
    for sd in (sim.state_dict(), sim.state_dict(client=0)):
        m = _Versioned()
        m.load_state_dict(sd)
        assert torch.equal(m.fc.weight, sd["fc.weight"])


def test_the_executor_probe_gives_each_client_its_own_rows():
    """A grouped copy mixing the clients' rows matched the probe when both clients had the same rows: each has its
    own now, so a forward's NumPy mean over the stacked batch is caught."""
    train, test = data.synthetic(5, 40, 10, (1, 6, 6), seed=0)
    part = data.Partition(np.split(np.arange(40), 4))
    cfg = fedfast.SimConfig(algorithm="fedavg", clients_per_round=2, rounds=1, batch_size=5, lr=0.05, seed=0)
    with pytest.raises(ValueError, match="grouped copy differs from the model's forward"):
        fedfast.Simulation(cfg, copy.deepcopy(_Host("numpy")), train, test, part)
