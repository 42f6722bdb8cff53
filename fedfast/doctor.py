"""``fedfast doctor``: what this machine has, and every available backend checked against the reference.

Prints versions (fedfast, torch, triton, Python), devices, which backends are built, then for each device and
each backend that can run there: the fused distillation op (CE, KD, not-true KD, soft-CE with class weights, the
FedADC+ target, a 3-teacher mixture), the fused client step (momentum, weight decay, FedProx, clipping) and the
fused server update (FedAvg, server momentum), each against the float64 reference on small shapes, and one engine
round (FedNTD, SCAFFOLD) against the same round on the ``reference`` backend. It ends with the backend that
automatic selection will use on each device. On a GPU this is how the CUDA and Triton paths, compiled and
interpreted but never executed in fedfast's CI, are verified in one command. Exit code 1 if any check fails.
"""

from __future__ import annotations

import copy
import os
import platform
import sys
import time
from importlib import metadata

import torch

import fedfast

from . import __version__, data, models, ops
from .ops import _backend
from .ops.aggregate_reference import aggregate_reference
from .ops.client_step_reference import client_step_reference

TOL = 2e-5


def _rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    den = b.abs().max().item() if b.numel() else 0.0
    return (a - b).abs().max().item() / max(den, 1e-30) if b.numel() else 0.0


def _distill_cases(dev):
    g = torch.Generator().manual_seed(0)
    R, C = 37, 10
    z = torch.randn(R, C, generator=g) * 3
    t = torch.randn(R, C, generator=g) * 3
    T = torch.randn(3, R, C, generator=g) * 3
    y = torch.randint(0, C, (R,), generator=g)
    y[2] = -100
    seg = torch.sort(torch.randint(0, 4, (R,), generator=g)).values
    alpha = torch.rand(C, generator=g)
    rho = torch.rand(4, C, generator=g)
    w = torch.softmax(torch.randn(3, generator=g), 0)
    cases = {
        "ce": dict(kd_weight=0.0),
        "kd": dict(tau=3.0, kd_weight=2.0),
        "not_true": dict(kind="not_true", tau=2.0),
        "soft_ce+class_alpha": dict(soft_ce=True, class_alpha=alpha, tau=2.0),
        "fedadc+": dict(rho=rho, ce_weight=0.65, kd_weight=0.35 * 16, tau=4.0),
    }
    for name, kw in cases.items():
        yield name, (z, t, y), dict(segments=seg, num_segments=4, **kw)
    yield "mixture", (z, T, y), dict(teacher_weights=w, segments=seg, num_segments=4, tau=2.0)


def _check_distill(backend, dev):
    worst = 0.0
    for _name, (z, t, y), kw in _distill_cases(dev):
        kw = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in kw.items()}
        zz = z.to(dev).requires_grad_(True)
        loss = ops.distill(zz, t.to(dev), y.to(dev), backend=backend, validate="off", **kw)
        (gz,) = torch.autograd.grad(loss, zz)
        kw64 = {
            k: (
                v.cpu().double()
                if torch.is_tensor(v) and v.is_floating_point()
                else v.cpu()
                if torch.is_tensor(v)
                else v
            )
            for k, v in kw.items()
        }
        zr = z.double().requires_grad_(True)
        ref = ops.distill(zr, t.double(), y, backend="reference", **kw64)
        (gr,) = torch.autograd.grad(ref, zr)
        worst = max(worst, _rel(loss.detach(), ref.detach()), _rel(gz, gr))
    return worst


def _check_flat(backend, dev):
    g = torch.Generator().manual_seed(1)
    N, P = 5, 1031
    theta, grad = torch.randn(N, P, generator=g), torch.randn(N, P, generator=g)
    anchor = torch.randn(P, generator=g)
    w = torch.arange(1.0, N + 1)
    step = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, prox_mu=0.1, max_norm=5.0)
    th, buf = theta.to(dev).clone(), torch.zeros(N, P, device=dev)
    thr, bufr = theta.double(), torch.zeros(N, P, dtype=torch.float64)
    for _ in range(2):
        ops.client_step(th, grad.to(dev), momentum_buf=buf, anchor=anchor.to(dev), backend=backend, **step)
        thr, bufr = client_step_reference(thr, grad.double(), momentum_buf=bufr, anchor=anchor.double(), **step)
    out = ops.aggregate(
        th,
        anchor.to(dev),
        weights=w.to(dev),
        rows=N,
        beta=0.9,
        lr=1.0,
        momentum=torch.ones(P, device=dev),
        backend=backend,
    )
    ref = aggregate_reference(
        thr, anchor.double(), (w / w.sum()).double(), beta=0.9, lr=1.0, momentum=torch.ones(P, dtype=torch.float64)
    )
    return max(_rel(th, thr), _rel(out["global"], ref["global"]), _rel(out["momentum"], ref["momentum"]))


