"""Per-client BatchNorm: :func:`fedfast.ops.client_batch_norm` against PyTorch's ``F.batch_norm`` over the n*C
channels of the grouped layout (what the batched executor ran before issue 46) and the float64 reference, on the
BatchNorm layers of the benchmark models at their clients per round and batch sizes.

Each entry runs forward + backward (gradients of x, weight and bias) after a warm-up and reports the median
seconds, the bytes each must move at least (read x and write y forward; read g and x, write gx backward: 5 x the
activation's bytes), the GB/s that makes, and the largest error of y and of each gradient against float64
(relative to the largest magnitude). The activations have mean 3 and spread 0.5 per channel, where PyTorch's
channels-last CPU kernel loses accuracy.

    python benchmarks/bench_batch_norm.py --out benchmarks/results/cpu-2core-intel-xeon-batch-norm.json
    python benchmarks/bench_batch_norm.py --device cuda --out $OUT/batch_norm.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fedfast.bench import cpu_model  # noqa: E402
from fedfast.cpu_alloc import tune_cpu_allocator  # noqa: E402
from fedfast.ops.client_batch_norm import client_batch_norm  # noqa: E402
from fedfast.ops.client_batch_norm_reference import client_batch_norm_reference  # noqa: E402

# name: (n clients, B, C, H) - the BatchNorm layers of a ResNet's stages and of a dense layer (H = 0)
LAYERS = {
    "resnet10.stage1": (10, 50, 64, 32),
    "resnet10.stage2": (10, 50, 128, 16),
    "resnet10.stage4": (10, 50, 512, 4),
    "tiny.stem": (3, 50, 16, 14),
    "mlp.bn1d": (50, 10, 200, 0),
}


def _inputs(n, B, C, H, device, layout, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shape = (B, n * C, H, H) if H else (B, n * C)
    x = (torch.randn(*shape, generator=g) * 0.5 + 3.0).to(device, dtype)
    gy = torch.randn(*shape, generator=g).to(device, dtype)
    if layout == "nhwc" and H:
        x, gy = x.contiguous(memory_format=torch.channels_last), gy.contiguous(memory_format=torch.channels_last)
    w = (torch.rand(n, C, generator=g) + 0.5).to(device, dtype)
    b = torch.randn(n, C, generator=g).to(device, dtype)
    return x, gy, w, b


def _run(impl, x, gy, w, b, n):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    if impl == "torch":
        y = F.batch_norm(x, None, None, w.reshape(-1), b.reshape(-1), True, 0.0, 1e-5)
    elif impl == "reference":
        y = client_batch_norm_reference(x, n, w, b)
    else:
        y = client_batch_norm(x, n, w, b)
    y.backward(gy)
    return y.detach(), x.grad, w.grad, b.grad


def _time(fn, device, repeat):
    fn()
    out = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cpu":
        tune_cpu_allocator()
    rows = []
    for name in a.layers.split(","):
        n, B, C, H = LAYERS[name]
        for layout in ("nchw", "nhwc") if H else ("dense",):
            x, gy, w, b = _inputs(n, B, C, H, device, layout)
            ref = _run("reference", *(t.double() for t in (x, gy, w, b)), n)
            moved = 5 * x.numel() * x.element_size()
            for impl in ("torch", "fedfast"):
                got = _run(impl, x, gy, w, b, n)
                errs = [float((a_.double() - r).abs().max() / r.abs().max()) for a_, r in zip(got, ref, strict=True)]
                s = _time(lambda: _run(impl, x, gy, w, b, n), device, a.repeat)
                rows.append(
                    dict(
                        layer=name,
                        layout=layout,
                        impl=impl,
                        seconds=s,
                        bytes=moved,
                        gbps=moved / s / 1e9,
                        err_y=errs[0],
                        err_gx=errs[1],
                        err_gw=errs[2],
                        err_gb=errs[3],
                    )
                )
                print(
                    f"{name:16s} {layout:5s} {impl:8s} {s * 1e3:8.2f} ms {moved / s / 1e9:6.1f} GB/s  "
                    f"err y {errs[0]:.1e} gx {errs[1]:.1e} gw {errs[2]:.1e} gb {errs[3]:.1e}",
                    flush=True,
                )
    out = dict(
        device=str(device),
        cpu=cpu_model(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        python=platform.python_version(),
        rows=rows,
        note="fwd+bwd of one BatchNorm layer of n clients; bytes: the 5 activation-sized reads/writes a "
        "fused kernel must make; errors against float64, relative to the largest magnitude",
    )
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
