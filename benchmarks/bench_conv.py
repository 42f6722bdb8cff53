"""Per-client convolutions: the implementations of ``fedfast.ops.client_conv2d`` on the benchmark models' layers.

For each layer geometry (the convolutions of the round benchmark's models at their clients-per-round and batch
sizes), each implementation runs forward + backward (input and weight gradients; the first layer of a model needs
no input gradient, as in training) and is timed after a warm-up. Work: ``3 x 2 * B * OH * OW * Cout * Cin * KH *
KW`` FLOPs per client (2 x for a first layer), so each time converts to TFLOP/s; the result also checks each
implementation against the grouped convolution on the same inputs (relative error of the output and gradients).

    python benchmarks/bench_conv.py --device cuda --out $OUT/conv.json        # all layers, all implementations
    python benchmarks/bench_conv.py --device cpu --impls grouped,gemm --layers pfl50

On CUDA, ``triton`` also runs each entry of ``--configs`` (tile sweeps, ``fwd:BM,BN,BK,warps,stages;...``; the
weight gradient takes a sixth number, its reduction split: 0 automatic, 1 none), and
``tf32`` toggles ``torch.backends.cudnn.allow_tf32`` (the rule every implementation follows for its tensor cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fedfast.ops.client_conv import client_conv2d, out_size  # noqa: E402

# name: (n clients, B, Cin, Cout, H, kernel, stride, padding, first layer)
LAYERS = {
    "pfl50.conv1": (50, 10, 3, 32, 32, 3, 1, 0, True),
    "pfl50.conv2": (50, 10, 32, 64, 30, 3, 1, 0, False),
    "pfl1000.conv1": (1000, 10, 3, 32, 32, 3, 1, 0, True),
    "pfl1000.conv2": (1000, 10, 32, 64, 30, 3, 1, 0, False),
    "fedntd_mnist.conv1": (10, 50, 1, 32, 28, 5, 1, 2, True),
    "fedntd_mnist.conv2": (10, 50, 32, 64, 14, 5, 1, 2, False),
    "resnet8.stem": (20, 10, 3, 16, 32, 3, 1, 1, True),
    "resnet8.c16": (20, 10, 16, 16, 32, 3, 1, 1, False),
    "resnet8.c32s2": (20, 10, 16, 32, 32, 3, 2, 1, False),
    "resnet8.c32": (20, 10, 32, 32, 16, 3, 1, 1, False),
    "resnet8.short32": (20, 10, 16, 32, 32, 1, 2, 0, False),
    "resnet8.c64s2": (20, 10, 32, 64, 16, 3, 2, 1, False),
    "resnet8.c64": (20, 10, 64, 64, 8, 3, 1, 1, False),
}


def flops(geom) -> int:
    n, B, Cin, Cout, H, k, s, p, first = geom
    OH, OW = out_size(H, H, k, s, p, 1)
    return (2 if first else 3) * 2 * n * B * OH * OW * Cout * Cin * k * k


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_impl(geom, impl, dev, channels_last, reps, warmup=2):
    n, B, Cin, Cout, H, k, s, p, first = geom
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(B, n * Cin, H, H, generator=g).to(dev)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = (torch.randn(n, Cout, Cin, k, k, generator=g) * (Cin * k * k) ** -0.5).to(dev)
    b = torch.randn(n, Cout, generator=g).to(dev)
    x.requires_grad_(not first)
    w.requires_grad_(True)
    b.requires_grad_(True)
    OH, _ = out_size(H, H, k, s, p, 1)
    go = torch.randn(B, n * Cout, OH, OH, generator=g).to(dev)
    ins = [w, b] + ([] if first else [x])

    def run():
        out = client_conv2d(x, w, b, s, p, 1, impl=impl)
        return out, torch.autograd.grad(out, ins, go)

    for _ in range(warmup):
        res = run()
    _sync(dev)
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            run()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        else:
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
    return statistics.median(times), res


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def need_bytes(geom, impl) -> int:
    """A generous estimate of the memory one timed pass holds: input, output and their gradients, the weights, and
    for ``gemm`` the im2col buffer (kept) with its gradient and the matrix-product intermediates."""
    n, B, Cin, Cout, H, k, s, p, first = geom
    OH, _ = out_size(H, H, k, s, p, 1)
    x, out, w = B * n * Cin * H * H, B * n * Cout * OH * OH, n * Cout * Cin * k * k
    cols = B * n * Cin * k * k * OH * OH if impl == "gemm" else 0
    return 4 * (3 * (x + out + w) + 3 * cols + (B * w if impl == "gemm" else 0))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--impls", default="grouped,gemm,triton")
    ap.add_argument("--layers", default="", help="comma-separated name prefixes (default: all)")
    ap.add_argument("--layouts", default="nchw,nhwc")
    ap.add_argument("--tf32", default="0,1", help="values of torch.backends.cudnn.allow_tf32 to run (CUDA)")
    ap.add_argument("--reps", type=int, default=0, help="timed repeats (default: 20 on CUDA, 3 on CPU)")
    ap.add_argument("--configs", default="", help="triton tile sweeps: 'fwd:64,64,16,8,2;wgrad:...|...'")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    reps = a.reps or (20 if dev.type == "cuda" else 3)
    prefixes = [p for p in a.layers.split(",") if p]
    layers = {k: v for k, v in LAYERS.items() if not prefixes or any(k.startswith(p) for p in prefixes)}
    tf32s = [bool(int(v)) for v in a.tf32.split(",")] if dev.type == "cuda" else [False]
    sweeps = [None] + [dict(part.split(":") for part in c.split(";")) for c in a.configs.split("|") if c]
    rows = []
    default_tiles = None  # fedfast.triton.conv.CONFIGS as shipped, restored before every sweep entry
    for tf32 in tf32s:
        if dev.type == "cuda":
            torch.backends.cudnn.allow_tf32 = tf32
        for name, geom in layers.items():
            ref = None
            for layout in a.layouts.split(","):
                for impl in a.impls.split(","):
                    for sw in sweeps if impl == "triton" else [None]:
                        if impl == "triton" and dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                            continue
                        if impl == "triton":  # the defaults, then this entry's tiles (each entry starts clean)
                            from fedfast.triton import conv as tc

                            default_tiles = default_tiles or dict(tc.CONFIGS)
                            tc.CONFIGS.clear()
                            tc.CONFIGS.update(default_tiles)
                            for kind, v in (sw or {}).items():
                                tc.CONFIGS[kind] = tuple(int(t) for t in v.split(","))
                        from fedfast.sim.memory import _free_bytes

                        need, free = need_bytes(geom, impl), _free_bytes(dev)
                        if need > 0.8 * free:
                            rows.append(
                                dict(
                                    layer=name,
                                    impl=impl,
                                    layout=layout,
                                    tf32=tf32,
                                    error=f"skipped: needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} free",
                                )
                            )
                            print(f"{name:20} {impl:8} {layout} {rows[-1]['error']}", flush=True)
                            continue
                        try:
                            sec, res = time_impl(geom, impl, dev, layout == "nhwc", reps)
                        except torch.OutOfMemoryError:
                            rows.append(dict(layer=name, impl=impl, layout=layout, tf32=tf32, error="out of memory"))
                            torch.cuda.empty_cache()
                            continue
                        if ref is None:
                            ref = res
                        err = max(_rel(u, v) for u, v in zip([res[0], *res[1]], [ref[0], *ref[1]], strict=True))
                        f = flops(geom)
                        rows.append(
                            dict(
                                layer=name,
                                geometry=geom,
                                impl=impl,
                                layout=layout,
                                tf32=tf32,
                                config=sw,
                                seconds=sec,
                                tflops=f / sec / 1e12,
                                flops=f,
                                rel_err_vs_first=err,
                            )
                        )
                        print(
                            f"{name:20} {impl:8} {layout} tf32={int(tf32)} {str(sw or ''):40} "
                            f"{sec * 1e3:9.3f} ms {f / sec / 1e12:7.2f} TFLOP/s  err {err:.1e}",
                            flush=True,
                        )
                        _write(a.out, dev, rows)  # after every row: a killed run keeps what it measured


def _write(path, dev, rows):
    if not path:
        return
    from bench_rounds import machine

    info = dict(
        device=str(dev),
        torch=torch.__version__,
        gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        threads=torch.get_num_threads(),
        machine=machine(dev),
        command=" ".join(["bench_conv.py"] + sys.argv[1:]),
        rows=rows,
    )
    from fedfast._io import write_atomic

    write_atomic(path, json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
