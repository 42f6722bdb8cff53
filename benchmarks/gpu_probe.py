"""Where the fused ops' GPU time goes, and their launch configurations swept (issue 45).

The fused losses reached 22-39 % and the aggregate 40-70 % of the copy bandwidth on the H100 (docs/benchmarks.md):
this probe splits a loss step (forward + backward, the benchmark's step) into its kernels with ``torch.profiler``,
times each kernel alone with CUDA events (``triton.testing.do_bench``, median, inputs far larger than L2) against
the bytes it must move, and sweeps the Triton kernels' launch configurations, every variant checked against the
shipped one (bit-equal sums for the aggregate, 1e-6 for the losses) and the shipped one against float64.

Bytes each kernel must move (fp32, R rows of C classes, n client rows of P parameters):
  distill forward   R*C*(4 + 4 + 4) + 12R     read z, t; write dL/dz
  scale (backward)  R*C*(4 + 4) + 4R          read dL/dz, write grad_output * dL/dz
  aggregate         n*P*4 + P*(4 + 4 + 4)     read the n rows and g; write the global and the average

    python benchmarks/gpu_probe.py --out $OUT/<gpu>-probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _bench(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3  # seconds


def copy_gbps() -> float:
    x = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / _bench(lambda: y.copy_(x)) / 1e9


def kernel_table(fn, steps=5, top=8):
    """[(kernel name, device seconds per step, share)] of ``fn``'s kernels, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if t > 0 and e.device_type.name == "CUDA":
            rows[e.key] = rows.get(e.key, 0.0) + t * 1e-6 / steps
    total = sum(rows.values()) or 1.0
    out = sorted(rows.items(), key=lambda kv: -kv[1])[:top]
    return [(k[:90], v, v / total) for k, v in out], total


