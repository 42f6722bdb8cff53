"""Where a round's time goes: ``torch.profiler`` over engine rounds of the round benchmark's shapes.

For each shape and convolution implementation, one warm-up round, then ``--rounds`` profiled rounds; writes the
operators sorted by device time (self time, with call counts) and the share of the round in each group
(convolutions, matrix products, the fused fedfast ops, copies, elementwise/other), and the host's view: the
wall time of a round against the device time its kernels took (a host-bound round has device idle time): the
kernels' summed time and the time the device had any kernel running (``busy``), from the device events alone (an
operator's self device time repeats its kernels', which summed both, up to twice the device time). The
wall time is also measured without the profiler (``wall_plain``, median of ``--rounds`` rounds), which the
profiler's own host cost does not inflate; ``--cprofile N`` adds the host's Python side of one more round
(``cProfile``, the N functions with the most time of their own, C calls such as kernel launches included).

    python benchmarks/profile_round.py --device cuda --shapes pfl_cifar_50,pfl_cifar_1000 --conv grouped,triton \
        --out $OUT/profile.txt
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from bench_rounds import SHAPES, _data, _model, _sync  # noqa: E402

import fedfast  # noqa: E402
from fedfast import data  # noqa: E402

GROUPS = [
    ("convolution", ("conv", "cudnn", "implicit", "wgrad", "dgrad", "im2col", "col2im", "_conv_")),
    ("matrix products", ("gemm", "bmm", "matmul", "mm", "cutlass", "sm90_xmma", "ampere_sgemm")),
    (
        "fedfast fused ops",
        ("_distill", "_step_kernel", "_norm_kernel", "_aggregate", "client_step", "distill", "aggregate"),
    ),
    ("copies", ("copy", "cat", "CatArray", "memcpy", "Memcpy", "index", "gather", "scatter")),
]


def _group(name: str) -> str:
    low = name.lower()
    for g, keys in GROUPS:
        if any(k.lower() in low for k in keys):
            return g
    return "elementwise, reductions, other"


# operators that launch no kernel (views, metadata, allocation): not counted as compute ops on a CPU
_META = (
    "empty",
    "empty_strided",
    "empty_like",
    "as_strided",
    "as_strided_",
    "view",
    "reshape",
    "_reshape_alias",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "expand",
    "transpose",
    "detach",
    "detach_",
    "resolve_conj",
    "resolve_neg",
    "t",
    "permute",
    "alias",
    "_unsafe_view",
    "resize_",
    "contiguous",
    "lift_fresh",
    "flatten",
    "unflatten",
    "split",
    "chunk",
    "narrow",
    "unbind",
    "set_",
    "item",
    "_local_scalar_dense",
    "result_type",
    "view_as",
    "expand_as",
    "movedim",
    "unfold",
    "to",
    "_to_copy",
    "_has_compatible_shallow_copy_type",
)


def _launches(prof, dev) -> int:
    """Device kernels the profiled rounds launched (CUDA), or on a CPU the innermost compute operators (an
    ``aten::`` op with no compute op below it, views and allocations left out): the count a GPU would launch."""
    from torch.autograd import DeviceType

    evs = prof.events()
    if dev.type == "cuda":
        return sum(1 for e in evs if e.device_type == DeviceType.CUDA)
    meta = {"aten::" + m for m in _META}

    def compute(e):
        return e.name.startswith("aten::") and e.name not in meta

    return sum(1 for e in evs if compute(e) and not any(compute(k) for k in e.cpu_children))


def _kernel_time(prof, rounds: int) -> tuple:
    """(the kernels' summed time, the time the device had any kernel running, {group: summed time}) per round, in
    seconds, from the profiler's device events (kernels, copies, memsets) alone."""
    from torch.autograd import DeviceType

    ks = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    groups: dict = {}
    for e in ks:
        g = _group(e.name)
        groups[g] = groups.get(g, 0.0) + e.time_range.elapsed_us() / rounds / 1e6
    busy, end = 0.0, None
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in ks):
        if end is None or a > end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    total = sum(e.time_range.elapsed_us() for e in ks)
    return total / rounds / 1e6, busy / rounds / 1e6, groups


