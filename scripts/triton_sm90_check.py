"""Compile every fedfast Triton kernel for a real GPU target on a machine without a GPU.

The tests run the Triton kernels in the interpreter (``TRITON_INTERPRET=1``), which never lowers them
through TTGIR/LLVM/ptxas: layout, type and resource errors show only on a GPU. This script installs a
stand-in Triton driver that reports a CUDA target (default sm_90, H100/H200), calls the real launch
wrappers with small CPU tensors over the flag combinations the ops use, and lets Triton compile each
specialization to a cubin *without launching it*. For each kernel it reports registers, spill stores/loads
(``ptxas -v``) and shared memory.

Usage: ``python scripts/triton_sm90_check.py [--arch 90] [--json OUT]`` (TRITON_INTERPRET must be unset).
Exit status 1 when a kernel fails to compile, or spills while ``--no-spills`` is given.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("triton_sm90_check: unset TRITON_INTERPRET (the interpreter never compiles)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _CompileOnlyDriver:
    """Just enough of Triton's driver interface for JITFunction.run(warmup=True) to pick a target."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


RECORDS: list[dict] = []
_ORIG_RUN = JITFunction.run
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _ptxas(arch: int) -> str:
    """Triton's bundled ptxas (sm_100+ use the separately bundled Blackwell build when present)."""
    bw = os.path.join(_BIN, "ptxas-blackwell")
    return bw if arch >= 100 and os.path.exists(bw) else os.path.join(_BIN, "ptxas")


def _ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers / spills / shared memory from ``ptxas -v`` on the PTX Triton produced."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run(
            [
                _ptxas(arch),
                "-v",
                f"--gpu-name=sm_{arch}a" if arch >= 90 else f"--gpu-name=sm_{arch}",
                src,
                "-o",
                os.path.join(d, "k.cubin"),
            ],
            capture_output=True,
            text=True,
        )
    out = res.stderr + res.stdout
    if res.returncode != 0 or "Used" not in out:
        raise RuntimeError(f"ptxas -v did not report resource usage: {out[-500:]}")
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, out)) else 0  # noqa: E731
    return {
        "registers": num(r"Used (\d+) registers"),
        "spill_stores": num(r"(\d+) bytes spill stores"),
        "spill_loads": num(r"(\d+) bytes spill loads"),
        "stack": num(r"(\d+) bytes stack frame"),
        "smem": num(r"(\d+) bytes smem"),
    }


def _matrix_path(ptx: str) -> str:
    """Which units a kernel's products use, from its PTX: ``wgmma`` (Hopper's warpgroup tensor-core MMA),
    ``mma`` (the warp-level tensor-core MMA of earlier GPUs), ``fma`` (fp32 FMAs only) or ``-`` (neither)."""
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if re.search(r"\bmma\.sync", ptx):
        return "mma"
    return "fma" if "fma.rn.f32" in ptx else "-"


def _make_run(arch: int, label: list):
    def run(self, *args, grid, warmup, **kwargs):
        t0 = time.perf_counter()
        rec = {
            "kernel": self.__name__,
            "case": label[0],
            "constexprs": {k: v for k, v in kwargs.items() if k.isupper()},
            "num_warps": kwargs.get("num_warps"),
        }
        try:
            k = _ORIG_RUN(self, *args, grid=grid, warmup=True, **kwargs)
            usage = _ptxas_usage(k.asm["ptx"], arch)
        except Exception as e:  # noqa: BLE001 -- reported, and the exit status says it
            rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            RECORDS.append(rec)
            return None
        usage["smem"] = max(usage["smem"], int(getattr(k.metadata, "shared", 0) or 0))  # Triton's is dynamic
        rec.update(ok=True, seconds=round(time.perf_counter() - t0, 3), matrix=_matrix_path(k.asm["ptx"]), **usage)
        RECORDS.append(rec)
        return k

    return run


