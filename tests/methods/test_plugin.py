"""A user-defined method from its own file (examples/custom_method.py: FedLC) runs from Python and from
`fedfast run --plugin`, and equals the plain sequential loop running the same loss."""

import copy
import json
import os

import pytest
import torch.nn.functional as F
from sequential_loop import sequential, setup_data

import fedfast
from fedfast import methods
from fedfast.cli import main

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "custom_method.py")


@pytest.fixture(scope="module", autouse=True)
def fedlc():
    methods.load_plugin(EXAMPLE)
    yield
    methods.REGISTRY.pop("fedlc", None)


def _fedlc_loss(tau):
    def loss(z, t, y, counts):  # FedLC written plainly for one client: CE of z_c - tau * n_c^(-1/4)
        cal = z - tau * counts.pow(-0.25)  # counts 0 -> inf -> the class gets probability 0
        return F.cross_entropy(cal, y)

    return loss


@pytest.mark.parametrize("tau,extra", [(1.0, {}), (0.5, dict(momentum=0.9, client_chunk=3))])
def test_fedlc_matches_sequential_loop(tau, extra):
    train, test, part, model = setup_data()
    cfg = fedfast.SimConfig(
        algorithm="fedlc",
        options={"fedlc": {"tau": tau}},
        clients_per_round=4,
        rounds=2,
        local_epochs=2,
        batch_size=16,
        lr=0.05,
        **extra,
    )
    ref = sequential(cfg, model, train, part, 2, client_loss=_fedlc_loss(tau))
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    sim.run()
    assert (sim.global_flat - ref).abs().max() <= 1e-4 * ref.abs().max()
    plain = sequential(
        fedfast.SimConfig(**{**cfg.__dict__, "algorithm": "fedavg", "options": {}}), model, train, part, 2
    )
    assert (plain - ref).abs().max() > 1e-3 * ref.abs().max()  # the calibration changes training


def test_fedlc_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(
            [
                "run",
                "--plugin",
                EXAMPLE,
                "--set",
                "algorithm=fedlc",
                "--set",
                "fedlc.tau=0.5",
                "--set",
                "dataset=synthetic",
                "--set",
                "num_clients=10",
                "--set",
                "clients_per_round=3",
                "--set",
                "rounds=2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads((out / "config.json").read_text())["fedlc"] == {"tau": 0.5}
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert main(["methods", "fedlc", "--plugin", EXAMPLE]) == 0
    assert "logits" in capsys.readouterr().out
    with pytest.raises(TypeError, match="Method subclass"):
        methods.register("bad")(object)
    with pytest.raises(ValueError, match="name"):
        methods.register("Bad+Name")
