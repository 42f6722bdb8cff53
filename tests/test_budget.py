"""fedfast.sim.budget, the memory budget as pure functions of sizes (issue 37): each alone, with numbers worked by
hand, and the engine's chunk size and out-of-memory message built from them."""

import pytest
import torch
from sequential_loop import setup_data

import fedfast
from fedfast.local_step import OPTIMIZERS, OptimizerSettings
from fedfast.sim import budget
from fedfast.sim.memory import CPU_CHUNK_PARAM_BYTES


def test_param_rows_count_every_parameter_sized_buffer():
    assert budget.param_rows(1, None, 1000, 0) == 4  # params, flat grad, autograd grads + momentum
    assert budget.param_rows(2, 3000, 1000, 0) == 3 + 2 + 6  # Adam's two moments; state 3 rows, gathered + updated
    assert budget.param_rows(0, 500, 1000, 2) == 3 + 1 + 2  # a state narrower than the model rounds down; SAM
    assert budget.param_rows(0, 10, 0, 0) == 3 + 20  # no parameters: no division by zero


def test_client_bytes_and_chunk_clients():
    rows, act = budget.client_bytes(1000, 4, 600, 32)
    assert (rows, act) == (16_000, 3 * 4 * 600 // 2 * 32)
    assert budget.chunk_clients(10 * (rows + act), rows, act, 1000, "cuda") == 10
    assert budget.chunk_clients(10 * (rows + act) - 1, rows, act, 1000, "cuda") == 9
    assert budget.chunk_clients(1.0, rows, act, 1000, "cuda") == 1  # never fewer than one client
    big = 10**7  # a CPU caps the chunk's parameters
    assert budget.chunk_clients(1e15, 4 * big, 0, big, "cpu") == CPU_CHUNK_PARAM_BYTES // (4 * big)
    assert budget.chunk_clients(1e15, 4 * big, 0, big, "cuda") == int(1e15 // (4 * big))


def test_budget_bytes():
    assert budget.budget_bytes(2.0, "cuda", 123) == 2 * 2**30
    assert budget.budget_bytes(None, "cuda", 1000) == pytest.approx(800)
    assert budget.budget_bytes(None, "cpu", 1000) == pytest.approx(600)


def test_oom_message_names_the_setting_and_the_estimate():
    msg = budget.oom_message(
        "local training of a chunk of 8 clients",
        "client_chunk",
        next_round=3,
        memory_state="1.00 GiB free",
        chunk=8,
        num_params=2**20,
        row_bytes=4 * 2**20 * 5,
        act_bytes=2**20,
        batch_size=50,
        eval_batch=4096,
    )
    assert msg.startswith("round 3: out of memory in local training of a chunk of 8 clients (1.00 GiB free). ")
    assert "about 0.16 GiB" in msg and "21.0 MiB per client" in msg and "x 5 parameter-sized" in msg
    assert "Set client_chunk = 4" in msg and "batch-50" in msg
    ev = budget.oom_message(
        "allocating the client state",
        "eval_batch",
        next_round=1,
        memory_state="m",
        chunk=1,
        num_params=1,
        row_bytes=4,
        act_bytes=0,
        batch_size=1,
        eval_batch=512,
    )
    assert (
        ev == "out of memory in allocating the client state (m). Set eval_batch lower than 512 (rows per forward "
        "pass); results do not depend on it."
    )


def test_engine_chunk_and_message_come_from_the_functions():
    train, test, part, model = setup_data()
    cfg = fedfast.SimConfig(algorithm="fedavg", clients_per_round=4, memory_budget_gb=1e-4, seed=0)
    sim = fedfast.Simulation(cfg, model, train, test, part)
    rows, act = sim.budget.client_bytes()
    want = budget.param_rows(OPTIMIZERS[cfg.client_optimizer].rows(OptimizerSettings.of(cfg)), None, sim.num_params, 0)
    assert rows == 4 * sim.num_params * want and act > 0
    assert sim.budget.auto_chunk() == budget.chunk_clients(1e-4 * 2**30, rows, act, sim.num_params, "cpu")
    assert sim.budget.oom_message("evaluation", "eval_batch", next_round=sim.rnd + 1, chunk=sim.chunk).startswith(
        f"round {sim.rnd + 1}: out of memory in evaluation"
    )
    assert torch.is_tensor(sim.global_flat)