def loss_inputs(R, C, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(R, C, device="cuda", generator=g) * 2
    t = torch.randn(R, C, device="cuda", generator=g) * 2
    y = torch.randint(0, C, (R,), device="cuda", generator=g)
    return z, t, y


LOSS_KW = {"kd": dict(kind="full", tau=4.0, kd_weight=16.0), "ntd": dict(kind="not_true", tau=1.0, kd_weight=1.0)}


def probe_losses(res, echo, shapes):
    from fedfast import ops
    from fedfast.ops import _backend
    from fedfast.ops.distill import DistillRowsArgs, _backend_rows
    from fedfast.triton import distill as tdist

    backends = [b for b in ("triton", "cuda") if _backend.available(b, "cuda")]
    for R, C in shapes:
        z, t, y = loss_inputs(R, C)
        seg = torch.arange(R, device="cuda") // 50
        fwd_bytes, bwd_bytes = R * C * 12 + 12 * R, R * C * 8 + 4 * R
        for name, kw in LOSS_KW.items():
            nt = kw["kind"] == "not_true"
            # the shipped Triton forward against float64 on 512 rows
            ref = ops.distill_reference(
                z[:512].double(), t[:512].double(), y[:512], tau=kw["tau"], kd_weight=kw["kd_weight"], not_true=nt
            )
            for be in backends:

                def step():
                    zz = z.detach().requires_grad_(True)
                    loss = ops.distill(zz, t, y, segments=seg, backend=be, validate="off", **kw)
                    loss.backward()
                    return loss

                table, dev_total = kernel_table(step)
                whole = _bench(step)
                args = DistillRowsArgs(
                    student=z, teacher=t, target=y, tau=kw["tau"], kd_weight=kw["kd_weight"], not_true=nt
                )
                l1, g1 = _backend_rows(be, args)
                fwd = _bench(lambda: _backend_rows(be, args))
                err = float((l1[:512].double() - ref).abs().max() / ref.abs().max())
                sc = torch.rand(R, device="cuda")
                if be == "triton":
                    bwd = _bench(lambda: tdist.scale_rows_triton(g1, sc))
                else:
                    bwd = _bench(lambda: _backend.cuda_ext().scale_rows(g1, sc))
                mul = _bench(lambda: g1 * sc[:, None])
                row = dict(
                    loss=name,
                    R=R,
                    C=C,
                    backend=be,
                    step_s=whole,
                    step_device_s=dev_total,
                    step_gbps=(fwd_bytes + bwd_bytes) / whole / 1e9,
                    fwd_s=fwd,
                    fwd_gbps=fwd_bytes / fwd / 1e9,
                    scale_s=bwd,
                    scale_gbps=bwd_bytes / bwd / 1e9,
                    torch_mul_s=mul,
                    fwd_rel_err_vs_float64=err,
                    kernels=table,
                )
                res["losses"].append(row)
                echo(
                    f"{name} {R}x{C} {be}: step {whole * 1e3:.3f} ms ({row['step_gbps']:.0f} GB/s; device "
                    f"{dev_total * 1e3:.3f} ms), forward {fwd * 1e3:.3f} ms ({row['fwd_gbps']:.0f} GB/s), scale "
                    f"{bwd * 1e3:.3f} ms ({row['scale_gbps']:.0f} GB/s; torch mul {mul * 1e3:.3f}), err {err:.1e}"
                )
                for k, v, s in table[:5]:
                    echo(f"    {v * 1e3:8.3f} ms {100 * s:5.1f} %  {k}")
            # the Triton forward's launch configurations (KD only: NTD's kernel differs by masks)
            if "triton" not in backends or name != "kd":
                continue
            base = tdist.launch_config(C)
            args = (
                z,
                t,
                y,
                None,
                None,
                None,
                None,
                None,
                1.0,
                None,
                None,
                None,
                kw["tau"],
                1.0,
                kw["kd_weight"],
                -100,
                nt,
                False,
                False,
            )
            l0, g0, _ = tdist.distill_rows_triton(*args)
            bc = triton_next_pow2(C)
            cands = {(base[0], base[1], base[3])}
            for br in (1, 2, 4, 8, 16, 32, 64):
                for bcc in sorted({min(bc, 2048), min(bc, 4096), min(bc, 8192)} if bc > 1024 else {bc}):
                    if br * bcc > 8192 or (bc > 1024 and br > 2):
                        continue
                    for nw in (4, 8, 16):
                        if 4 <= br * bcc / (32 * nw) <= 16:
                            cands.add((br, bcc, nw))
            sweep = []
            for cfg in sorted(cands):
                try:
                    l1, g1, _ = tdist.distill_rows_triton(*args, config=cfg)
                    ok = bool(
                        torch.allclose(l1, l0, rtol=1e-5, atol=1e-6) and torch.allclose(g1, g0, rtol=1e-5, atol=1e-7)
                    )
                    s = _bench(lambda: tdist.distill_rows_triton(*args, config=cfg))
                except Exception as e:  # a config the compiler refuses (shared memory, registers)
                    sweep.append(dict(config=cfg, error=str(e)[:200]))
                    continue
                sweep.append(dict(config=cfg, seconds=s, gbps=fwd_bytes / s / 1e9, matches=ok))
            sweep.sort(key=lambda r: r.get("seconds", 1e9))
            res["distill_sweep"].append(dict(loss=name, R=R, C=C, shipped=[base[0], base[1], base[3]], results=sweep))
            shipped = next((r for r in sweep if r["config"] == (base[0], base[1], base[3])), None)
            echo(
                f"  triton forward sweep {name} {R}x{C}: shipped {base[0], base[1], base[3]} "
                f"{shipped and shipped.get('gbps', 0):.0f} GB/s; best "
                + ", ".join(
                    f"{r['config']} {r['gbps']:.0f}{'' if r['matches'] else ' MISMATCH'}"
                    for r in sweep[:4]
                    if "gbps" in r
                )
            )


def triton_next_pow2(n):
    import triton

    return triton.next_power_of_2(n)


def probe_aggregate(res, echo, P=1_663_370, Ns=(100, 1000)):
    from fedfast import ops
    from fedfast.ops import _backend
    from fedfast.ops.aggregate_reference import aggregate_reference
    from fedfast.triton import aggregate as tagg

    for N in Ns:
        X = torch.randn(N, P, device="cuda")
        g = torch.randn(P, device="cuda")
        w = torch.rand(N, device="cuda")
        rows = torch.arange(N, device="cuda")
        nbytes = N * P * 4 + P * 12
        wn = w / w.sum()
        out = dict(N=N, P=P)
        out["w_at_X_s"] = _bench(lambda: wn @ X)  # noqa: F821 (deleted after use)
        ref = aggregate_reference(X[:, :4096].double().cpu(), g[:4096].double().cpu(), wn.double().cpu())["global"]
        for be in ("triton", "cuda"):
            if not _backend.available(be, "cuda"):
                continue
            fn = lambda: ops.aggregate(X, g, weights=w, rows=rows, backend=be)  # noqa: E731, F821 (deleted after use)
            got = fn()["global"]
            out[f"{be}_s"] = _bench(fn)
            out[f"{be}_rel_err"] = float((got[:4096].double().cpu() - ref).abs().max() / ref.abs().max())
            out[f"{be}_kernels"] = kernel_table(fn)[0]
        args = (X, rows, g, wn, 0.0, 1.0, 1.0, None, None, None, None, None, 0, 0)
        g0 = tagg.aggregate_triton(*args)[0]
        sweep = []
        for block in (1024, 2048, 4096):
            for unroll in (1, 2, 4, 8):
                for nw in (4, 8):
                    cfg = (block, unroll, nw)
                    try:
                        same = bool(torch.equal(tagg.aggregate_triton(*args, config=cfg)[0], g0))
                        s = _bench(lambda: tagg.aggregate_triton(*args, config=cfg))
                    except Exception as e:
                        sweep.append(dict(config=cfg, error=str(e)[:200]))
                        continue
                    sweep.append(dict(config=cfg, seconds=s, gbps=nbytes / s / 1e9, same_bits=same))
        sweep.sort(key=lambda r: r.get("seconds", 1e9))
        out["triton_sweep"] = sweep
        res["aggregate"].append(out)
        gb = lambda s: nbytes / s / 1e9  # noqa: E731
        echo(
            f"aggregate N={N}: w@X {out['w_at_X_s'] * 1e3:.3f} ms ({gb(out['w_at_X_s']):.0f} GB/s), triton "
            f"{out.get('triton_s', 0) * 1e3:.3f} ms, cuda {out.get('cuda_s', 0) * 1e3:.3f} ms; sweep best "
            + ", ".join(
                f"{r['config']} {r['gbps']:.0f}{'' if r['same_bits'] else ' DIFFERS'}" for r in sweep[:4] if "gbps" in r
            )
        )
        for be in ("triton", "cuda"):
            for k, v, s in out.get(f"{be}_kernels", [])[:4]:
                echo(f"    {be} {v * 1e3:8.3f} ms {100 * s:5.1f} %  {k}")
        del X


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="65536,1000;65536,100;8192,32000")
    ap.add_argument("--skip", default="", help="comma list: losses, aggregate")
    a = ap.parse_args(argv)
    from bench_rounds import machine

    res = dict(
        machine=machine(torch.device("cuda")),
        copy_gbps=copy_gbps(),
        losses=[],
        distill_sweep=[],
        aggregate=[],
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
    )

    def echo(s):
        print(s, flush=True)

    def save():
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1, default=str)
        os.replace(tmp, a.out)

    echo(f"copy bandwidth {res['copy_gbps']:.0f} GB/s")
    shapes = [tuple(int(v) for v in s.split(",")) for s in a.shapes.split(";")]
    if "losses" not in a.skip:
        probe_losses(res, echo, shapes)
        save()
    if "aggregate" not in a.skip:
        probe_aggregate(res, echo)
    save()


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
