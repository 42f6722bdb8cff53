"""``fedfast bench``: the fused losses against the loss code their users have, on this machine.

The baselines are the losses as their authors wrote them, written out here (eager PyTorch, and the same under
``torch.compile``); fedfast's own float64 reference is a correctness oracle, not a speed baseline:

* ``ntd``: FedNTD's ``NTD_Loss`` (Lee-Gihun/FedNTD, ``algorithms/fedntd/criterion.py``): ``refine_as_not_true``
  gathers the C-1 not-true logits through an ``arange().repeat()`` index and a boolean mask, then
  ``CE + beta * KLDivLoss(batchmean)(log_softmax(nt_z / tau), softmax(nt_t / tau))``, the form of the paper and of
  the repository's commit 043269e (its HEAD multiplies the KL by tau^2: one scalar, no change in time). fedfast:
  ``NTDLoss(tau, beta, tau_squared=False)``.
* ``kd``: RepDistiller's ``DistillKL`` (``kl_div(log_softmax(z/T), softmax(t/T), size_average=False) * T^2 / B``)
  plus cross-entropy. fedfast: ``KDLoss(tau=T)``.
* ``gkd``: plain FedGKD (one teacher, the averaged past global models), its code's loss line:
  ``CE + distillation_coefficient * T^2 * kl_div(log_softmax(z/T), softmax(t/T), batchmean)`` with
  ``distillation_coefficient = gamma / 2``. fedfast: ``GKDLoss(tau=T, gamma)``.
* ``gkd_vote3``: FedGKD-VOTE's loss lines: CE plus ``gamma/2 * sum_m w_m KL(softmax(t_m/T) || softmax(z/T))`` over 3
  teachers, one ``kl_div`` per teacher. fedfast: ``GKDLoss(tau=T, gamma, tau_squared=False)`` with
  ``teacher_weights``.
* ``asd``: ASD's loss lines (FedAvg+ASD): the teacher-entropy weights ``exp(-H(softmax(t))) / prior[y]``,
  normalised over the batch, and ``CE + lam * sum_i w_i KL_i`` at ``tau``. fedfast: ``ASDLoss(tau, lam)``.

Each (loss, shape, implementation) is timed forward + backward (median of repeated calls after warm-up) at the
process's thread count. Peak memory: each case again in a fresh process, after one call on other inputs of the
same shape: the growth of the peak resident set over what the process holds with its inputs (Linux ``VmHWM``,
reset before the call), so neither compilation nor earlier cases count.

    fedfast bench                       # every shape, eager and compiled baselines, memory; minutes
    fedfast bench --quick               # the four small shapes, eager baselines, no memory; under a minute
    fedfast bench --out bench.json      # the JSON docs/benchmarks.md's table is generated from
    fedfast bench --device cuda         # on a GPU: synchronised timing, the allocator's peak device memory

Shapes (rows R x classes C): 64 x 10, 500 x 10, 128 x 100, 8192 x 100 (federated minibatches), 4096 x 32,000 and
1024 x 128,000 (language-model distillation).

The output layer fused in (``fedfast.nn.LinearKDLoss``), at rows R x hidden H x vocabulary V = 4096 x 1024 x
32,000 and 4096 x 4096 x 128,000 (``--quick``: 512 x 256 x 8,000), the teacher given as logits: against the
unfused pair a user writes, ``F.linear`` + ``KDLoss``, and against ``F.linear`` + RepDistiller's loss lines (the
``kd`` baseline above). Each in its own process: one call to warm up, then timed calls (the first also measures
the peak resident growth over the inputs); reported beyond the outputs too (the gradients of the hidden states and
the weight, which every implementation returns).

    fedfast bench --linear-only           # the LinearKDLoss comparison alone (about 15 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from . import nn as fnn
from ._io import write_atomic
from ._version import __version__

SHAPES = [(64, 10), (500, 10), (128, 100), (8192, 100), (4096, 32000), (1024, 128000)]
QUICK_SHAPES = SHAPES[:4]
LOSSES = ("ntd", "kd", "gkd", "gkd_vote3", "asd")
TAU = {"ntd": 3.0, "kd": 4.0, "gkd": 1.0, "gkd_vote3": 1.0, "asd": 2.0}
BETA, GAMMA, LAM = 1.0, 0.2, 10.0
LINEAR_SHAPES = [(4096, 1024, 32000), (4096, 4096, 128000)]
QUICK_LINEAR_SHAPES = [(512, 256, 8000)]
LINEAR_IMPLS = ("fused", "unfused", "authors")


# ---- the authors' code, written out -----------------------------------------------------------------------------


def refine_as_not_true(logits, targets, num_classes):
    """FedNTD's helper, as in its repository: the C-1 not-true logits of each row."""
    nt_positions = torch.arange(0, num_classes).to(logits.device)
    nt_positions = nt_positions.repeat(logits.size(0), 1)
    nt_positions = nt_positions[nt_positions[:, :] != targets.view(-1, 1)]
    nt_positions = nt_positions.view(-1, num_classes - 1)
    return torch.gather(logits, 1, nt_positions)


