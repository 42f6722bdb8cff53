"""Fused aggregation and all-client step over flat [N, P] buffers vs the usual baselines.

Run: python -m pytest benchmarks/bench_flat.py --benchmark-only   (FEDFAST_BENCH_DEVICE=cuda on a GPU;
FEDFAST_BENCH_TUNE_ALLOC=1 applies fedfast.tune_cpu_allocator to every implementation)
Models: the FedAvg MNIST CNN (McMahan et al.; 1,663,370 parameters in 8 tensors) and, on a GPU, an 11.0M
MLP (ResNet-18's size); N clients (CPU: 50; GPU: 10, 100, 1000; FEDFAST_BENCH_N / FEDFAST_BENCH_MODELS).

Bytes each op must move (fp32):
  aggregate (FedAvg)            4*P*(n + 1)        read n client rows, write the global
  aggregate (FedAvgM, momentum) 4*P*(n + 4)        + read global, read/write momentum
  client step (SGD momentum)    20*n*P             theta r/w, grad r, momentum r/w (+8*n*P for a concatenation
                                                   of the per-parameter gradients first: cat_then_fedfast)
Baselines: aggregation by (a) the per-parameter state_dict loop of research code, (b) torch._foreach_add_
per client, (c) stacked ``w @ X``; the client step by torch.optim.SGD stepping N models one after another.
"""

from __future__ import annotations

import os

import pytest
import torch
from _bench import SMOKE, median  # noqa: E402,F401
from torch import nn

from fedfast import ops
from fedfast.flat import ClientStack
from fedfast.ops import _backend

DEVICE = os.environ.get("FEDFAST_BENCH_DEVICE", "cpu")
if os.environ.get("FEDFAST_BENCH_TUNE_ALLOC") == "1":  # glibc keeps freed memory (fedfast.cpu_alloc): all impls
    from fedfast import tune_cpu_allocator

    tune_cpu_allocator()
N_LIST = [int(v) for v in os.environ.get("FEDFAST_BENCH_N", "50" if DEVICE == "cpu" else "10,100,1000").split(",")]
MODELS = os.environ.get("FEDFAST_BENCH_MODELS", "cnn1.6M" if DEVICE == "cpu" else "cnn1.6M,mlp11M").split(",")


def fedavg_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(3136, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def mlp11m():
    """An 11.0M-parameter stand-in for ResNet-18's size (11.2M) without BatchNorm buffers."""
    return nn.Sequential(nn.Linear(3072, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 256))


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


_CACHE = {}
_PARAMS = {"cnn1.6M": 1_663_370, "mlp11M": 11_014_400}


def _fits(N, model, buffers: int):
    """Skip (with the bytes) a case whose ``buffers`` fp32 [N, P] tensors do not fit the device: 1000 clients of
    the 11M model need 44 GB per buffer (on an 80 GB H100 these cases used to end in CUDA OOM tracebacks)."""
    need = buffers * N * _PARAMS[model] * 4
    if DEVICE == "cuda":
        _CACHE.clear()
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0]
    else:
        from fedfast.sim.memory import _free_bytes

        free = _free_bytes(torch.device("cpu"))
    if need > 0.9 * free:
        pytest.skip(
            f"needs {need / 2**30:.1f} GiB ({buffers} x [{N}, {_PARAMS[model]}] fp32), "
            f"{free / 2**30:.1f} GiB free on {DEVICE}"
        )


def _stack(N, model="cnn1.6M"):
    if (N, model) not in _CACHE:
        _CACHE.clear()
        torch.manual_seed(0)
        m = (fedavg_cnn() if model == "cnn1.6M" else mlp11m()).to(DEVICE)
        st = ClientStack(m, N)
        st.params.add_(torch.randn_like(st.params) * 0.01)
        _CACHE[(N, model)] = (m, st)
    return _CACHE[(N, model)]


def _info(benchmark, op, impl, N, P, nbytes):
    med = median(benchmark)
    if med is None:  # --benchmark-disable: ran once (a smoke test), nothing to record
        return
    benchmark.extra_info.update(
        dict(
            op=op,
            impl=impl,
            N=N,
            P=P,
            bytes=nbytes,
            gbps=nbytes / med / 1e9,
            device=DEVICE,
            torch=torch.__version__,
            threads=torch.get_num_threads(),
        )
    )


