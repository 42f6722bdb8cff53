"""TF32 on the GPU: the engine's Triton convolutions with one TF32 product ("tf32") or three ("tf32x3") against the
float64 loop and the TF32 GPU loop (issue 45: with TF32 on, the engine was 1.9e-3 from the float64 loop on a small
CNN where the TF32 loop was 3.0e-5, and 7.8e-2 against 7.0e-3 on a BatchNorm ResNet), and what each costs: one
convolution (``simple_cnn``'s second, 50 clients x B 10) forward + backward, and a pfl_cifar_50 round.

    python benchmarks/tf32_probe.py --out $OUT/<gpu>-tf32.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE, os.path.join(ROOT, "tests")]
from fedfast.sim.memory import tf32_semantics  # noqa: E402


def engine_errors(precs):
    """(engine error, TF32 loop error) from the float64 loop, per precision, on the two models of the GPU tests."""
    from sequential_loop import PlainLoop, sequential
    from test_batch_norm import _Data, _max_rel, _resnet_run
    from test_engine_conv import _cnn_setup

    import fedfast
    from fedfast.triton import conv as tconv

    shipped = tconv.TF32_PRECISION
    out = {}
    cfg, model, train, test, part = _resnet_run("auto", smooth=True)
    ref = PlainLoop(cfg, copy.deepcopy(model).double(), _Data(train), part)
    ref.run(cfg.rounds)
    ref64 = ref.glob.state_dict()
    floats = [k for k, v in ref64.items() if v.is_floating_point()]
    cpu = lambda sd: {k: v.cpu() for k, v in sd.items()}  # noqa: E731
    with tf32_semantics():
        loop = PlainLoop(cfg, copy.deepcopy(model).cuda(), train.to("cuda"), part)
        loop.run(cfg.rounds)
        own = _max_rel(cpu(loop.glob.state_dict()), ref64, floats)
        for p in precs:
            tconv.TF32_PRECISION = p
            sim = fedfast.Simulation(cfg, copy.deepcopy(model).cuda(), train.to("cuda"), test.to("cuda"), part)
            sim.run()
            out[f"resnet_bn/{p}"] = dict(engine=_max_rel(cpu(sim.state_dict()), ref64, floats), tf32_loop=own)
    train, test, part, model = _cnn_setup()
    for conv in ("triton", "hybrid"):
        cfg = fedfast.SimConfig(
            algorithm="fedntd", clients_per_round=3, rounds=2, batch_size=8, lr=0.05, momentum=0.9, seed=1, conv=conv
        )
        r64 = sequential(cfg, copy.deepcopy(model).double(), _Data(train), part, cfg.rounds).cpu()
        rel = lambda a: float((a.double().cpu() - r64).abs().max() / r64.abs().max())  # noqa: E731
        with tf32_semantics():
            own = rel(sequential(cfg, copy.deepcopy(model).cuda(), train.to("cuda"), part, cfg.rounds))
            for p in precs:
                tconv.TF32_PRECISION = p
                sim = fedfast.Simulation(cfg, copy.deepcopy(model).cuda(), train.to("cuda"), test.to("cuda"), part)
                sim.run()
                out[f"cnn_{conv}/{p}"] = dict(engine=rel(sim.global_flat), tf32_loop=own)
    tconv.TF32_PRECISION = shipped
    return out


def conv_cost(precs):
    """simple_cnn's conv2 (32 -> 64, 3x3, 30x30) for 50 clients x B 10: forward + backward time and error vs
    float64, per Triton precision, and cuDNN's grouped convolution with TF32 on and off."""
    from triton.testing import do_bench

    from fedfast.ops.client_conv import client_conv2d, client_conv2d_reference
    from fedfast.triton import conv as tconv

    shipped = tconv.TF32_PRECISION
    g = torch.Generator().manual_seed(0)
    n, B, Cin, Cout = 50, 10, 32, 64
    x = torch.randn(B, n * Cin, 30, 30, generator=g, dtype=torch.float64)
    w = torch.randn(n, Cout, Cin, 3, 3, generator=g, dtype=torch.float64) * 0.1
    b = torch.randn(n, Cout, generator=g, dtype=torch.float64)
    gy = torch.randn(B, n * Cout, 28, 28, generator=g, dtype=torch.float64)
    xs, ws, bs = x[:, : 2 * Cin].clone().requires_grad_(), w[:2].clone().requires_grad_(), b[:2]
    want = client_conv2d_reference(xs, ws, bs, (1, 1), (0, 0), (1, 1))
    wgx, wgw = torch.autograd.grad(want, (xs, ws), gy[:, : 2 * Cout])
    flops = 3 * 2 * n * B * 28 * 28 * Cout * Cin * 9
    xc, wc, bc, gc = (t.float().cuda() for t in (x, w, b, gy))
    res = {}
    for label, impl, p, tf in (
        [("triton_ieee", "triton", "tf32", False)]
        + [(f"triton_{p}", "triton", p, True) for p in precs]
        + [
            ("grouped_fp32", "grouped", "tf32", False),
            ("grouped_tf32", "grouped", "tf32", True),
            ("hybrid_tf32", "hybrid", "tf32", True),
            ("hybrid_tf32x3", "hybrid", "tf32x3", True),
        ]
    ):
        tconv.TF32_PRECISION = p
        try:
            with tf32_semantics(tf):
                xx, ww = xc.clone().requires_grad_(), wc.clone().requires_grad_()

                def step():
                    y = client_conv2d(xx, ww, bc, (1, 1), (0, 0), (1, 1), impl=impl)
                    return torch.autograd.grad(y, (xx, ww), gc)

                gx, gw = step()
                y = client_conv2d(xx[:, : 2 * Cin], ww[:2], bc[:2], (1, 1), (0, 0), (1, 1), impl=impl)
                err = max(
                    float((a.double().cpu() - e).norm() / e.norm())
                    for a, e in ((y.detach(), want.detach()), (gx[:, : 2 * Cin], wgx), (gw[:2], wgw))
                )
                s = do_bench(step, warmup=25, rep=200, return_mode="median") * 1e-3
        finally:
            tconv.TF32_PRECISION = shipped
        res[label] = dict(seconds=s, tflops=flops / s / 1e12, rel_err=err)
        print(f"  conv {label:14s} {s * 1e3:7.3f} ms {flops / s / 1e12:6.1f} TFLOP/s  rel err {err:.1e}", flush=True)
    return res