def ntd_authors(z, t, y, extra):
    tau, C = TAU["ntd"], z.shape[1]
    ce = F.cross_entropy(z, y)
    pred = F.log_softmax(refine_as_not_true(z, y, C) / tau, dim=1)
    with torch.no_grad():
        dg = torch.softmax(refine_as_not_true(t, y, C) / tau, dim=1)
    return ce + BETA * F.kl_div(pred, dg, reduction="batchmean")


def kd_authors(z, t, y, extra):
    T = TAU["kd"]
    p_s = F.log_softmax(z / T, dim=1)
    p_t = F.softmax(t / T, dim=1)
    return F.cross_entropy(z, y) + F.kl_div(p_s, p_t, reduction="sum") * (T**2) / z.shape[0]


def gkd_one_authors(z, t, y, extra):
    T, coef = TAU["gkd"], GAMMA / 2
    return F.cross_entropy(z, y) + coef * T**2 * F.kl_div(
        F.log_softmax(z / T, dim=1), F.softmax(t / T, dim=1), reduction="batchmean"
    )


def gkd_authors(z, t, y, extra):
    T, w = TAU["gkd_vote3"], extra["weights"]
    loss = F.cross_entropy(z, y)
    log_q = F.log_softmax(z / T, dim=1)
    for m in range(t.shape[0]):
        loss = loss + GAMMA / 2 * w[m] * F.kl_div(log_q, F.softmax(t[m] / T, dim=1), reduction="batchmean")
    return loss


def asd_authors(z, t, y, extra):
    tau, prior = TAU["asd"], extra["prior"]
    with torch.no_grad():
        p = F.softmax(t, dim=1)
        ent = -(p * F.log_softmax(t, dim=1)).sum(1)
        w = torch.exp(-ent) / prior[y]
        w = w / w.sum()
    kl = (F.softmax(t / tau, dim=1) * (F.log_softmax(t / tau, dim=1) - F.log_softmax(z / tau, dim=1))).sum(1)
    return F.cross_entropy(z, y) + LAM * (w * kl).sum()


AUTHORS = {"ntd": ntd_authors, "kd": kd_authors, "gkd": gkd_one_authors, "gkd_vote3": gkd_authors, "asd": asd_authors}


# ---- fedfast ----------------------------------------------------------------------------------------------------


def fedfast_losses():
    ntd = fnn.NTDLoss(tau=TAU["ntd"], beta=BETA, tau_squared=False)
    kd = fnn.KDLoss(tau=TAU["kd"])
    gkd = fnn.GKDLoss(tau=TAU["gkd_vote3"], gamma=GAMMA, tau_squared=False)
    gkd1 = fnn.GKDLoss(tau=TAU["gkd"], gamma=GAMMA)
    asd = fnn.ASDLoss(tau=TAU["asd"], lam=LAM)
    return {
        "ntd": lambda z, t, y, e: ntd(z, t, y),
        "kd": lambda z, t, y, e: kd(z, t, y),
        "gkd": lambda z, t, y, e: gkd1(z, t, y),
        "gkd_vote3": lambda z, t, y, e: gkd(z, t, y, teacher_weights=e["weights"]),
        "asd": lambda z, t, y, e: asd(z, t, y, e["prior"]),
    }


def inputs(loss: str, R: int, C: int, seed: int = 0, dtype=torch.float32, device="cpu"):
    """The case's tensors, drawn on the CPU (the same values on any device) and moved to ``device``."""
    z, t, y, extra = _inputs_cpu(loss, R, C, seed, dtype)
    mv = lambda x: x.to(device)
    return mv(z), mv(t), mv(y), {k: mv(v) for k, v in extra.items()}


