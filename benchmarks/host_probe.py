"""The host's side of one fused-loss step on a GPU (issue 45): where the microseconds before the kernels go.

On the H100 (2026-11-27) ``bench_distill``'s ``host_us_per_call`` was 410-1440 us per forward + backward where the
device needs 3-700 us: the host bounds a federated-shape loss step. This probe splits that host time:

* ``launch_us``: one tiny ATen op on the GPU (``x.add_(1)``), the unit every extra tensor op in the path costs;
* ``triton_launch_us``: one launch of a trivial ``@triton.jit`` kernel (Triton's launcher alone);
* ``trivial_step_us``: ``(z * 2).sum().backward()``, the floor of any differentiable loss step;
* per loss and backend: the step's host time (100 calls queued, then one sync), the same with the kernels stubbed
  out (so Python and the small tensor ops alone), the count of ATen ops the step dispatches, and a ``cProfile``
  of 300 steps (the functions with the most own time) in the text file.

    python benchmarks/host_probe.py --out $OUT/<gpu>-host.json      (also writes <out>.txt: the profiles)

Runs on the CPU too (``--device cpu``, the Triton interpreter), where the counts mean the same and the times do not.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="500,10;8192,100")
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from fedfast import ops
    from fedfast.ops import _backend

    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    res = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": [],
    }
    text = io.StringIO()

    def echo(s):
        print(s, flush=True)
        text.write(s + "\n")

    def host_us(fn, n=args.calls):
        for _ in range(5):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) / n
        sync()
        return host * 1e6

    x = torch.zeros(16, device=dev)
    res["launch_us"] = host_us(lambda: x.add_(1), 1000)
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _noop(p, n, B: tl.constexpr):
            o = tl.arange(0, B)
            tl.store(p + o, tl.load(p + o, mask=o < n) + 1, mask=o < n)

        res["triton_launch_us"] = host_us(lambda: _noop[(1,)](x, 16, B=16), 1000)
    except Exception as e:  # noqa: BLE001 - report, do not stop the probe
        res["triton_launch_us"] = f"{type(e).__name__}: {e}"
    z0 = torch.randn(500, 10, device=dev)

    def trivial():
        z = z0.detach().requires_grad_(True)
        (z * 2).sum().backward()

    res["trivial_step_us"] = host_us(trivial)
    echo(
        f"launch {res['launch_us']:.1f} us  triton launch {res['triton_launch_us']}  trivial step "
        f"{res['trivial_step_us']:.1f} us"
    )

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            self.ops[str(func)] += 1
            return func(*a, **(kw or {}))

    backends = [b for b in ("triton", "cuda") if dev.type == "cuda" or b == "triton"]
    if dev.type == "cuda" and _backend.cuda_ext() is None:
        backends.remove("cuda")
    losses = {
        "kd": dict(kind="full", tau=2.0),
        "ntd": dict(kind="not_true", tau=1.0),
        "kd_seg_defer": dict(kind="full", tau=2.0, validate="defer"),
    }
    for shape in args.shapes.split(";"):
        R, C = (int(v) for v in shape.split(","))
        g = torch.Generator().manual_seed(0)
        z = torch.randn(R, C, generator=g).to(dev)
        t = torch.randn(R, C, generator=g).to(dev)
        y = torch.randint(0, C, (R,), generator=g).to(dev)
        seg = torch.arange(R, device=dev) // 50
        for name, kw in losses.items():
            kw = dict(kw)
            validate = kw.pop("validate", "off")
            for be in backends:

                def step(be=be, kw=kw, validate=validate):
                    zz = z.detach().requires_grad_(True)
                    loss = ops.distill(zz, t, y, segments=seg, backend=be, validate=validate, **kw)
                    loss.backward()

                row = {"loss": name, "backend": be, "R": R, "C": C, "validate": validate}
                row["host_us"] = host_us(step)
                with Count() as cnt:
                    step()
                row["aten_ops"] = sum(cnt.ops.values())
                row["aten_top"] = cnt.ops.most_common(12)
                # the same path with the backend's kernels replaced by allocations: Python + small ops only
                import fedfast.triton.distill as td

                saved = (td.distill_rows_triton, td.scale_rows_triton)
                ext = _backend.cuda_ext() if be == "cuda" else None
                try:
                    td.distill_rows_triton = lambda s, *a: (s.new_empty(s.shape[0]), torch.empty_like(s), 0)
                    td.scale_rows_triton = lambda gr, gl: gr
                    if be == "triton":
                        row["stubbed_host_us"] = host_us(step)
                finally:
                    td.distill_rows_triton, td.scale_rows_triton = saved
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(300):
                    step()
                sync()
                pr.disable()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
                echo(
                    f"== {name} {be} {R}x{C} validate={validate}: host {row['host_us']:.1f} us, "
                    f"stubbed {row.get('stubbed_host_us', float('nan')):.1f} us, {row['aten_ops']} aten ops"
                )
                text.write(s.getvalue())
                del ext
                res["rows"].append(row)
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.splitext(args.out)[0] + ".txt", "w") as f:
        f.write(text.getvalue())


if __name__ == "__main__":
    main()