def round_cost(precs, rounds=3):
    from bench_rounds import SHAPES, _data, _model

    import fedfast
    from fedfast import data
    from fedfast.triton import conv as tconv

    shipped = tconv.TF32_PRECISION
    s = SHAPES["pfl_cifar_50"]
    train, _ = _data(s["dataset"], s["K"] * s["n"])
    part = data.iid(train.y, s["K"], seed=0)
    train = train.to("cuda")
    torch.manual_seed(0)
    model = _model(s["model"])
    out = {}
    with tf32_semantics():
        for p in precs:
            tconv.TF32_PRECISION = p
            cfg = fedfast.SimConfig(
                algorithm=s["algorithm"],
                clients_per_round=s["m"],
                rounds=10**6,
                local_epochs=s["E"],
                batch_size=s["B"],
                lr=s["lr"],
                momentum=s["momentum"],
                seed=0,
                eval_every=10**6,
                conv="hybrid",
            )
            sim = fedfast.Simulation(
                cfg, copy.deepcopy(model).cuda(), train, train.subset(slice(0, 100)), part, device="cuda"
            )
            sim.round()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(rounds):
                sim.round()
            torch.cuda.synchronize()
            out[p] = (time.perf_counter() - t0) / rounds
            print(f"  pfl_cifar_50 hybrid {p}: {out[p] * 1e3:.2f} ms/round", flush=True)
    tconv.TF32_PRECISION = shipped
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from bench_rounds import machine

    precs = ("tf32", "tf32x3")
    res = dict(machine=machine(torch.device("cuda")))
    res["engine_errors"] = engine_errors(precs)
    for k, v in res["engine_errors"].items():
        print(f"{k:22s} engine {v['engine']:.2e}  TF32 loop {v['tf32_loop']:.2e}", flush=True)
    res["conv"] = conv_cost(precs)
    res["round_s"] = round_cost(precs)
    with open(a.out + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
    main()
