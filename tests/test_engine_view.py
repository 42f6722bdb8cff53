"""fedfast.sim.facade.EngineView: what a method is bound to is exactly the Engine protocol, each member delegating
to the Simulation's parts (issue 37)."""
import copy

import torch

import fedfast
from fedfast.methods.base import Engine
from fedfast.sim.facade import EngineView

from sequential_loop import setup_data


def _protocol_members() -> set:
    names = set(Engine.__annotations__)
    names |= {k for k, v in vars(Engine).items() if not k.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


def test_the_view_is_the_protocol_and_nothing_more():
    view = {k for k in dir(EngineView) if not k.startswith("_")} | set(EngineView.__slots__) - {"_sim"}
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
    torch.testing.assert_close(e.predict(e.global_flat, train, torch.arange(6)), sim.predict(e.global_flat, train,
                                                                                            torch.arange(6)))
    st = e.new_client_state(fill=torch.ones(sim.num_params), rows=2)
    assert st.shape == (8, 2 * sim.num_params) and bool((st.dense() == 1).all())
    assert e.client_params(2).data_ptr() == sim.trainer.stack.params.data_ptr()
    assert e.server_data("val") is None and torch.equal(e.label_hist, sim.plan.label_hist)