def _inputs_cpu(loss: str, R: int, C: int, seed: int, dtype):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(R, C, generator=g, dtype=dtype) * 2
    M = 3 if loss == "gkd_vote3" else 1
    t = torch.randn(M, R, C, generator=g, dtype=dtype) * 2
    y = torch.randint(0, C, (R,), generator=g)
    prior = torch.bincount(y, minlength=C).to(dtype) + 1.0
    extra = {"weights": torch.softmax(torch.randn(3, generator=g, dtype=dtype), 0), "prior": prior / prior.sum()}
    return z, (t if M > 1 else t[0]), y, extra


def _impl(name: str, loss: str):
    if name == "fedfast":
        return fedfast_losses()[loss]
    fn = AUTHORS[loss]
    if name == "authors_compiled":
        import torch._dynamo

        torch._dynamo.reset()
        return torch.compile(fn, dynamic=False)
    return fn


def _step(fn, z, t, y, extra):
    zz = z.detach().requires_grad_(True)
    out = fn(zz, t, y, extra)
    out.backward()
    return out


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_case(
    impl: str, loss: str, R: int, C: int, min_time: float = 0.5, max_reps: int = 200, device: str = "cpu"
) -> float:
    """Median seconds of one forward + backward, after two warm-up calls (compilation for the compiled baseline);
    on a GPU each call is timed with the device synchronised before and after."""
    fn = _impl(impl, loss)
    z, t, y, extra = inputs(loss, R, C, device=device)
    for _ in range(2):
        _step(fn, z, t, y, extra)
    times, start = [], time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < min_time and len(times) < max_reps):
        _sync(device)
        t0 = time.perf_counter()
        _step(fn, z, t, y, extra)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise OSError(f"/proc/self/status has no {key}")


def memory_case(impl: str, loss: str, R: int, C: int, device: str = "cpu") -> int:
    """In this process (call it in a fresh one): the peak resident growth of one forward + backward over what the
    process holds once its inputs exist. A first call on other inputs of the same shape runs first (compilation,
    allocator and thread-pool set-up), then the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``). On a
    GPU: the growth of the caching allocator's peak of allocated bytes (``torch.cuda.max_memory_allocated``)."""
    fn = _impl(impl, loss)
    _step(fn, *inputs(loss, R, C, seed=1, device=device))
    z, t, y, extra = inputs(loss, R, C, device=device)
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        _step(fn, z, t, y, extra)
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - base)
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS (Linux)
        f.write("5")
    base = _proc_status_bytes("VmRSS")
    _step(fn, z, t, y, extra)
    return max(0, _proc_status_bytes("VmHWM") - base)