def _cases():
    """(label, thunk) pairs over the launch wrappers' flag combinations."""
    from fedfast.triton.aggregate import aggregate_triton
    from fedfast.triton.asd_weights import asd_weights_triton
    from fedfast.triton.client_adam import client_adam_triton
    from fedfast.triton.client_step import client_step_triton
    from fedfast.triton.conv import conv_forward, conv_input_grad, conv_weight_grad
    from fedfast.triton.distill import distill_rows_triton, scale_rows_triton
    from fedfast.triton.teacher_mixture import teacher_mixture_triton

    R = 7

    def distill(
        C, dt=torch.float32, nt=False, soft=False, prob=False, alpha=False, rw=False, rho=False, seg=False, rs=False
    ):
        z = torch.randn(R, C).to(dt)
        t = torch.softmax(torch.randn(R, C), 1) if prob else torch.randn(R, C).to(dt)
        y = torch.randint(0, C, (R,))
        S = 3 if (rho or seg) else 1
        segs = torch.randint(0, S, (R,)) if (rho or seg) else None
        return lambda: distill_rows_triton(
            z,
            t,
            y,
            torch.zeros(R) if prob else None,
            None,
            torch.rand(C) if alpha else None,
            torch.rand(R) if rw else None,
            None,
            1.0,
            torch.rand(S, C) * 0.5 if rho else None,
            segs,
            torch.rand(R) if rs else None,
            2.0,
            1.0,
            1.0,
            -100,
            nt,
            soft,
            False,
        )

    for C in (2, 10, 100, 1000, 4096, 5000):
        for nt in (False, True):
            yield f"distill C={C} not_true={nt}", distill(C, nt=nt)
    flags = ("alpha", "rw", "rho", "seg", "rs")
    for C in (10, 100, 1000, 5000):
        for f in flags:
            yield f"distill C={C} {f}", distill(C, **{f: True})
        yield f"distill C={C} prob soft_ce", distill(C, prob=True, soft=True)
        yield f"distill C={C} all", distill(C, nt=False, **{f: True for f in flags})
        yield f"distill C={C} not_true all", distill(C, nt=True, **{f: True for f in flags})
    for dt in (torch.bfloat16, torch.float16):
        for C in (10, 1000):
            yield f"distill C={C} {dt}", distill(C, dt=dt, nt=True)
        yield f"scale_rows {dt}", lambda dt=dt: scale_rows_triton(torch.randn(R, 10).to(dt), torch.rand(R))
    yield "scale_rows fp32", lambda: scale_rows_triton(torch.randn(R, 10), torch.rand(R))
    from fedfast.triton.update_norms import update_norms_triton

    for dt in (torch.float32, torch.bfloat16):
        yield (
            f"update_norms {dt}",
            lambda dt=dt: update_norms_triton(
                torch.randn(4, 50000).to(dt), torch.tensor([0, 2, 3]), torch.randn(50000)
            ),
        )
    from fedfast.triton.row_scale import row_scale_triton

    for mode, seg, check, it in itertools.product((0, 1, 2), (False, True), (False, True), (torch.int64, torch.int32)):
        if mode == 0 and not check:
            continue  # nothing to launch
        yield (
            f"row_scale mode={mode} seg={seg} check={check} {it}",
            lambda mode=mode, seg=seg, check=check, it=it: row_scale_triton(
                torch.randint(0, 10, (R,)).to(it),
                torch.arange(R).to(it) if seg else None,
                10,
                -100,
                mode,
                R,
                torch.zeros(6, dtype=torch.int32) if check else None,
            ),
        )

    for C, seg, dt in itertools.product((10, 5000), (False, True), (torch.float32, torch.bfloat16)):
        yield (
            f"asd C={C} seg={seg} {dt}",
            lambda C=C, seg=seg, dt=dt: asd_weights_triton(
                torch.randn(R, C).to(dt),
                torch.randint(0, C, (R,)),
                torch.rand(3 if seg else 1, C) + 0.1,
                torch.randint(0, 3, (R,)) if seg else None,
                1.0,
                -100,
            ),
        )
    for C, nt, dt in itertools.product((10, 5000), (False, True), (torch.float32, torch.bfloat16)):
        yield (
            f"mixture C={C} not_true={nt} {dt}",
            lambda C=C, nt=nt, dt=dt: teacher_mixture_triton(
                torch.randn(3, R, C).to(dt), torch.rand(3), torch.randint(0, C, (R,)), 2.0, nt, -100
            ),
        )

    n, P, N = 3, 3000, 5

    def agg(dt=torch.float32, mom=False, beta=0.0, state=False, shift=False, ring=False):
        X = torch.randn(N, P).to(dt)
        rows = torch.tensor([0, 2, 4])
        return lambda: aggregate_triton(
            X,
            rows,
            torch.randn(P),
            torch.rand(n),
            beta,
            1.0,
            1.0,
            torch.randn(P) if mom else None,
            torch.randn(n, P) if state else None,
            torch.rand(n) if state else None,
            torch.randn(P) if (state and shift) else None,
            torch.randn(4, P) if ring else None,
            1,
            2,
        )

    yield "aggregate plain", agg()
    yield "aggregate bf16 clients", agg(dt=torch.bfloat16)
    yield "aggregate momentum", agg(mom=True, beta=0.9)
    yield "aggregate first momentum", agg(beta=0.9)
    yield "aggregate state rows", agg(state=True)
    yield "aggregate state rows shifted", agg(state=True, shift=True)
    yield "aggregate ring", agg(ring=True)
    yield "aggregate all", agg(mom=True, beta=0.9, state=True, shift=True, ring=True)

    def step(
        grad_dt=torch.float32,
        mom=False,
        prox=False,
        lrows=False,
        clip=False,
        cvec=False,
        cscale=False,
        crows=False,
        svec=False,
        sscale=False,
        act=False,
        rowlr=False,
        dnorm=False,
    ):
        theta = torch.randn(n, P)
        return lambda: client_step_triton(
            theta,
            torch.randn(n, P).to(grad_dt),
            torch.rand(n) if rowlr else torch.tensor([0.1]),
            0.9 if mom else 0.0,
            torch.zeros(n, P) if mom else None,
            torch.tensor([1e-4]),
            0.1 if prox else 0.0,
            torch.randn(P) if prox else None,
            torch.randn(n, P) if lrows else None,
            torch.randn(P) if cvec else None,
            torch.rand(n) if (cvec and cscale) else None,
            torch.randn(n, P) if crows else None,
            -1.0,
            torch.randn(P) if svec else None,
            torch.rand(n) if (svec and sscale) else None,
            10.0 if clip else 0.0,
            torch.tensor([True, True, False]) if act else None,
            **delta(dnorm),
        )

    def step_pieces(**kw):  # the engine's path on GPUs: autograd's per-parameter gradients through a block table
        theta = torch.randn(n, P)
        pieces = [torch.randn(n, 1000), torch.randn(n, 7), torch.randn(n, P - 1007)]
        return lambda: client_step_triton(
            theta,
            pieces,
            torch.tensor([0.1]),
            0.9 if kw.get("mom") else 0.0,
            torch.zeros(n, P) if kw.get("mom") else None,
            torch.tensor([1e-4]),
            0.0,
            None,
            None,
            None,
            None,
            None,
            1.0,
            None,
            None,
            10.0 if kw.get("clip") else 0.0,
            None,
            **delta(kw.get("delta")),
        )

    def delta(on):  # a private run's last step: the update norms in the step's pass
        return dict(delta_from=torch.randn(P), delta_norm=torch.zeros(n)) if on else {}

    yield "client_step pieces", step_pieces()
    yield "client_step pieces delta", step_pieces(delta=True)
    yield "client_step pieces momentum delta", step_pieces(mom=True, delta=True)
    yield "client_step pieces momentum clip", step_pieces(mom=True, clip=True)
    yield "client_step plain", step()
    yield "client_step bf16 grad", step(grad_dt=torch.bfloat16)
    for f in ("mom", "prox", "lrows", "clip", "cvec", "crows", "svec", "act", "rowlr"):
        yield f"client_step {f}", step(**{f: True})
    yield "client_step cvec crows", step(cvec=True, crows=True)
    yield "client_step cvec_scale", step(cvec=True, cscale=True)
    yield "client_step svec_scale", step(svec=True, sscale=True)
    yield "client_step clip prox lrows", step(clip=True, prox=True, lrows=True)
    yield (
        "client_step all",
        step(
            mom=True,
            prox=True,
            lrows=True,
            clip=True,
            cvec=True,
            cscale=True,
            crows=True,
            svec=True,
            sscale=True,
            act=True,
            rowlr=True,
        ),
    )

    def adam(decoupled=False, prox=False, lrows=False, clip=False, act=False, rowwd=False, beta1=0.9, dnorm=False):
        return lambda: client_adam_triton(
            torch.randn(n, P),
            [torch.randn(n, P)],
            torch.zeros(n, P),
            torch.zeros(n, P),
            torch.ones(n),
            torch.rand(n),
            beta1,
            0.999,
            1e-8,
            torch.rand(n) if rowwd else torch.tensor([1e-2]),
            decoupled,
            0.1 if prox else 0.0,
            torch.randn(P) if prox else None,
            torch.randn(n, P) if lrows else None,
            10.0 if clip else 0.0,
            torch.tensor([True, True, False]) if act else None,
            **delta(dnorm),
        )

    # per-client convolutions (implicit GEMM): the benchmark models' layer geometries, fp32 and TF32
    def conv(n, B, Cin, Cout, H, k, st, pad, bias, tf32, cl):
        x = torch.randn(B, n * Cin, H, H)
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        w = torch.randn(n, Cout, Cin, k, k)
        OH = (H + 2 * pad - k) // st + 1
        g = torch.randn(B, n * Cout, OH, OH)
        b = torch.randn(n, Cout) if bias else None

        def run():
            conv_forward(x, w, b, (st, st), (pad, pad), (1, 1), torch.empty_like(g), tf32)
            conv_input_grad(g, w, (st, st), (pad, pad), (1, 1), torch.empty_like(x), tf32)
            conv_weight_grad(g, x, (st, st), (pad, pad), (1, 1), torch.empty_like(w), tf32)

        return run

    for tf32 in (False, True):
        yield f"conv simple_cnn conv1 tf32={tf32}", conv(2, 2, 3, 32, 32, 3, 1, 0, True, tf32, True)
        yield f"conv simple_cnn conv2 tf32={tf32}", conv(2, 2, 32, 64, 30, 3, 1, 0, True, tf32, True)
        yield f"conv fedavg_cnn 5x5 tf32={tf32}", conv(2, 2, 32, 64, 14, 5, 1, 2, True, tf32, False)
        yield f"conv resnet stride 2 tf32={tf32}", conv(2, 2, 16, 32, 32, 3, 2, 1, False, tf32, True)
        yield f"conv resnet 1x1 shortcut tf32={tf32}", conv(2, 2, 16, 32, 32, 1, 2, 0, False, tf32, True)

    def conv64():  # 64-bit index math (offsets past 2**31): strides of a huge tensor on a tiny stand-in
        from fedfast.triton import conv as tc

        orig = tc._idx64
        tc._idx64 = lambda *ts: True
        try:
            conv(2, 2, 32, 64, 30, 3, 1, 0, True, True, True)()
            conv(2, 2, 3, 32, 32, 3, 1, 0, True, False, True)()
        finally:
            tc._idx64 = orig

    yield "conv 64-bit indices", conv64

    yield "client_adam plain", adam()
    yield "client_adamw", adam(decoupled=True)
    yield "client_adam lerp high", adam(beta1=0.3)
    for f in ("prox", "lrows", "clip", "act", "rowwd"):
        yield f"client_adam {f}", adam(**{f: True})
    yield "client_adamw all", adam(decoupled=True, prox=True, lrows=True, clip=True, act=True, rowwd=True)
    yield "client_adam delta", adam(dnorm=True)
    yield "client_step delta act", step(act=True, dnorm=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200, 80: A100)")
    ap.add_argument("--json", help="write the per-specialization records here")
    ap.add_argument("--no-spills", action="store_true", help="fail when any kernel spills registers")
    ap.add_argument("-k", default="", help="only cases whose label contains this")
    a = ap.parse_args(argv)
    driver.set_active(_CompileOnlyDriver(a.arch))
    label = [""]
    JITFunction.run = _make_run(a.arch, label)
    t0 = time.perf_counter()
    try:
        for name, thunk in _cases():
            if a.k not in name:
                continue
            label[0] = name
            thunk()
    finally:
        JITFunction.run = _ORIG_RUN  # the stand-in driver stays: this machine has no real one to go back to
    bad = [r for r in RECORDS if not r["ok"]]
    spills = [r for r in RECORDS if r["ok"] and (r["spill_stores"] or r["spill_loads"])]
    for r in RECORDS:
        if r["ok"]:
            print(
                f"ok   sm_{a.arch} {r['kernel']:<20} {r['case']:<40} regs={r['registers']:<4} "
                f"spill={r['spill_stores']}/{r['spill_loads']}B smem={r['smem']}B warps={r['num_warps']} "
                f"{r['matrix']:<5} "
                f"{r['seconds']:.2f}s"
            )
        else:
            print(f"FAIL sm_{a.arch} {r['kernel']:<20} {r['case']:<40} {r['error']}")
    print(
        f"{len(RECORDS)} specializations, {len(bad)} failed, {len(spills)} spilling, "
        f"{time.perf_counter() - t0:.1f}s; triton {triton.__version__}"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"arch": a.arch, "triton": triton.__version__, "torch": torch.__version__, "records": RECORDS},
                f,
                indent=1,
            )
    return 1 if bad or (a.no_spills and spills) else 0


if __name__ == "__main__":
    sys.exit(main())
