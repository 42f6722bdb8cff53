"""fedfast.sim.runtime.ModelRuntime alone: the model checked and flattened, its forwards, predictions, eval mode,
classifier head and the trained model (issue 37)."""

import pytest
import torch
from torch import nn

import fedfast
from fedfast import data, models
from fedfast.sim.runtime import ModelRuntime, RuntimeSettings, conv_impl


def _setup(executor="auto", model=None):
    train, _ = data.synthetic(5, 60, 10, (1, 6, 6), seed=0)
    torch.manual_seed(0)
    model = model or models.MLP(36, (16,), 5)
    cfg = fedfast.SimConfig(executor=executor, eval_batch=7)
    return ModelRuntime(RuntimeSettings.of(cfg), model, train, torch.device("cpu")), train, model


@pytest.mark.parametrize("executor", ["auto", "vmap"])
def test_forward_and_predict_are_the_models_own(executor):
    rt, train, model = _setup(executor)
    assert (rt.plan is not None) == (executor == "auto") and rt.num_params == sum(p.numel() for p in model.parameters())
    assert torch.equal(rt.initial, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    flat = rt.initial + 0.1 * torch.randn(rt.num_params)
    x, _ = train.batch(torch.arange(20))
    rt.load_into_model(flat)  # the module now holds flat: its own forward is the reference
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(rt.forward(flat, x), want, rtol=1e-5, atol=1e-6)
    got = rt.predict(flat, train, torch.arange(20))  # eval_batch = 7: three batches, the last partial
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (
        rt.predict(flat, train).shape == (len(train), 5)
        and rt.predict(flat, train, dtype=torch.bfloat16).dtype == torch.bfloat16
    )
    feats, logits = rt.forward(flat, x, features=True)
    assert rt.classifier_name == "3" and feats.shape == (20, 16)  # found on first use (no features_layer)
    torch.testing.assert_close(rt.head(flat[None], feats[None])[0], logits, rtol=1e-5, atol=1e-6)
    w, b = rt.head_params(flat[None])
    assert w.shape == (1, 5, 16) and b.shape == (1, 5)


def test_eval_mode_restores_the_mode_and_state_dict_copies():
    rt, _, model = _setup()
    model.train()
    with rt.eval_mode():
        assert not model.training
    assert model.training
    flat = torch.randn(rt.num_params)
    sd = rt.state_dict(flat)
    flat.zero_()
    assert all(v.abs().sum() > 0 for v in sd.values())  # copies, not views of flat


def test_a_model_that_does_not_fit_the_data_is_refused_by_name():
    with pytest.raises(ValueError, match=r"model: must return logits \[batch, 5\] for the 5 classes, got \(2, 3\)"):
        _setup(model=nn.Sequential(nn.Flatten(), nn.Linear(36, 3)))
    with pytest.raises(ValueError, match=r"model: cannot run on the training data \(shape \(1, 6, 6\)\)"):
        _setup(model=nn.Sequential(nn.Linear(7, 5)))


def test_find_classifier_takes_a_hint_and_activation_probe_counts_leaves():
    rt, _, _ = _setup()
    assert rt.find_classifier("1") == "1" and rt.classifier_name == "1"
    # two samples through Flatten (36), Linear (16), ReLU (16), Linear (5): leaf outputs only
    assert rt.activation_elems(with_im2col=False) == 2 * (36 + 16 + 16 + 5)


def test_conv_impl_by_device():
    assert conv_impl("auto", torch.device("cpu")) == "grouped" and conv_impl("gemm", torch.device("cpu")) == "gemm"
