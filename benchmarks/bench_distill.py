"""Fused distillation losses: forward + backward, every backend vs eager PyTorch and torch.compile.

Run (CPU):  python -m pytest benchmarks/bench_distill.py --benchmark-only
Run (GPU):  FEDFAST_BENCH_DEVICE=cuda python -m pytest benchmarks/bench_distill.py --benchmark-only \
                --benchmark-json benchmarks/results/<device>.json
Shapes: launch-bound (500, 10); bandwidth-bound (65536, 100), (65536, 1000), (8192, 32000); on the CPU
the default set is (500, 10), (8192, 100) (set FEDFAST_BENCH_SHAPES="R,C;R,C" to override).

Bytes each op must move (fp32 student/teacher/gradient, s = t = g = 4 bytes, M teachers):
  forward   R*C*(s + M*t + g) + R*(8 + 4)    read z and t, write dL/dz (+ int64 labels, fp32 row loss)
  backward  R*C*(g + g)                      read dL/dz, write grad_output * dL/dz
The eager and compiled baselines move more; their GB/s uses the same (minimum) byte count, so the
number is an effective bandwidth, comparable across implementations. ``pct_of_copy`` relates it to the
device's measured copy bandwidth (clone of a 512 MiB tensor: 2 bytes moved per byte copied). On a GPU,
``host_us_per_call`` is the host's time per forward + backward when 100 calls are queued back to back: at
federated shapes (B <= 1024 rows, C <= 1000) it, not the kernels, bounds a step's loss.
"""

from __future__ import annotations

import os
import platform

import pytest
import torch
from _bench import SMOKE, median  # noqa: E402,F401

import fedfast
from fedfast import ops
from fedfast.ops import _backend

DEVICE = os.environ.get("FEDFAST_BENCH_DEVICE", "cpu")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("FEDFAST_BENCH_DEVICE=cuda but no CUDA device", allow_module_level=True)


def _shapes():
    env = os.environ.get("FEDFAST_BENCH_SHAPES")
    if env:
        return [tuple(int(v) for v in s.split(",")) for s in env.split(";")]
    if SMOKE:
        return [(64, 10)]
    if DEVICE == "cuda":
        return [(500, 10), (65536, 100), (65536, 1000), (8192, 32000)]
    return [(500, 10), (8192, 100)]


def _impls():
    out = ["eager", "compiled"]
    for b in ("cpu", "triton", "cuda"):
        if b == "triton" and DEVICE != "cuda":
            continue  # the interpreter is a correctness tool, not a benchmark
        if _backend.available(b, DEVICE):
            out.append(b)
    return out


LOSSES = {
    "kd": dict(kind="full", tau=4.0, kd_weight=16.0),
    "ntd": dict(kind="not_true", tau=1.0, kd_weight=1.0),
    "asd": dict(kind="full", tau=2.0, kd_weight=10.0, asd=True),
    "gkd_vote3": dict(kind="full", tau=1.0, kd_weight=0.1, M=3),
    "cad": dict(kind="full", tau=2.0, soft_ce=True, class_alpha=True),
    "adc": dict(kind="full", tau=4.0, ce_weight=0.65, kd_weight=0.35 * 16, rho=True),
}

_COPY_GBPS: dict[str, float] = {}


def copy_bandwidth_gbps() -> float:
    """Measured device copy bandwidth (GB/s), counting read + write."""
    if DEVICE in _COPY_GBPS:
        return _COPY_GBPS[DEVICE]
    import time

    x = torch.empty(128 * 2**20, dtype=torch.float32, device=DEVICE)
    x.fill_(1.0)
    best = float("inf")
    for _ in range(5):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = x.clone()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
        del y
    _COPY_GBPS[DEVICE] = 2 * x.numel() * 4 / best / 1e9
    return _COPY_GBPS[DEVICE]


def _inputs(name, R, C):
    g = torch.Generator().manual_seed(0)
    spec = LOSSES[name]
    M = spec.get("M", 1)
    z = (torch.randn(R, C, generator=g) * 2).to(DEVICE)
    t = (torch.randn(M, R, C, generator=g) * 2).to(DEVICE)
    y = torch.randint(0, C, (R,), generator=g).to(DEVICE)
    seg = torch.arange(R, device=DEVICE) // 50  # clients of 50 rows
    extra = {}
    if spec.get("class_alpha"):
        extra["class_alpha"] = torch.rand(C, generator=g).to(DEVICE)
    if spec.get("rho"):
        extra["rho"] = torch.rand(C, generator=g).to(DEVICE)
    return z, (t if M > 1 else t[0]), y, seg, extra


