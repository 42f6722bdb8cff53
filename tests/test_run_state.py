"""fedfast.sim.state.RunState alone: all a run carries across rounds, and its checkpoint (issue 37)."""

import pytest
import torch

from fedfast.sim.state import RunState

SHAPE = {"num_params": 6, "num_clients": 4, "num_classes": 3}


def _state():
    g = torch.arange(6, dtype=torch.float32)
    st = RunState.start(g, g * 2, seed=5)
    st.round = 3
    st.history.extend([{"round": 1}, {"round": 2}, {"round": 3}])
    st.class_acc.append(torch.tensor([0.5, 0.25, 1.0]))
    return st


def test_start_is_round_zero_with_a_seeded_generator():
    g = torch.zeros(4)
    a, b = RunState.start(g, g, seed=7), RunState.start(g, g, seed=7)
    assert (a.round, a.history, a.class_acc) == (0, [], [])
    assert torch.equal(torch.rand(3, generator=a.augment), torch.rand(3, generator=b.augment))
    assert not torch.equal(
        RunState.start(g, g, seed=8).augment.get_state(), RunState.start(g, g, seed=7).augment.get_state()
    )


def test_checkpoint_is_plain_cpu_data_and_restores_every_field_and_generator():
    st = _state()
    torch.rand(2, generator=st.augment)  # a generator part-way
    method_state = {"attrs": {"m": torch.ones(2, requires_grad=True)}}
    ck = st.checkpoint(method_state, SHAPE)
    assert ck["round"] == 3 and ck["shape"] == SHAPE and ck["history"] == st.history
    assert not ck["method"]["attrs"]["m"].requires_grad and ck["method"]["attrs"]["m"].device.type == "cpu"
    want_aug, want_torch = torch.rand(4, generator=st.augment), torch.rand(4)  # what follows the checkpoint
    fresh = RunState.start(torch.zeros(6), torch.zeros(6), seed=0)
    back = fresh.restored(ck)
    assert back is not fresh and fresh.round == 0  # a new state; the old one is left as it was
    assert (
        back.round == 3 and torch.equal(back.global_flat, st.global_flat) and torch.equal(back.eval_flat, st.eval_flat)
    )
    assert back.history == st.history and back.history is not ck["history"]
    assert torch.equal(back.class_acc[0], st.class_acc[0])
    assert torch.equal(torch.rand(4, generator=back.augment), want_aug)
    assert torch.equal(torch.rand(4), want_torch)  # torch's global generator restored too


def test_a_checkpoint_of_another_shape_is_refused():
    ck = _state().checkpoint({}, SHAPE)
    RunState.check(ck, SHAPE)
    with pytest.raises(
        ValueError, match=r"checkpoint: made for .*'num_clients': 4.*this simulation has .*'num_clients': 5"
    ):
        RunState.check(ck, {**SHAPE, "num_clients": 5})
