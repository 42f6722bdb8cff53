"""Tile sweep of the implicit-GEMM convolution kernels, kernel by kernel, against cuDNN's grouped convolution.

``bench_conv.py`` times forward + backward together; this times each of the three kernels of
:mod:`fedfast.triton.conv` (forward, input gradient, weight gradient) alone, for each candidate tile
``(BM, BN, BK, num_warps, num_stages)``, beside the matching cuDNN call (``F.conv2d`` with ``groups = n`` and
``aten.convolution_backward`` with one output asked for), on the layers where the round benchmark spends its
convolution time (``simple_cnn``'s second convolution at 50, 200 and 1000 clients; the FedNTD CNN's 5x5 one).

Work per kernel: ``2 * n * B * OH * OW * Cout * Cin * KH * KW`` FLOPs (each is one GEMM of that size), so each time
is a TFLOP/s figure to set against the machine's TF32 (or fp32) matrix rate. Every result is checked against a
float64 reference of the same kernel (cuDNN in float64 on the device) on random inputs, with the output poisoned
(NaN) before each call: a tile whose error passes the bound for its precision (TF32: 1e-2 relative Frobenius,
fp32: 1e-5) and leaves no NaN counts; others are reported and never chosen.

``best`` in the JSON is, per kernel, the valid tile with the smallest geometric mean of time relative to the
shipped default over the ``--choose`` layers; ``--best-out FILE`` writes it as ``fwd:...;dgrad:...;wgrad:...`` for
``bench_rounds.py --triton-configs @FILE`` (the round with those tiles, in the same run as the default and the
plain loop).

    python benchmarks/tune_conv.py --device cuda --out $OUT/tune.json --best-out $OUT/tuned.txt --seconds 150
    TRITON_INTERPRET=1 python benchmarks/tune_conv.py --device cpu --layers tiny --reps 1   # the code paths only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

# name: (n clients, B, Cin, Cout, H, kernel, stride, padding)
LAYERS = {
    "pfl50.conv2": (50, 10, 32, 64, 30, 3, 1, 0),
    "pfl200.conv2": (200, 10, 32, 64, 30, 3, 1, 0),
    "pfl1000.conv2": (1000, 10, 32, 64, 30, 3, 1, 0),
    "fedntd_mnist.conv2": (10, 50, 32, 64, 14, 5, 1, 2),
    "tiny": (3, 2, 16, 16, 6, 3, 1, 1),  # the code paths in the interpreter, nothing to time
}
CHOOSE = "pfl50.conv2,pfl200.conv2,pfl1000.conv2"

# first entry of each: the shipped default (fedfast.triton.conv.CONFIGS); the wgrad default was chosen by this
# sweep's first GPU run, where the forward's (128, 64, 16, 4, 4) and the input gradient's (128, 32, 16, 4, 4) were
# faster but spill registers (see CONFIGS)
CANDIDATES = {
    "fwd": [
        (64, 64, 16, 8, 2),
        (128, 64, 16, 4, 4),
        (64, 64, 32, 4, 3),
        (128, 64, 32, 4, 3),
        (128, 64, 32, 8, 3),
        (256, 64, 32, 8, 3),
        (64, 64, 32, 4, 4),
        (128, 64, 32, 8, 4),
    ],
    "dgrad": [
        (64, 32, 16, 4, 2),
        (128, 32, 16, 4, 4),
        (64, 32, 32, 4, 3),
        (128, 32, 32, 4, 3),
        (128, 32, 64, 4, 3),
        (128, 32, 32, 8, 3),
        (256, 32, 32, 8, 3),
        (256, 32, 64, 8, 3),
    ],
    "wgrad": [
        (64, 32, 32, 4, 4),
        (64, 64, 32, 8, 2),
        (64, 32, 64, 4, 3),
        (64, 32, 128, 4, 3),
        (64, 32, 64, 8, 3),
        (64, 32, 128, 8, 3),
        (64, 32, 256, 8, 2),
        (64, 32, 128, 4, 4),
    ],
}
TOL = {True: 1e-2, False: 1e-5}


def _inputs(geom, dev, seed):
    n, B, Cin, Cout, H, k, s, p = geom
    from fedfast.ops.client_conv import out_size

    OH, _ = out_size(H, H, k, s, p, 1)
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, n * Cin, H, H, generator=g).to(dev)
    w = (torch.randn(n, Cout, Cin, k, k, generator=g) * (Cin * k * k) ** -0.5).to(dev)
    b = torch.randn(n, Cout, generator=g).to(dev)
    go = torch.randn(B, n * Cout, OH, OH, generator=g).to(dev)
    return x, w, b, go


def _cudnn(kind, geom, x, w, b, go):
    n, B, Cin, Cout, H, k, s, p = geom
    w2 = w.reshape(n * Cout, Cin, k, k)
    if kind == "fwd":
        return F.conv2d(x, w2, b.reshape(-1), s, p, 1, n)
    mask = [kind == "dgrad", kind == "wgrad", False]
    gx, gw, _ = torch.ops.aten.convolution_backward(go, x, w2, None, [s, s], [p, p], [1, 1], False, [0, 0], n, mask)
    return gx if kind == "dgrad" else gw.view(n, Cout, Cin, k, k)


def _triton(kind, geom, x, w, b, go, tf32, cfg, dst):
    from fedfast.triton import conv as tc

    n, B, Cin, Cout, H, k, s, p = geom
    st, pd, dl = (s, s), (p, p), (1, 1)
    if kind == "fwd":
        return tc.conv_forward(x, w, b, st, pd, dl, dst, tf32, cfg)
    if kind == "dgrad":
        return tc.conv_input_grad(go, w, st, pd, dl, dst, tf32, cfg)
    return tc.conv_weight_grad(go, x, st, pd, dl, dst, tf32, cfg)


def _time(fn, dev, reps):
    fn()
    if dev.type != "cuda":
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    torch.cuda.synchronize(dev)
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    return statistics.median(times)


def _err(out, ref) -> float:
    out = out.detach().double()
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", default="pfl50.conv2,pfl200.conv2,pfl1000.conv2,fedntd_mnist.conv2")
    ap.add_argument("--kinds", default="fwd,dgrad,wgrad")
    ap.add_argument("--tf32", default="1", help="0 and/or 1: torch.backends.cudnn.allow_tf32 and the kernels' PREC")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=0.0, help="stop starting new rows after this long (0: no limit)")
    ap.add_argument("--choose", default=CHOOSE)
    ap.add_argument("--out", default="")
    ap.add_argument("--best-out", default="")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    t_start = time.perf_counter()
    rows, skipped = [], 0
    from bench_rounds import machine

    for tf32 in [bool(int(v)) for v in a.tf32.split(",")]:
        if dev.type == "cuda":
            torch.backends.cudnn.allow_tf32 = tf32
        for name in a.layers.split(","):
            geom = LAYERS[name]
            n, B, Cin, Cout, H, k, s, p = geom
            from fedfast.ops.client_conv import out_size

            OH, _ = out_size(H, H, k, s, p, 1)
            flops = 2 * n * B * OH * OH * Cout * Cin * k * k
            x, w, b, go = _inputs(geom, dev, seed=len(rows) + 1)  # fresh random inputs per layer
            for kind in a.kinds.split(","):
                ref = _cudnn(kind, geom, x.double(), w.double(), b.double(), go.double()).double()
                shape = {"fwd": go.shape, "dgrad": x.shape, "wgrad": w.shape}[kind]
                dst = torch.empty(shape, device=dev)
                entries = [("cudnn", None)] + [("triton", c) for c in CANDIDATES[kind]]
                for impl, cfg in entries:
                    if a.seconds and time.perf_counter() - t_start > a.seconds:
                        skipped += 1
                        continue
                    if impl == "cudnn":
                        fn = lambda: _cudnn(kind, geom, x, w, b, go)  # noqa: E731, F821 (deleted after use)
                    else:
                        fn = lambda: _triton(kind, geom, x, w, b, go, tf32, cfg, dst)  # noqa: E731, F821
                    row = dict(
                        layer=name,
                        geometry=list(geom),
                        kind=kind,
                        tf32=tf32,
                        impl=impl,
                        config=list(cfg) if cfg else None,
                        flops=flops,
                    )
                    try:
                        dst.fill_(float("nan"))
                        row["rel_err_fp64"] = _err(fn(), ref)
                        sec = _time(fn, dev, a.reps)
                    except Exception as e:  # a tile that does not compile or launch (shared memory): recorded
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                        print(f"{name:20} {kind:6} tf32={int(tf32)} {impl:7} {str(cfg):24} {row['error']}", flush=True)
                        rows.append(row)
                        continue
                    row.update(
                        seconds=sec, tflops=flops / sec / 1e12, ok=bool(row["rel_err_fp64"] <= TOL[tf32])
                    )  # NaN compares False
                    rows.append(row)
                    print(
                        f"{name:20} {kind:6} tf32={int(tf32)} {impl:7} {str(cfg or ''):24} {sec * 1e3:9.3f} ms "
                        f"{row['tflops']:7.2f} TFLOP/s  err {row['rel_err_fp64']:.1e}{'' if row['ok'] else ' BAD'}",
                        flush=True,
                    )
                    _write(a.out, dev, rows, None, skipped, machine)
            del x, w, b, go
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    best = choose(rows, a.choose.split(","))
    _write(a.out, dev, rows, best, skipped, machine)
    if best:
        spec = ";".join(f"{kind}:{','.join(map(str, cfg))}" for kind, cfg in best.items())
        print("best:", spec, flush=True)
        if a.best_out:
            with open(a.best_out, "w") as fh:
                fh.write(spec + "\n")
    if skipped:
        print(f"{skipped} rows not run: --seconds {a.seconds:g} reached", flush=True)


def choose(rows, layers) -> dict:
    """Per kernel: the tile, valid on every layer where it ran, with the least geometric mean of its time over the
    default's across ``layers`` (TF32 rows; fp32 where no TF32 row ran). A kernel with no complete data is left
    out (the default stays)."""
    out = {}
    tf = any(r.get("tf32") for r in rows)
    for kind in CANDIDATES:
        default = tuple(CANDIDATES[kind][0])
        t = {}
        for r in rows:
            if r["kind"] == kind and r["impl"] == "triton" and r["tf32"] == tf and r["layer"] in layers:
                t.setdefault(tuple(r["config"]), {})[r["layer"]] = r["seconds"] if r.get("ok") else None
        base = t.get(default)
        if not base or any(v is None for v in base.values()):
            continue
        scores = {}
        for cfg, per in t.items():
            if set(per) != set(base) or any(v is None for v in per.values()):
                continue
            scores[cfg] = math.exp(sum(math.log(per[ly] / base[ly]) for ly in base) / len(base))
        out[kind] = min(scores, key=scores.get)
    return out


def _write(path, dev, rows, best, skipped, machine):
    if not path:
        return
    info = dict(
        machine=machine(dev),
        command=" ".join(["tune_conv.py"] + sys.argv[1:]),
        rows=rows,
        best={k: list(v) for k, v in (best or {}).items()},
        rows_not_run=skipped,
    )
    from fedfast._io import write_atomic

    write_atomic(path, json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
