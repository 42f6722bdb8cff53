"""fedfast.sim.facade.EngineView: what a method is bound to is exactly the Engine protocol, each member delegating
to the Simulation's parts (issue 37)."""

import copy

import pytest
import torch
from sequential_loop import setup_data

import fedfast
from fedfast.methods.base import Engine
from fedfast.sim.facade import EngineView


def _protocol_members() -> set:
    names = set(Engine.__annotations__)
    names |= {k for k, v in vars(Engine).items() if not k.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


def test_the_view_is_the_protocol_and_nothing_more():
    view = {k for k in dir(EngineView) if not k.startswith("_")} | {
        k for k in EngineView.__slots__ if not k.startswith("_")
    }
    assert view == _protocol_members()


def test_a_method_is_bound_to_the_view_and_sees_the_run_through_it():
    train, test, part, model = setup_data()
    cfg = fedfast.SimConfig(algorithm="scaffold", clients_per_round=3, rounds=2, batch_size=16, lr=0.05)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    e = sim.method.engine
    assert isinstance(e, EngineView) and e is sim.engine and isinstance(e, Engine)
    assert not hasattr(e, "__dict__")  # nothing else can be hung on it
    assert (e.num_clients, e.num_params, e.num_classes, e.seed, e.config) == (8, sim.num_params, 5, 0, cfg)
    assert e.round_index == 0 and e.global_flat is sim.state.global_flat
    sim.round()
    assert e.round_index == 1 and e.global_flat is sim.state.global_flat  # the current state, not a copy
    x, _ = train.batch(torch.arange(6))
    torch.testing.assert_close(e.forward(e.global_flat, x), sim.runtime.forward(e.global_flat, x))
    each = e.forward_each(e.global_flat, x.reshape(2, 3, *x.shape[1:]))
    torch.testing.assert_close(each.reshape(6, -1), e.forward(e.global_flat, x), rtol=1e-5, atol=1e-6)
    rows = torch.stack([e.global_flat, e.global_flat * 0.5])
    both = e.forward_clients(rows, x.reshape(2, 3, *x.shape[1:]))
    torch.testing.assert_close(both[1], e.forward(rows[1], x[3:]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        e.predict(e.global_flat, train, torch.arange(6)), sim.predict(e.global_flat, train, torch.arange(6))
    )
    st = e.new_client_state(fill=torch.ones(sim.num_params), rows=2)
    assert st.shape == (8, 2 * sim.num_params) and bool((st.dense() == 1).all())
    assert e.client_params(2).data_ptr() == sim.trainer.stack.params.data_ptr()
    assert e.server_data("val") is None and torch.equal(e.label_hist, sim.plan.label_hist)


def test_the_view_is_built_from_the_parts_not_the_simulation():
    """Issue 50: the view holds the run's parts (runtime, plan, budget, state, trainer), never the Simulation, and
    the state it reads is the run's own after a checkpoint restore (restored in place)."""
    train, test, part, model = setup_data()
    cfg = fedfast.SimConfig(algorithm="fedavg", clients_per_round=3, rounds=2, batch_size=16, lr=0.05)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    e = sim.engine
    held = [getattr(e, k) for k in EngineView.__slots__]
    assert not any(isinstance(v, fedfast.Simulation) for v in held)
    assert e._trainer is sim.trainer and e._state is sim.state
    sim.round()
    ck = sim.checkpoint()
    sim.round()
    sim.restore(ck)
    assert e.round_index == 1 and torch.equal(e.global_flat, ck["global"]) and e.global_flat is sim.state.global_flat


def test_a_method_declares_its_state_and_reads_the_chunk_in_setup(monkeypatch):
    """The state is declared (StateSpec), sized into the chunk and allocated before setup, so setup finds
    self.client_state filled and may read the chunk's rows; a declaration that is not a StateSpec is refused
    naming the hook."""
    from fedfast.methods import FedAvg, StateSpec, register
    from fedfast.methods.hooks import HookError

    seen = {}

    class Declared(FedAvg):
        def client_state_spec(self, engine):
            seen["P"] = engine.num_params
            return StateSpec(rows=2, fill=torch.ones(engine.num_params))

        def setup(self):
            seen["state"] = self.client_state.shape
            seen["rows"] = tuple(self.engine.client_params(2).shape)

    class Wrong(FedAvg):
        def client_state_spec(self, engine):
            return 3

    train, test, part, model = setup_data()
    for name, cls in (("declared_view_test", Declared), ("wrong_view_test", Wrong)):
        register(name)(cls)
    try:
        cfg = fedfast.SimConfig(algorithm="declared_view_test", clients_per_round=3, rounds=1, batch_size=16)
        sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
        P = sim.num_params
        assert seen == {"P": P, "state": (8, 2 * P), "rows": (2, P)}
        assert bool((sim.method.client_state.dense() == 1).all())
        assert sim.budget.state_values == 2 * P
        with pytest.raises(HookError, match="client_state_spec.*StateSpec"):
            fedfast.Simulation(
                fedfast.SimConfig(algorithm="wrong_view_test", clients_per_round=3),
                copy.deepcopy(model),
                train,
                test,
                part,
            )
    finally:
        for name in ("declared_view_test", "wrong_view_test"):
            fedfast.methods.unregister(name)


def test_state_allocated_in_setup_still_works_for_a_release(monkeypatch):
    """A plug-in written to the old guide (new_client_state inside setup) runs, warned with the new form's name; the
    chunk is sized again with its state, smaller when the state needs it."""
    from fedfast.methods import FedAvg, register

    class Legacy(FedAvg):
        def setup(self):
            self.client_state = self.engine.new_client_state(rows=40)

    train, test, part, model = setup_data()
    register("legacy_view_test")(Legacy)
    try:
        cfg = fedfast.SimConfig(
            algorithm="legacy_view_test", clients_per_round=8, rounds=1, batch_size=16, memory_budget_gb=0.0004
        )
        with pytest.warns(DeprecationWarning, match="client_state_spec"):
            sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
        P = sim.num_params
        assert sim.budget.state_values == 40 * P and sim.method.client_state.shape == (8, 40 * P)
        plain = fedfast.Simulation(
            fedfast.SimConfig(
                algorithm="fedavg", clients_per_round=8, rounds=1, batch_size=16, memory_budget_gb=0.0004
            ),
            copy.deepcopy(model),
            train,
            test,
            part,
        )
        assert sim.chunk < plain.chunk and sim.trainer is sim.engine._trainer
        sim.round()
    finally:
        fedfast.methods.unregister("legacy_view_test")