def _fused_step(name, backend):
    spec = LOSSES[name]
    kw = {k: v for k, v in spec.items() if k in ("kind", "tau", "kd_weight", "ce_weight", "soft_ce")}

    def step(z, t, y, seg, extra):
        zz = z.requires_grad_(True)
        rw = None
        if spec.get("asd"):
            prior = torch.full((z.shape[1],), 1.0 / z.shape[1], device=z.device)
            ahat = ops.asd_weights(t, y, prior, None, entropy_tau=2.0, backend=backend, validate="off")
            rw = ops.asd_row_weight(ahat, y, z.shape[1], seg)
        tw = torch.full((t.shape[0],), 1.0 / t.shape[0], device=z.device) if t.dim() == 3 else None
        loss = ops.distill(
            zz, t, y, segments=seg, row_weight=rw, teacher_weights=tw, backend=backend, validate="off", **kw, **extra
        )
        loss.backward()
        zz.grad = None
        return loss

    return step


def _eager_step(name):
    """What a user writes in plain PyTorch: the reference formulas, autograd backward."""
    spec = LOSSES[name]
    kw = {k: v for k, v in spec.items() if k in ("tau", "kd_weight", "ce_weight", "soft_ce")}
    kw["not_true"] = spec["kind"] == "not_true"

    def step(z, t, y, seg, extra):
        zz = z.requires_grad_(True)
        R, C = z.shape
        n = torch.zeros(R, device=z.device).index_add_(0, seg, torch.ones(R, device=z.device))[seg]
        if spec.get("asd"):
            prior = torch.full((1, C), 1.0 / C, device=z.device)
            ahat = ops.asd_weights_reference(t, y, prior, None, entropy_tau=2.0)
            kw["row_weight"] = ops.asd_row_weight(ahat, y, C, seg)
        if t.dim() == 3:
            M = t.shape[0]
            rows = ops.distill_reference(zz, t[0], y, **{**kw, "kd_weight": 0.0})
            for m in range(M):
                rows = rows + ops.distill_reference(
                    zz, t[m], y, **{**kw, "ce_weight": 0.0, "kd_weight": kw["kd_weight"] / M}
                )
        else:
            rows = ops.distill_reference(zz, t, y, **kw, **extra)
        loss = (rows / n).sum()
        loss.backward()
        zz.grad = None
        return loss

    return step


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("R,C", _shapes())
@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("name", list(LOSSES))
def test_distill_fwd_bwd(benchmark, name, impl, R, C):
    z, t, y, seg, extra = _inputs(name, R, C)
    if impl == "eager":
        fn = _eager_step(name)
    elif impl == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(_eager_step(name), dynamic=False)
    else:
        fn = _fused_step(name, impl)

    def run():
        fn(z.detach(), t, y, seg, extra)
        _sync()

    for _ in range(2):
        run()  # warm-up (compilation, autotuning, allocator)
    benchmark.pedantic(run, rounds=10 if R * C >= 10**6 else 30, iterations=1, warmup_rounds=1)
    M = t.shape[0] if t.dim() == 3 else 1
    esz = z.element_size()
    nbytes = R * C * (esz + M * t.element_size() + esz) + R * 12 + R * C * 2 * esz
    med = median(benchmark)
    if med is None:  # --benchmark-disable: ran once (a smoke test), nothing to record
        return
    copy = copy_bandwidth_gbps()
    dev_name = torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor() or platform.machine()
    if DEVICE == "cuda":  # the host's cost of one call: 100 calls queued without waiting, per call (at federated
        # shapes the kernels take less than the host needs to launch them, so this is what a step pays)
        import time

        _sync()
        t0 = time.perf_counter()
        for _ in range(100):
            fn(z.detach(), t, y, seg, extra)
        host = (time.perf_counter() - t0) / 100
        _sync()
        benchmark.extra_info["host_us_per_call"] = host * 1e6
    benchmark.extra_info.update(
        dict(
            loss=name,
            impl=impl,
            R=R,
            C=C,
            M=M,
            dtype=str(z.dtype),
            bytes=nbytes,
            gbps=nbytes / med / 1e9,
            copy_gbps=copy,
            pct_of_copy=100 * nbytes / med / 1e9 / copy,
            device=DEVICE,
            device_name=dev_name,
            torch=torch.__version__,
            fedfast=fedfast.__version__,
            threads=torch.get_num_threads(),
        )
    )