def _host_profile(sim, dev, top: int) -> str:
    """cProfile over one round: the ``top`` functions by own time (a kernel launch is its Python binding's time)."""
    pr = cProfile.Profile()
    _sync(dev)
    pr.enable()
    sim.round()
    _sync(dev)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def profile_shape(name: str, dev, conv: str, rounds: int, cprofile: int = 0) -> str:
    s = SHAPES[name]
    train, _ = _data(s["dataset"], s["K"] * s["n"])
    part = data.iid(train.y, s["K"], seed=0)
    torch.manual_seed(0)
    model = _model(s["model"])
    opts = {"fedntd": {"beta": 1.0, "tau": 1.0}} if s["algorithm"] == "fedntd" else {}
    cfg = fedfast.SimConfig(
        algorithm=s["algorithm"],
        options=opts,
        clients_per_round=s["m"],
        rounds=10**6,
        local_epochs=s["E"],
        batch_size=s["B"],
        lr=s["lr"],
        momentum=s["momentum"],
        weight_decay=s.get("weight_decay", 0.0),
        seed=0,
        eval_every=10**6,
        conv=conv.partition("+")[0],
        cuda_graphs=conv.endswith("+graphs"),  # "triton+graphs": that convolution, each chunk's step one CUDA graph
    )
    train = train.to(dev)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model).to(dev), train, train.subset(slice(0, 100)), part, device=dev)
    sim.round()
    _sync(dev)
    plain = []
    for _ in range(rounds):  # without the profiler: its own host cost inflates the profiled rounds' wall time
        t = time.perf_counter()
        sim.round()
        _sync(dev)
        plain.append(time.perf_counter() - t)
    wall_plain = sorted(plain)[len(plain) // 2]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()  # inside: the profiler's start and its post-processing at exit are not the round's
        for _ in range(rounds):
            sim.round()
        _sync(dev)
        wall = (time.perf_counter() - t) / rounds
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    if dev.type == "cuda":  # the kernels themselves (an operator's self device time repeats its kernels')
        total, busy, groups = _kernel_time(prof, rounds)
    else:
        evs = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
        total = busy = sum(getattr(e, key) for e in evs) / rounds / 1e6
        groups = {}
        for e in evs:
            g = _group(e.key)
            groups[g] = groups.get(g, 0.0) + getattr(e, key) / rounds / 1e6
    steps = s["E"] * -(-s["n"] // s["B"]) * -(-s["m"] // sim.chunk)  # local steps per round (chunks run in turn)
    launches = _launches(prof, dev) / rounds
    lines = [
        f"== {name}, conv={sim.runtime.conv}{' +graphs' if cfg.cuda_graphs else ''}, {dev.type}: "
        f"wall {wall * 1e3:.2f} ms/round, "
        f"{'device' if dev.type == 'cuda' else 'cpu self'} time {total * 1e3:.2f} ms/round "
        f"({100 * total / wall:.0f} % of the wall time; busy {busy * 1e3:.2f} ms, "
        f"{100 * busy / wall_plain:.0f} % of the wall time without the profiler), chunk {sim.chunk}; "
        f"{launches:.0f} {'kernels' if dev.type == 'cuda' else 'compute ops'} per round, "
        f"{launches / steps:.1f} per local step ({steps} steps), wall {wall / steps * 1e6:.0f} us per step; "
        f"without the profiler {wall_plain * 1e3:.2f} ms/round, {wall_plain / steps * 1e6:.0f} us per step"
    ]
    for g, v in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"   {g:32} {v * 1e3:9.3f} ms  {100 * v / total:5.1f} %")
    lines.append(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70))
    if cprofile:
        lines.append(f"-- host (cProfile), one round of {name}, conv={sim.runtime.conv}:")
        lines.append(_host_profile(sim, dev, cprofile))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="pfl_cifar_50,pfl_cifar_1000")
    ap.add_argument("--conv", default="auto")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cprofile", type=int, default=0, help="also the top N host functions of one round (cProfile)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cpu":  # as bench_rounds: glibc keeps freed memory (no page faults per step)
        fedfast.tune_cpu_allocator()
    out = []
    for name in a.shapes.split(","):
        for conv in a.conv.split(","):
            txt = profile_shape(name, dev, conv, a.rounds, a.cprofile)
            print(txt.split("\n", 1)[0], flush=True)
            print("\n".join(txt.split("\n")[1:8]), flush=True)
            out.append(txt)
            if a.out:
                with open(a.out, "w") as f:
                    f.write("\n\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
