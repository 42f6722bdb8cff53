"""MOON against the plain sequential loop (previous local models as per-client state)."""
import pytest

from sequential_loop import engine_vs_loop


@pytest.mark.parametrize("options,extra", [(dict(mu=1.0, tau=0.5), {}), (dict(mu=2.0, tau=1.0), dict(client_chunk=3))])
def test_matches_sequential_loop(options, extra):
    err, _, _ = engine_vs_loop("moon", options, lr_decay=0.99, **extra)
    assert err <= 1e-4, err
