"""torchvision's classification models at full width through one FedAvg round: the engine on its traced program
(``executor = "auto"``: :mod:`fedfast.batched`), the engine on ``torch.func.vmap`` (``executor = "vmap"``) and the
plain per-client loop a researcher writes (a copy of the global model per client, ``torch.optim.SGD``,
``state_dict`` averaging), in the same process on the same clients, data and batches.

The models are torchvision's layouts as ``tests/torchvision_layouts.py`` writes them (``import torchvision`` fails
on the CPU build of torch), 10 classes on 3x32x32 inputs (CIFAR's shape). Each round trains ``--clients`` clients of
``--samples`` samples each for one epoch at batch ``--batch``, SGD with momentum 0.9. Each entry reports the median
seconds of ``--reps`` rounds after one warm-up round, and the training FLOPs a round must do (``fedfast.flops``:
the convolutions and linear layers, forward + weight and input gradients), so each time converts to GFLOP/s::

    python benchmarks/zoo_executors.py --out benchmarks/results/cpu-2core-amd-epyc-zoo.json
    python benchmarks/zoo_executors.py --device cuda --clients 32 --out $OUT/zoo.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torchvision_layouts as tv  # noqa: E402

import fedfast  # noqa: E402
from fedfast import batched, data  # noqa: E402
from fedfast.bench import _write, machine  # noqa: E402
from fedfast.flops import training_flops  # noqa: E402

MODELS = ["resnet18", "resnet34", "resnet50", "vgg11_bn", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0"]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _plain_round(glob, train, part, clients, batch, lr, device):
    """One FedAvg round as a per-client loop: the clients' batches in order, SGD with momentum, the size-weighted
    state_dict average (integer buffers rounded)."""
    states, sizes = [], []
    for k in clients:
        local = copy.deepcopy(glob).train()
        opt = torch.optim.SGD(local.parameters(), lr=lr, momentum=0.9)
        rows = torch.as_tensor(np.asarray(part.indices[k]))
        for s in range(0, len(rows), batch):
            x, y = train.batch(rows[s : s + batch].to(device))
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(local(x), y).backward()
            opt.step()
        states.append(local.state_dict())
        sizes.append(len(rows))
    w = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
    avg = {}
    for key, v in states[0].items():
        s = sum(float(w[i]) * states[i][key].double() for i in range(len(states)))
        avg[key] = (s.round() if not v.is_floating_point() else s).to(v.dtype)
    glob.load_state_dict(avg)


def _time_rounds(fn, reps, device):
    fn()  # warm-up: allocation, plans, oneDNN primitives
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def run_model(name, args, device):
    m, n, B = args.clients, args.samples, args.batch
    train, test = data.synthetic(10, m * n, 16, (3, 32, 32), separation=0.8, seed=0)
    train, test = train.to(device), test.to(device)
    part = data.Partition(list(np.arange(m * n).reshape(m, n)))
    torch.manual_seed(0)
    model = tv.ZOO[name](num_classes=10).to(device)
    fwd, step = training_flops(model.eval(), train.x[:1].float())  # eval: BatchNorm on one sample
    model.train()
    flops = step * m * n
    out = {
        "params": sum(p.numel() for p in model.parameters()),
        "forward_flops_per_sample": fwd,
        "round_flops": flops,
    }
    prog, why = batched.plan(model)
    out["traced_program"] = prog is not None
    if prog is None:
        out["why_not"] = why
    for case, executor in (("engine", "auto"), ("vmap", "vmap")):
        cfg = fedfast.SimConfig(
            algorithm="fedavg",
            clients_per_round=m,
            rounds=1000,
            eval_every=1000,
            local_epochs=1,
            batch_size=B,
            lr=0.01,
            momentum=0.9,
            seed=0,
            executor=executor,
        )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part, device=device)
            if case == "engine":
                out["engine_executor"] = "traced program" if sim.runtime.plan is not None else "vmap"
            med, times = _time_rounds(sim.round, args.reps, device)
            out[case] = {"median_s": med, "times_s": times, "gflops_per_s": flops / med / 1e9}
        except (RuntimeError, MemoryError) as e:  # noqa: PERF203
            out[case] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        sim = None
        gc.collect()
    glob = copy.deepcopy(model)
    med, times = _time_rounds(lambda: _plain_round(glob, train, part, range(m), B, 0.01, device), args.reps, device)
    out["plain_loop"] = {"median_s": med, "times_s": times, "gflops_per_s": flops / med / 1e9}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    res = {
        "machine": machine(args.device),
        "settings": {"clients": args.clients, "samples": args.samples, "batch": args.batch, "reps": args.reps},
        "models": {},
    }
    for name in args.models.split(","):
        r = run_model(name, args, device)
        res["models"][name] = r
        parts = [
            f"{c} {r[c]['median_s']:.2f}s" if "median_s" in r.get(c, {}) else f"{c} failed"
            for c in ("engine", "vmap", "plain_loop")
        ]
        print(f"{name}: {', '.join(parts)}", flush=True)
    if args.out:
        _write(args.out, res)
    return res


if __name__ == "__main__":
    main()
