"""FedDyn against the plain sequential loop (cloud model, h_k, both alpha_k scalings)."""

import pytest
from sequential_loop import engine_vs_loop

import fedfast


@pytest.mark.parametrize(
    "options,extra",
    [
        (dict(alpha=0.1), {}),
        (dict(alpha=0.1), dict(client_chunk=1)),
        (dict(alpha=0.05, alpha_scaling="minibatches"), {}),
    ],
)
def test_matches_sequential_loop(options, extra):
    err, sim, _ = engine_vs_loop("feddyn", options, lr_decay=0.99, **extra)
    assert err <= 1e-4, err
    assert not (sim.eval_flat == sim.global_flat).all()  # the evaluated model is the average, not the cloud model


def test_defaults_and_fixed_averaging():
    cfg = fedfast.SimConfig(algorithm="feddyn")
    o = cfg.method().opts
    assert (o.alpha, o.alpha_scaling, cfg.aggregate_weights) == (0.01, "mean_size", "uniform")
    with pytest.raises(ValueError, match="feddyn.alpha_scaling"):
        fedfast.SimConfig(algorithm="feddyn", options={"alpha_scaling": "x"})
