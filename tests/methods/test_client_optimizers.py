"""Adam and AdamW client steps (``client_optimizer``) against the plain sequential loop with torch.optim.Adam /
AdamW per client, composed with FedProx, clipping, weight decay, the KD losses and client chunking; the methods
whose client-step terms are defined for SGD refuse them by name."""

import pytest
from sequential_loop import engine_vs_loop

import fedfast
from fedfast.local_step import Adam


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
@pytest.mark.parametrize(
    "algorithm,options,extra",
    [
        ("fedavg", {}, {}),
        ("fedprox", dict(mu=0.1), dict(max_grad_norm=0.5)),
        ("fedntd", dict(tau=2.0), dict(client_chunk=3)),
        ("fedgkd", {}, {}),
        ("moon", {}, {}),
        ("fedavg+asd", {}, {}),
        ("fedavg", {}, dict(backend="reference")),
    ],
)
def test_matches_sequential_loop(optimizer, algorithm, options, extra):
    err, sim, _ = engine_vs_loop(
        algorithm,
        options,
        momentum=0.0,
        client_optimizer=optimizer,
        lr=1e-3,
        weight_decay=1e-2,
        adam_betas=(0.8, 0.99),
        **extra,
    )
    assert err <= 1e-4, err
    assert isinstance(sim.trainer.optimizer, Adam) and sim.trainer.optimizer.decoupled == (optimizer == "adamw")


def test_a_wrong_moment_or_bias_correction_is_caught():
    """The loop comparison can fail: an engine with another beta1 than the loop's is far outside the tolerance."""
    import copy

    from sequential_loop import sequential, setup_data

    train, test, part, model = setup_data()
    kw = dict(
        algorithm="fedavg",
        clients_per_round=4,
        rounds=2,
        local_epochs=2,
        batch_size=16,
        lr=1e-3,
        seed=3,
        client_optimizer="adam",
    )
    ref = sequential(fedfast.SimConfig(**kw), model, train, part, 2)
    sim = fedfast.Simulation(fedfast.SimConfig(adam_betas=(0.5, 0.999), **kw), copy.deepcopy(model), train, test, part)
    sim.run()
    err = float((sim.global_flat - ref).abs().max() / ref.abs().max())
    assert err > 1e-3, err  # 10x the tolerance of the comparisons above


@pytest.mark.parametrize("algorithm", ["scaffold", "feddyn", "fedadc", "fedadc_plus", "scaffold+asd"])
def test_sgd_only_methods_refuse_adam_by_name(algorithm):
    with pytest.raises(ValueError, match=f"client_optimizer: {algorithm.replace('+', '.')} runs SGD client steps"):
        fedfast.SimConfig(algorithm=algorithm, client_optimizer="adam")


def test_bad_settings():
    with pytest.raises(ValueError, match="client_optimizer: one of"):
        fedfast.SimConfig(client_optimizer="lamb")
    with pytest.raises(ValueError, match="momentum: SGD momentum, not used"):
        fedfast.SimConfig(client_optimizer="adamw", momentum=0.9)
    with pytest.raises(ValueError, match="adam_betas"):
        fedfast.SimConfig(client_optimizer="adam", adam_betas=(0.9,))
    with pytest.raises(ValueError, match="adam_betas"):
        fedfast.SimConfig(client_optimizer="adam", adam_betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="adam_eps"):
        fedfast.SimConfig(client_optimizer="adam", adam_eps=0.0)
