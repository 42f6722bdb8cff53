"""fedfast.nn.LinearKDLoss against Liger-Kernel's chunked distillation loss (``LigerFusedLinearJSDLoss``, its
PyTorch chunk loop: the Triton kernels need a GPU) and against F.linear + the loss, side by side: forward + backward
time and peak memory, the teacher given as hidden states + head, both at Liger's defaults where they are options.

Cases (each in its own process, one warm-up call, then ``--reps`` timed ones; the first timed one also gives the peak
growth of the resident set over the inputs, Linux ``VmHWM``):

* ``fedfast``          LinearKDLoss, the papers' forward KL (``jsd_beta=0``): the fused kernels in the chunks
* ``fedfast_options``  LinearKDLoss with ``jsd_beta`` and ``return_terms=True``: the closed-form PyTorch rows in
                       the chunks (at beta 0 too)
* ``liger``            LigerFusedLinearJSDLoss(compiled=False), chunk_size 1024 (its default)
* ``liger_compiled``   the same with compiled=True (its default; torch.compile of the chunk step: inductor on CPU)
* ``unfused``          F.linear for both models, then fedfast.nn.KDLoss (``jsd_beta=0``) or its options' form
* ``torch``            F.linear, then F.cross_entropy and the divergence in PyTorch ops (a user's code:
                       ``fedfast.ops.distill_options.divergence_reference``)

Every case computes the same loss: ``ce_weight * CE + kd_weight * D_beta`` with Liger's weights (0.5, 0.5), tau 1,
no tau^2, mean over the rows; the script checks the values agree before it writes.

    python benchmarks/liger_compare.py --out benchmarks/results/cpu-2core-amd-epyc-liger.json
    python benchmarks/liger_compare.py --shapes 256,256,4096 --reps 2       # a quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import fedfast.nn as fnn
from fedfast.bench import _proc_status_bytes, _write, machine
from fedfast.ops.distill_options import divergence_reference

CASES = ("fedfast", "fedfast_options", "liger", "liger_compiled", "unfused", "torch")
W_HARD = W_SOFT = 0.5


def _inputs(R, H, V):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(R, H, generator=g) * H**-0.5
    W = torch.randn(V, H, generator=g) * 2
    th = torch.randn(R, H, generator=g) * H**-0.5
    tW = torch.randn(V, H, generator=g) * 2
    y = torch.randint(0, V, (R,), generator=g)
    return h, W, th, tW, y


def _loss(case: str, beta: float):
    if case == "fedfast":
        m = fnn.LinearKDLoss(tau=1.0, ce_weight=W_HARD, kd_weight=W_SOFT, tau_squared=False)
        return lambda h, W, th, tW, y: m(h, W, y, teacher_hidden=th, teacher_weight=tW)
    if case == "fedfast_options":  # return_terms: the options' rows at beta 0 too
        m = fnn.LinearKDLoss(
            tau=1.0, ce_weight=W_HARD, kd_weight=W_SOFT, tau_squared=False, jsd_beta=beta, return_terms=True
        )
        return lambda h, W, th, tW, y: m(h, W, y, teacher_hidden=th, teacher_weight=tW).loss
    if case in ("liger", "liger_compiled"):
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        m = LigerFusedLinearJSDLoss(
            weight_hard_loss=W_HARD, weight_soft_loss=W_SOFT, beta=beta, temperature=1.0, compiled=case.endswith("d")
        )
        return lambda h, W, th, tW, y: m(h, W, th, tW, y)
    if case == "unfused":
        m = fnn.KDLoss(tau=1.0, ce_weight=W_HARD, kd_weight=W_SOFT, tau_squared=False, jsd_beta=beta)

        def f(h, W, th, tW, y):
            with torch.no_grad():
                t = F.linear(th, tW)
            return m(F.linear(h, W), t, y)

        return f
    if case == "torch":

        def f(h, W, th, tW, y):
            z = F.linear(h, W)
            with torch.no_grad():
                t = F.linear(th, tW)
            return (
                W_HARD * F.cross_entropy(z, y)
                + W_SOFT * divergence_reference(F.log_softmax(t, -1), F.log_softmax(z, -1), beta).mean()
            )

        return f
    raise ValueError(f"case: one of {CASES}, got {case!r}")


def run_case(case: str, R: int, H: int, V: int, beta: float, reps: int) -> dict:
    """In this process (a fresh one): warm-up, then ``reps`` timed forward + backward calls."""
    fn = _loss(case, beta)
    h, W, th, tW, y = _inputs(R, H, V)
    h.requires_grad_(True)
    W.requires_grad_(True)

    def step():
        h.grad = W.grad = None
        gc.collect()
        t0 = time.perf_counter()
        loss = fn(h, W, th, tW, y)
        loss.backward()
        return time.perf_counter() - t0, float(loss.detach())

    step()
    h.grad = W.grad = None
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _proc_status_bytes("VmRSS")
    t, value = step()
    peak = _proc_status_bytes("VmHWM") - base
    times = [t] + [step()[0] for _ in range(reps - 1)]
    return dict(seconds=times, peak_bytes=max(0, peak), outputs_bytes=(R * H + V * H) * 4, loss=value)


def _in_child(case, R, H, V, beta, reps) -> dict:
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_case", case, str(R), str(H), str(V), str(beta), str(reps)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if r.returncode != 0:
        return dict(error=f"exit {r.returncode}: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1024,1024,32000", help="R,H,V;R,H,V")
    ap.add_argument("--betas", default="0,0.5", help="jsd_beta values (Liger's beta)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--_case", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._case:
        c, R, H, V, beta, reps = a._case
        print(json.dumps(run_case(c, int(R), int(H), int(V), float(beta), int(reps))))
        return 0
    res = dict(
        benchmark="linear-kd-vs-liger",
        machine=machine("cpu"),
        command="python benchmarks/liger_compare.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        liger_kernel=_liger_version(),
        rows=[],
    )
    for spec in a.shapes.split(";"):
        R, H, V = (int(x) for x in spec.split(","))
        for beta in (float(b) for b in a.betas.split(",")):
            row = dict(R=R, H=H, V=V, beta=beta, logits_bytes=R * V * 4, cases={})
            for case in a.cases.split(","):
                if case == "fedfast" and beta != 0:
                    continue  # the fused kernels compute the papers' forward KL only
                c = _in_child(case, R, H, V, beta, a.reps)
                if "seconds" in c:
                    c["median_s"] = statistics.median(c["seconds"])
                    c["peak_logits"] = c["peak_bytes"] / row["logits_bytes"]
                    c["beyond_outputs_logits"] = (c["peak_bytes"] - c["outputs_bytes"]) / row["logits_bytes"]
                row["cases"][case] = c
                print(
                    f"{R} x {H} x {V} beta {beta}: {case}: "
                    + (
                        f"{c['median_s']:.2f} s, peak {c['peak_logits']:.2f} logits, loss {c['loss']:.6f}"
                        if "seconds" in c
                        else c["error"]
                    ),
                    flush=True,
                )
            losses = [c["loss"] for c in row["cases"].values() if "loss" in c]
            if losses and max(losses) - min(losses) > 1e-4 * max(1.0, abs(losses[0])):
                raise SystemExit(f"the cases disagree on the loss at {R} x {H} x {V}, beta {beta}: {losses}")
            res["rows"].append(row)
            if a.out:
                _write(a.out, res)
    return 0


def _liger_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
