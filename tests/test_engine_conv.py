"""The engine's per-client convolution implementations (SimConfig.conv) and its memory refusals."""

import copy

import pytest
import torch
from sequential_loop import sequential as _sequential
from torch import nn

import fedfast
from fedfast import data


def _cnn_setup():
    train, test = data.synthetic(3, 96, 30, (3, 10, 10), separation=0.8, seed=0)
    part = data.iid(train.y, 6, seed=0)  # 16 samples each
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(6, 16, 3, stride=2),
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64, 3),
    )
    return train, test, part, model


@pytest.mark.slow
@pytest.mark.parametrize("conv", ["gemm", "triton", "hybrid"])
def test_conv_implementations_match_the_loop(conv):
    """A CNN (padding, stride 2, GroupNorm) trained with each convolution implementation equals the literal loop;
    'triton' and 'hybrid' run the implicit-GEMM kernels in Triton's interpreter here."""
    pytest.importorskip("triton") if conv in ("triton", "hybrid") else None
    train, test, part, model = _cnn_setup()
    cfg = fedfast.SimConfig(
        algorithm="fedntd", clients_per_round=3, rounds=2, batch_size=8, lr=0.05, momentum=0.9, seed=1, conv=conv
    )
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    assert sim.runtime.conv == conv and sim.trainer.stack.plan is not None and sim.trainer.stack.plan.conv == conv
    ref = _sequential(cfg, copy.deepcopy(model), train, part, cfg.rounds)
    sim.run()
    assert (sim.global_flat - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_conv_setting_is_checked_and_auto_is_grouped_on_cpu(monkeypatch):
    train, test, part, model = _cnn_setup()
    with pytest.raises(ValueError, match="conv: one of"):
        fedfast.SimConfig(conv="cudnn")
    sim = fedfast.Simulation(fedfast.SimConfig(clients_per_round=2), model, train, test, part)
    assert sim.runtime.conv == "grouped" and sim.trainer.stack.plan.conv == "grouped"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="conv: 'triton' runs on CUDA"):
        fedfast.Simulation(fedfast.SimConfig(clients_per_round=2, conv="triton"), model, train, test, part)


def test_out_of_memory_in_a_round_names_the_setting(monkeypatch):
    """A device allocation failure during local training becomes fedfast.OutOfMemory naming client_chunk and the
    estimated bytes (never an allocator traceback)."""
    train, test, part, model = _cnn_setup()
    sim = fedfast.Simulation(fedfast.SimConfig(clients_per_round=4, client_chunk=4), model, train, test, part)

    def boom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(sim.trainer, "train_chunk", boom)
    with pytest.raises(
        fedfast.OutOfMemory,
        match=r"round 1: out of memory in local training of a chunk of 4 "
        r"clients.*client_chunk = 2",
    ) as e:
        sim.round()
    assert "MiB per client" in str(e.value) and isinstance(e.value, MemoryError)
    monkeypatch.setattr(sim.trainer, "train_chunk", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(RuntimeError, match="other"):  # other errors pass through unchanged
        sim.round()


def test_out_of_memory_in_evaluation_names_eval_batch(monkeypatch):
    train, test, part, model = _cnn_setup()
    sim = fedfast.Simulation(fedfast.SimConfig(clients_per_round=2), model, train, test, part)
    monkeypatch.setattr(
        sim.evaluator,
        "evaluate",
        lambda *a, **k: (_ for _ in ()).throw(
            RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 99 bytes")
        ),
    )
    with pytest.raises(fedfast.OutOfMemory, match="evaluation.*eval_batch"):
        sim.round()


def test_a_state_store_that_cannot_grow_names_the_store_and_the_settings(monkeypatch):
    """Per-client state holds rows for the clients trained so far; when the store cannot grow, the round stops
    with OutOfMemory naming the store and the settings that shrink or move it (never an allocator traceback)."""
    from fedfast.store.memory import MemoryRows

    train, test, part, model = _cnn_setup()
    sim = fedfast.Simulation(fedfast.SimConfig(algorithm="scaffold", clients_per_round=2), model, train, test, part)
    assert sim.method.client_state.written == 0  # nothing stored for a client before it trains
    real = MemoryRows._alloc

    def full(self, rows):
        if rows > 1:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 99 bytes")
        return real(self, rows)

    monkeypatch.setattr(MemoryRows, "_alloc", full)
    with pytest.raises(
        fedfast.OutOfMemory,
        match=r"round 1: out of memory in the per-client state store \(rows of 0 "
        r"clients.*state_dtype = 'bfloat16' halves it, state_on_host",
    ):
        sim.round()


def test_cli_prints_out_of_memory_without_traceback(tmp_path, monkeypatch, capsys):
    from fedfast import cli
    from fedfast.sim.trainer import ChunkTrainer

    def boom(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(ChunkTrainer, "train_chunk", boom)
    code = cli.main(
        [
            "run",
            "--quiet",
            "--out",
            str(tmp_path / "r"),
            "--set",
            "dataset=synthetic",
            "--set",
            "num_clients=4",
            "--set",
            "clients_per_round=2",
            "--set",
            "rounds=1",
            "--set",
            "partition=iid",
            "--set",
            "algorithm=fedavg",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "out of memory in local training" in err and "Traceback" not in err
