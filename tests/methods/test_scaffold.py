"""SCAFFOLD against the plain sequential loop (control variates, K_eff with momentum)."""

import pytest
from sequential_loop import engine_vs_loop

import fedfast


@pytest.mark.parametrize(
    "options,extra", [({}, {}), ({}, dict(client_chunk=3)), (dict(keff_momentum=False), {}), ({}, dict(momentum=0.0))]
)
def test_matches_sequential_loop(options, extra):
    err, sim, _ = engine_vs_loop("scaffold", options, lr_decay=0.99, **extra)
    assert err <= 1e-4, err
    assert sim.method.c.abs().max() > 0 and sim.method.client_state.dense().abs().max() > 0


def test_defaults():
    assert fedfast.SimConfig(algorithm="scaffold").method().opts.keff_momentum is True