def _memory_in_child(impl: str, loss: str, R: int, C: int, device: str = "cpu") -> int | None:
    r = subprocess.run(
        [sys.executable, "-m", "fedfast.bench", "--device", device, "--_memory", impl, loss, str(R), str(C)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if r.returncode != 0:
        return None
    return int(r.stdout.strip().splitlines()[-1])


# ---- the output layer fused in: LinearKDLoss against F.linear + KDLoss and F.linear + the authors' lines ---------


def _linear_inputs(R: int, H: int, V: int, device: str):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(R, H, generator=g) * H**-0.5
    W = torch.randn(V, H, generator=g) * 2
    t = torch.randn(R, V, generator=g) * 2
    y = torch.randint(0, V, (R,), generator=g)
    return tuple(x.to(device) for x in (h, W, t, y))


def _linear_loss(impl: str):
    T = TAU["kd"]
    if impl == "fused":
        loss = fnn.LinearKDLoss(tau=T)
        return lambda h, W, t, y: loss(h, W, y, t)
    if impl == "unfused":
        loss = fnn.KDLoss(tau=T)
        return lambda h, W, t, y: loss(F.linear(h, W), t, y)
    if impl == "authors":
        return lambda h, W, t, y: kd_authors(F.linear(h, W), t, y, None)
    raise ValueError(f"impl: one of {LINEAR_IMPLS}, got {impl!r}")


def linear_case(impl: str, R: int, H: int, V: int, reps: int, device: str = "cpu") -> dict:
    """In this process (call it in a fresh one): one forward + backward to warm up, then ``reps`` timed ones; the
    first timed call also gives the peak growth over the inputs (resident set on a CPU, the allocator's peak on a
    GPU). ``{"seconds": [...], "peak_bytes": int, "outputs_bytes": int}``."""
    fn = _linear_loss(impl)
    h, W, t, y = _linear_inputs(R, H, V, device)
    h.requires_grad_(True)
    W.requires_grad_(True)
    cuda = torch.device(device).type == "cuda"

    def step():
        h.grad = W.grad = None
        gc.collect()
        _sync(device)
        t0 = time.perf_counter()
        fn(h, W, t, y).backward()
        _sync(device)
        return time.perf_counter() - t0

    step()
    h.grad = W.grad = None
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _proc_status_bytes("VmRSS")
    times = [step()]
    peak = (torch.cuda.max_memory_allocated(device) if cuda else _proc_status_bytes("VmHWM")) - base
    times += [step() for _ in range(reps - 1)]
    return dict(seconds=times, peak_bytes=max(0, peak), outputs_bytes=(R * H + V * H) * h.element_size())


def _linear_in_child(impl: str, R: int, H: int, V: int, reps: int, device: str) -> dict | None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedfast.bench",
            "--device",
            device,
            "--_linear",
            impl,
            str(R),
            str(H),
            str(V),
            str(reps),
        ],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if r.returncode != 0:  # killed for memory (-9), or an error: recorded as not measured, with the reason
        return dict(error=f"exit {r.returncode}: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_linear(shapes, res: dict, out: str | None, echo=print, device: str = "cpu", reps: int | None = None) -> None:
    """The LinearKDLoss rows of ``res["linear"]``: per shape, each implementation in its own process."""
    res["linear"] = []
    for R, H, V in shapes:
        n = reps or (3 if R * H * V > 2e12 else 5)
        rec = dict(R=R, H=H, V=V, logits_bytes=R * V * 4, flops=3 * 2 * R * H * V, cases={})
        for impl in LINEAR_IMPLS:
            c = _linear_in_child(impl, R, H, V, n, device)
            if "seconds" in c:
                c["median_s"] = statistics.median(c["seconds"])
                c["beyond_outputs_logits"] = (c["peak_bytes"] - c["outputs_bytes"]) / rec["logits_bytes"]
            rec["cases"][impl] = c
        cs = rec["cases"]
        if "median_s" in cs["fused"]:
            for base in ("unfused", "authors"):
                if "median_s" in cs[base]:
                    rec[f"speedup_vs_{base}"] = cs[base]["median_s"] / cs["fused"]["median_s"]
        res["linear"].append(rec)
        echo(
            f"linear {R} x {H} x {V}: "
            + "  ".join(
                f"{k} {c['median_s']:.2f} s, {c['beyond_outputs_logits']:.2f} logits beyond outputs"
                if "median_s" in c
                else f"{k} {c['error']}"
                for k, c in cs.items()
            )
        )
        if out:
            _write(out, res)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` where that is missing)."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def machine(device: str = "cpu") -> dict:
    cpu = cpu_model()
    commit = os.environ.get("FEDFAST_COMMIT", "")
    if not commit:
        try:
            here = os.path.dirname(os.path.abspath(__file__))
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
    info = dict(
        device=torch.device(device).type,
        cpu=cpu,
        cores=len(os.sched_getaffinity(0)),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        python=platform.python_version(),
        fedfast=__version__,
        commit=commit or "unknown",
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
    if info["device"] == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return info


def run(
    quick: bool = False,
    losses=LOSSES,
    shapes=None,
    out: str | None = None,
    memory: bool | None = None,
    compiled: bool | None = None,
    echo=print,
    device: str = "cpu",
    linear_shapes=None,
) -> dict:
    given = bool(shapes)
    shapes = shapes or (QUICK_SHAPES if quick else SHAPES)
    memory = (not quick) if memory is None else memory
    compiled = (not quick) if compiled is None else compiled
    impls = ["authors", "fedfast"] + (["authors_compiled"] if compiled else [])
    res = dict(benchmark="losses-vs-authors", machine=machine(device), quick=quick, command=" ".join(sys.argv), rows=[])
    for loss in losses:
        for R, C in shapes:
            rec = dict(loss=loss, R=R, C=C, seconds={}, peak_bytes={}, logits_bytes=R * C * 4)
            for impl in impls:
                rec["seconds"][impl] = time_case(impl, loss, R, C, min_time=0.2 if quick else 0.5, device=device)
                if memory:
                    rec["peak_bytes"][impl] = _memory_in_child(impl, loss, R, C, device)
            s = rec["seconds"]
            rec["speedup_vs_authors"] = s["authors"] / s["fedfast"]
            if "authors_compiled" in s:
                rec["speedup_vs_compiled"] = s["authors_compiled"] / s["fedfast"]
            res["rows"].append(rec)
            mem = (
                ""
                if not memory
                else "  peak "
                + ", ".join(
                    f"{k} {v / rec['logits_bytes']:.2f}x logits" if v is not None else f"{k} -"
                    for k, v in rec["peak_bytes"].items()
                )
            )
            echo(
                f"{loss:10} {R:6d} x {C:<7d} "
                + "  ".join(f"{k} {v * 1e3:9.3f} ms" for k, v in s.items())
                + f"  x{rec['speedup_vs_authors']:.2f} authors"
                + (f", x{rec['speedup_vs_compiled']:.2f} compiled" if "speedup_vs_compiled" in rec else "")
                + mem
            )
            if out:
                _write(out, res)
    if linear_shapes is None:  # with loss shapes given, the LinearKDLoss shapes only when asked for (--linear)
        linear_shapes = [] if given else QUICK_LINEAR_SHAPES if quick else LINEAR_SHAPES
    if linear_shapes:
        run_linear(linear_shapes, res, out, echo, device, reps=3 if quick else None)
    return res


def _write(path: str, res: dict) -> None:
    write_atomic(path, json.dumps(res, indent=1) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fedfast bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small shapes, eager baselines only, no memory")
    ap.add_argument("--losses", default=",".join(LOSSES))
    ap.add_argument("--shapes", default="", help="R,C;R,C (default: all, or the small ones with --quick)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-compiled", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (GPU: device memory, synchronised timing)")
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--linear",
        default="",
        help="LinearKDLoss shapes R,H,V;R,H,V (default: the two language-model "
        "shapes, or the quick one with --quick); 'none' to skip",
    )
    ap.add_argument("--linear-only", action="store_true", help="the LinearKDLoss comparison alone")
    ap.add_argument("--_memory", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--_linear", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        dev = torch.device(a.device)
    except RuntimeError:
        ap.error(f"--device: expected cpu or cuda[:N], got {a.device!r}")
    if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not torch.cuda.is_available()):
        ap.error(
            f"--device: {a.device!r} is not available here (cpu" + (", cuda" if torch.cuda.is_available() else "") + ")"
        )
    if a._linear:
        impl, R, H, V, reps = a._linear
        print(json.dumps(linear_case(impl, int(R), int(H), int(V), int(reps), a.device)))
        return 0
    if a._memory:
        impl, loss, R, C = a._memory
        print(memory_case(impl, loss, int(R), int(C), a.device))
        return 0
    losses = [x for x in a.losses.split(",") if x]
    bad = [x for x in losses if x not in LOSSES]
    if bad:
        ap.error(f"--losses: unknown {bad}; known: {', '.join(LOSSES)}")
    try:
        shapes = [tuple(int(v) for v in s.split(",")) for s in a.shapes.split(";") if s] or None
    except ValueError:
        ap.error(f"--shapes: expected 'R,C;R,C', got {a.shapes!r}")
    linear = None
    if a.linear == "none":
        linear = []
    elif a.linear:
        try:
            linear = [tuple(int(v) for v in s.split(",")) for s in a.linear.split(";") if s]
        except ValueError:
            linear = None
        if not linear or any(len(x) != 3 or min(x) < 1 for x in linear):
            ap.error(f"--linear: expected 'R,H,V;R,H,V' or 'none', got {a.linear!r}")
    if a.linear_only:
        if linear == []:
            ap.error("--linear-only with --linear none: nothing to run")
        res = dict(
            benchmark="losses-vs-authors", machine=machine(a.device), quick=a.quick, command=" ".join(sys.argv), rows=[]
        )
        run_linear(
            linear or (QUICK_LINEAR_SHAPES if a.quick else LINEAR_SHAPES),
            res,
            a.out or None,
            device=a.device,
            reps=3 if a.quick else None,
        )
        return 0
    run(
        a.quick,
        losses,
        shapes,
        a.out or None,
        memory=False if a.no_memory else None,
        compiled=False if a.no_compiled else None,
        device=a.device,
        linear_shapes=linear,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
