"""MOON against the plain sequential loop (previous local models as per-client state)."""

import pytest
from sequential_loop import engine_vs_loop


@pytest.mark.parametrize("options,extra", [(dict(mu=1.0, tau=0.5), {}), (dict(mu=2.0, tau=1.0), dict(client_chunk=3))])
def test_matches_sequential_loop(options, extra):
    err, _, _ = engine_vs_loop("moon", options, lr_decay=0.99, **extra)
    assert err <= 1e-4, err


def test_projection_head_is_the_default_and_optional():
    """MOON's paper and code contrast a 2-layer projection head's 256-d output (the default); FedNTD's code has no
    head (projection_dim = 0). The module passed in is left as it was; sim.model is the trained one."""
    import copy

    import torch
    from sequential_loop import flat, setup_data

    import fedfast
    from fedfast import models
    from fedfast.flat import classifier_of

    train, test, part, model = setup_data()
    before = flat(model)
    cfg = fedfast.SimConfig(algorithm="moon", clients_per_round=3, rounds=1, batch_size=16, lr=0.05)
    assert cfg.method().opts.projection_dim == 256
    sim = fedfast.Simulation(cfg, model, train, test, part)
    head = [m for m in sim.model.modules() if isinstance(m, models.ProjectionClassifier)]
    assert len(head) == 1 and classifier_of(sim.model).in_features == 256
    sim.run()
    assert torch.equal(flat(model), before)  # untouched
    plain = fedfast.Simulation(
        fedfast.SimConfig(algorithm="moon", clients_per_round=3, options={"projection_dim": 0}),
        copy.deepcopy(model),
        train,
        test,
        part,
    )
    assert plain.model is not None and not any(
        isinstance(m, models.ProjectionClassifier) for m in plain.model.modules()
    )


@pytest.mark.parametrize("executor", ["auto", "vmap"])
def test_without_head_matches_sequential_loop(executor):
    err, _, _ = engine_vs_loop("moon", dict(projection_dim=0), lr_decay=0.99, executor=executor)
    assert err <= 1e-4, err


@pytest.mark.parametrize("options", [dict(projection_dim=0), {}])
def test_batchnorm_previous_models_keep_their_running_statistics(options):
    """A model whose BatchNorm keeps running statistics (issue 46): each client's previous local model is kept with
    its own statistics (rows of P + B), which it normalises with in eval mode, as the loop's deep copy does."""
    err, sim, _ = engine_vs_loop("moon", options, model="bn", lr_decay=0.99)
    P, B = sim.num_params, sim.runtime.num_buffers
    assert B and sim.method.client_state.cols == P + B and err <= 1e-4, err
