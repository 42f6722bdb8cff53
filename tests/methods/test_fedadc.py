"""FedADC and FedADC+ against the plain sequential loop (both orderings, beta_global, chunking, clipping)."""

import pytest
from sequential_loop import engine_vs_loop

import fedfast


@pytest.mark.parametrize(
    "algorithm,options,extra",
    [
        ("fedadc", dict(beta=0.8, order="nesterov"), {}),
        ("fedadc", dict(beta=0.8, order="heavy_ball"), {}),
        ("fedadc", dict(beta=0.8, beta_global=0.9, alpha=0.8), dict(momentum=0.5)),
        ("fedadc", dict(beta=0.8), dict(client_chunk=2)),
        ("fedadc", dict(beta=0.8), dict(max_grad_norm=0.5)),
        ("fedadc_plus", dict(beta=0.7, order="heavy_ball"), {}),
        ("fedadc_plus", dict(beta=0.7, tau=2.0, lam=0.5), {}),
        ("fedadc_plus", dict(beta=0.7, teacher="local"), {}),
    ],
)
def test_matches_sequential_loop(algorithm, options, extra):
    kw = dict(momentum=0.0)
    kw.update(extra)
    err, _, _ = engine_vs_loop(algorithm, options, rounds=3, lr_decay=0.99, **kw)
    assert err <= 1e-4, err


def test_defaults():
    cfg = fedfast.SimConfig(algorithm="fedadc_plus")
    o = cfg.method().opts
    assert (o.beta, o.beta_global, o.alpha, o.order, o.lam, o.tau, o.teacher) == (
        0.9,
        0.9,
        1.0,
        "nesterov",
        0.35,
        4.0,
        "global",
    )
    assert cfg.aggregate_weights == "uniform" and cfg.momentum == 0.0
    assert not fedfast.SimConfig(algorithm="fedadc_plus", options={"teacher": "local"}).method().uses_teacher()