def _check_round(backend, dev):
    train, test = data.synthetic(4, 240, 60, (1, 6, 6), seed=0)
    part = data.dirichlet_lda(train.y, 6, alpha=0.5, seed=1, min_size=5)
    torch.manual_seed(0)
    model = models.MLP(36, (16,), 4)
    worst = 0.0
    for alg in ("fedntd", "scaffold"):
        res = []
        for be in (backend, "reference"):
            cfg = fedfast.SimConfig(
                algorithm=alg, clients_per_round=4, rounds=2, batch_size=16, lr=0.05, momentum=0.9, backend=be
            )
            sim = fedfast.Simulation(cfg, copy.deepcopy(model).to(dev), train.to(dev), test.to(dev), part, device=dev)
            sim.run()
            res.append(sim.global_flat)
        worst = max(worst, _rel(*res))
    return worst


def main(quick: bool = False) -> int:
    env = os.environ.get("FEDFAST_BACKEND")
    if env and env not in ("auto",) + _backend.BACKENDS:
        print(
            f"fedfast: FEDFAST_BACKEND (environment variable): must be one of {('auto',) + _backend.BACKENDS}, "
            f"got {env!r}",
            file=sys.stderr,
        )
        return 2
    print(
        f"fedfast {__version__}  torch {torch.__version__}  python {platform.python_version()}  "
        f"{platform.machine()} {platform.system()}"
    )
    try:
        import triton

        print(f"triton {triton.__version__}")
        why = _backend.interpreter_problem()
        if why:
            print(f"  TRITON_INTERPRET=1, but {why}; the 'triton' backend is off on the CPU")
    except Exception:  # noqa: BLE001
        print("triton: not importable")
    extras = []
    for pkg in ("transformers", "tokenizers", "tqdm", "matplotlib", "tensorboard"):  # optional (extras): versions only
        try:
            extras.append(f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            extras.append(f"{pkg} -")
    print("optional: " + ", ".join(extras) + "  (text models need transformers and tokenizers: fedfast[text])")
    devs = ["cpu"] + ([f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else [])
    for d in devs:
        name = torch.cuda.get_device_name(d) if d.startswith("cuda") else f"{torch.get_num_threads()} threads"
        print(f"device {d}: {name}")
    cpu_why, cuda_why = _backend.ext_status("fedfast._C"), _backend.ext_status("fedfast._C_cuda")
    if torch.version.cuda is None and cuda_why is not None:
        cuda_why = None
        cuda_word = "- (this torch has no CUDA)"
    else:
        cuda_word = "yes" if cuda_why is None else "NO"
    print(
        f"built: cpu extension {'yes' if cpu_why is None else 'NO'}, cuda extension {cuda_word}, triton "
        f"{'yes' if _backend.triton_available() else 'no'}"
    )
    for mod, why in (("fedfast._C", cpu_why), ("fedfast._C_cuda", cuda_why)):
        if why is not None:
            print(
                f"  {mod}: {why}; its backend falls back to 'reference' (correct, slower). Build it "
                f"{_backend.BUILD_HINT}."
            )
    failed = 0
    for d in devs:
        dt = "cuda" if d.startswith("cuda") else "cpu"
        for be in _backend.BACKENDS:
            if not _backend.available(be, dt):
                continue
            checks = [("distill", _check_distill), ("client_step+aggregate", _check_flat)]
            if not quick:
                checks.append(("engine round", _check_round))
            for what, fn in checks:
                t0 = time.perf_counter()
                try:
                    err = fn(be, d)
                    ok = err <= TOL
                    msg = f"max rel err {err:.1e}"
                except Exception as e:  # noqa: BLE001 - a doctor reports, it does not crash
                    ok, msg = False, f"{type(e).__name__}: {e}"
                failed += not ok
                print(
                    f"  {'ok  ' if ok else 'FAIL'} {d:7s} {be:9s} {what:22s} {msg}  ({time.perf_counter() - t0:.1f}s)"
                )
    for d in devs:
        dt = "cuda" if d.startswith("cuda") else "cpu"
        print(f"automatic backend on {d}: {_backend.resolve(None, dt)}")
    print("all checks passed" if not failed else f"{failed} check(s) FAILED")
    return 1 if failed else 0