AGG_IMPLS = ["state_dict_loop", "foreach", "stacked_matmul", "fedfast"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("N", N_LIST)
@pytest.mark.parametrize("impl", AGG_IMPLS)
def test_aggregate_fedavg(benchmark, impl, N, model):
    _fits(N, model, 2 if impl == "state_dict_loop" else 1)  # the clients' rows (+ the loop's state_dict copies)
    m, st = _stack(N, model)
    P = st.P
    w = torch.rand(N, device=DEVICE)
    wn = w / w.sum()
    g = st.layout.flatten_params(m)
    if impl == "state_dict_loop":  # FedNTD/Flower style: per key, per client, out-of-place accumulate
        sds = [st.state_dict(k) for k in range(N)]
        keys = list(sds[0])
        wl = wn.tolist()

        def run():
            avg = {}
            for key in keys:
                acc = torch.zeros_like(sds[0][key])
                for i in range(N):
                    acc = acc + wl[i] * sds[i][key]
                avg[key] = acc
            _sync()
            return avg
    elif impl == "foreach":
        xs = [list(st.param_views(slice(k, k + 1)).values()) for k in range(N)]
        wl = wn.tolist()

        def run():
            avg = [torch.zeros_like(t[0]) for t in xs[0]]
            for i in range(N):
                torch._foreach_add_(avg, [t[0] for t in xs[i]], alpha=wl[i])
            _sync()
            return avg
    elif impl == "stacked_matmul":

        def run():
            out = wn @ st.params
            _sync()
            return out
    else:
        if not _backend.available("cpu", DEVICE) and DEVICE == "cpu":
            pytest.skip("cpu extension not built")

        def run():
            out = ops.aggregate(st.params, g, weights=w)
            _sync()
            return out

    run()
    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    _info(benchmark, "aggregate", impl, N, P, 4 * P * (N + 1))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("N", N_LIST)
@pytest.mark.parametrize("impl", ["torch_optim_sgd_sequential", "fedfast", "fedfast_pieces", "cat_then_fedfast"])
def test_client_step_sgd_momentum(benchmark, impl, N, model):
    """``fedfast``: the step on one [N, P] gradient; ``fedfast_pieces``: on the per-parameter gradients autograd
    returns (the engine's path on the cpu and triton backends: no concatenation); ``cat_then_fedfast``: their
    concatenation and then the step (the engine's path before, and on the cuda backend)."""
    _fits(N, model, 4 if impl in ("fedfast", "fedfast_pieces") else 5)  # rows, gradients, theta, momentum, + one
    m, st = _stack(N, model)
    P = st.P
    torch.manual_seed(1)
    grads = torch.randn(N, P, device=DEVICE) * 0.01
    if impl == "torch_optim_sgd_sequential":
        models = []
        for k in range(N):
            mk = st.load_into((fedavg_cnn() if model == "cnn1.6M" else mlp11m()).to(DEVICE), k)
            gv = st.layout.param_views(grads[k])
            for p, gk in zip(mk.parameters(), gv.values(), strict=True):
                p.grad = gk.clone()
            models.append((mk, torch.optim.SGD(mk.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-5)))

        def run():
            for _, opt in models:
                opt.step()
            _sync()
    else:
        theta = st.params.clone()
        buf = torch.zeros_like(theta)
        if impl != "fedfast":
            pieces = [g.contiguous() for g in st.layout.param_views(grads).values()]  # separate [N, *shape] tensors
            del grads

        def run():
            g = (
                grads
                if impl == "fedfast"
                else pieces
                if impl == "fedfast_pieces"
                else torch.cat([p.reshape(N, -1) for p in pieces], 1)
            )
            ops.client_step(theta, g, lr=0.01, momentum=0.9, momentum_buf=buf, weight_decay=1e-5)
            _sync()

    run()
    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    _info(benchmark, "client_step", impl, N, P, 20 * N * P)
