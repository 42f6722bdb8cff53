"""cuda_graphs without a GPU: what is refused, by name, and the key that decides whether a step replays
(tests/test_gpu.py runs the graphs themselves against the eager steps and the loop)."""

import copy

import pytest
import torch
from sequential_loop import setup_data

import fedfast
from fedfast.methods import FedAvg, graph_safe
from fedfast.methods.hooks import graph_unsafe_hooks
from fedfast.sim.step_graph import StepGraph, step_key


def test_cuda_graphs_is_a_bool_and_refuses_what_a_graph_cannot_replay():
    with pytest.raises(TypeError, match="cuda_graphs: True or False"):
        fedfast.SimConfig(cuda_graphs="yes")
    with pytest.raises(ValueError, match="cuda_graphs: profile=True"):
        fedfast.SimConfig(cuda_graphs=True, profile=True)
    with pytest.raises(ValueError, match="cuda_graphs: kd's loss not marked fedfast.methods.graph_safe"):
        fedfast.SimConfig(algorithm="kd", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs: fedsam takes SAM steps"):
        fedfast.SimConfig(algorithm="fedsam", cuda_graphs=True)
    for name in ("fedavg", "fedprox", "fedavgm", "fedntd", "fedls_ntd"):  # marked hooks (their own or FedAvg's)
        assert fedfast.SimConfig(algorithm=name, cuda_graphs=True).cuda_graphs


def test_cuda_graphs_needs_a_cuda_device_and_no_loss_fn():
    train, test, part, model = setup_data("mlp")
    cfg = fedfast.SimConfig(clients_per_round=2, rounds=1, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs: a CUDA graph needs a CUDA device, got cpu"):
        fedfast.Simulation(cfg, model, train, test, part, device="cpu")

    def loss_fn(z, t, y, seg, n):
        return torch.nn.functional.cross_entropy(z, y, reduction="sum") / 8

    with pytest.raises(ValueError, match="cuda_graphs: a loss_fn"):
        fedfast.Simulation(cfg, model, train, test, part, device="cpu", loss_fn=loss_fn)
    with pytest.raises(ValueError, match="cuda_graphs: a CUDA graph needs a CUDA device"):
        StepGraph(torch.device("cpu"))


def test_an_overridden_hook_is_graph_safe_only_when_marked_again():
    class Own(FedAvg):
        def loss(self, ctx, b):
            return super().loss(ctx, b) * (1 + b.epoch)  # reads the epoch: a replay would keep the first one

    class Marked(FedAvg):
        @graph_safe
        def step_terms(self, ctx, n_act):
            return {}

    assert graph_unsafe_hooks(FedAvg) == []
    assert graph_unsafe_hooks(Own) == ["loss"]
    assert graph_unsafe_hooks(Marked) == []
    assert graph_unsafe_hooks(Own.__new__(Own)) == ["loss"]  # an instance as its class


def test_a_step_replays_only_with_the_captured_host_values():
    a, b = torch.zeros(4), torch.zeros(4)
    key = step_key(3, dict(lr=0.1, anchor=a, max_norm=None))
    assert key == step_key(3, dict(max_norm=None, anchor=a, lr=0.1))  # the order of the arguments does not matter
    assert key != step_key(2, dict(lr=0.1, anchor=a, max_norm=None))  # other active clients
    assert key != step_key(3, dict(lr=0.2, anchor=a, max_norm=None))  # a host value
    assert key != step_key(3, dict(lr=0.1, anchor=b, max_norm=None))  # a tensor at another address
    assert key != step_key(3, dict(lr=0.1, anchor=a[:2], max_norm=None))  # same address, another shape
    assert key != step_key(3, dict(lr=0.1, anchor=a, max_norm=None, delta_norm=b))  # a private run's last step


def _emulated(sim):
    sim.trainer.graph = StepGraph(sim.device, emulate=True)
    return sim.trainer.graph


@pytest.mark.parametrize("algorithm", ["fedntd", "fedprox"])
def test_graph_steps_train_what_the_eager_steps_train(algorithm):
    """The engine's graph path with an emulated graph (a replay re-runs the captured call with its capture's host
    values on the graph's own inputs): each step's minibatch is copied in, the teacher rows and terms follow; the
    result equals the eager engine's. Three epochs of two steps, two chunks: per chunk one warm-up, one capture,
    four replays."""
    from test_engine_conv import _cnn_setup

    train, test, part, model = _cnn_setup()
    opts = {"fedprox": {"mu": 0.5}} if algorithm == "fedprox" else {}
    kw = dict(algorithm=algorithm, options=opts, clients_per_round=3, rounds=2, local_epochs=3, batch_size=8)
    kw.update(lr=0.05, momentum=0.9, seed=1, client_chunk=2)
    got = []
    for graphs in (False, True):
        torch.manual_seed(0)
        sim = fedfast.Simulation(fedfast.SimConfig(**kw), copy.deepcopy(model), train, test, part, device="cpu")
        g = _emulated(sim) if graphs else None
        sim.run()
        got.append(sim.global_flat.clone())
    assert (g.captures, g.replays, g.eager) == (4, 20, 4)
    assert torch.equal(got[0], got[1])


def test_a_replay_that_kept_its_first_minibatch_would_be_caught():
    """The check above can fail: a graph whose inputs are not refreshed per step (the captured minibatch replayed)
    trains another model."""
    from test_engine_conv import _cnn_setup

    train, test, part, model = _cnn_setup()
    kw = dict(algorithm="fedntd", clients_per_round=3, rounds=1, local_epochs=3, batch_size=8, lr=0.05, seed=1)
    got = []
    for stale in (False, True):
        sim = fedfast.Simulation(fedfast.SimConfig(**kw), copy.deepcopy(model), train, test, part, device="cpu")
        g = _emulated(sim)
        if stale:
            g.step = lambda key, inputs, body, _step=g.step: (
                _step(key, {k: v.clone() for k, v in inputs.items()}, body)
                if g.graph is None
                else (g.graph.replay(), True)[1]
            )
        sim.run()
        got.append(sim.global_flat.clone())
    assert float((got[0] - got[1]).abs().max()) > 1e-4


def test_a_private_run_through_the_graph_path_equals_the_loop():
    """A private run with the emulated graph: the clients' last step (the update norms' outputs in its terms) runs
    eagerly, steps with padding rows too, the others replay; the clipped mean equals the loop's."""
    from sequential_loop import sequential

    from fedfast.sampling import sample_clients

    train, test, part, model = setup_data("mlp")
    kw = dict(algorithm="fedavg", clients_per_round=4, rounds=2, local_epochs=3, batch_size=16, lr=0.05, seed=3)
    cfg = fedfast.SimConfig(**kw, max_grad_norm=0.0, dp_clip=0.05, dp_noise_multiplier=0.0)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part, device="cpu")
    g = _emulated(sim)
    start = copy.deepcopy(sim.model)
    sim.run()
    seed = sim.privacy.secret.cohort_seed()
    ref = sequential(
        cfg,
        start,
        train,
        part,
        cfg.rounds,
        sampled_fn=lambda r: sample_clients(seed, r, part.num_clients, 4),
        dp=dict(clip=0.05, z=0.0, E=4.0, gen=None),
    )
    assert g.replays > 0 and g.captures == 2
    assert float((sim.global_flat - ref).abs().max() / ref.abs().max()) <= 1e-5
