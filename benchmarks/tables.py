"""The measured tables of README.md and docs/*.md, generated from the committed benchmark JSON files.

Each generated table sits between two markers in a Markdown file::

    <!-- table:NAME -->
    (generated: the machine, torch, commit, date and command of the run, then the table)
    <!-- /table:NAME -->

``python benchmarks/tables.py`` rewrites every marked table from ``benchmarks/results/``; ``--check`` changes
nothing and exits 1 when a file differs from what the JSON gives (``tests/test_tables.py`` runs it, so a hand
edit of a generated number fails the suite). A table whose JSON is not committed yet says so instead of numbers.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
FILES = ["README.md", "docs/benchmarks.md", "docs/engine.md", "docs/study.md", "docs/kernels.md"]
DOC_ROOT = ROOT  # where FILES are read and rewritten (tests point it at a copy)

SHAPE_LABELS = {
    "pfl_cifar_50": "pfl-research: simple_cnn, 3x32x32, 1000 clients x 50, 50/round, B=10",
    "pfl_cifar_1000": "the same, all 1000 clients per round",
    "fedntd_mnist_e5": "FedNTD's MNIST: FedAvg CNN, 100 x 600, 10/round, E=5, B=50, momentum 0.9",
    "resnet8_gn": "ResNet-8 (GroupNorm), 3x32x32, 200 x 50, 20/round, B=10",
    "mlp_1000x60": "MLP 784-200-200-10, MNIST, 1000 x 60, 50/round, B=10",
}


def _load(pattern: str) -> list[tuple[str, dict]]:
    out = []
    for p in sorted(glob.glob(os.path.join(RESULTS, pattern))):
        with open(p) as f:
            out.append((os.path.relpath(p, ROOT), json.load(f)))
    return out


def _machine(m: dict) -> str:
    if m["device"] == "cuda":
        where = f"{m['gpu']} ({m.get('sms', '?')} SMs), CUDA {m.get('cuda')}, Triton {m.get('triton', '-')}"
    else:
        where = f"{m.get('cpu', 'CPU')}, {m.get('cores', '?')} cores, {m['threads']} threads"
    tf32 = (
        "TF32 on for cuDNN convolutions (PyTorch's default), off for matrix products"
        if m.get("cudnn_allow_tf32") and not m.get("matmul_allow_tf32") and m["device"] == "cuda"
        else ""
    )
    return f"{where}; torch {m['torch']}, Python {m['python']}; fedfast commit `{m['commit'][:12]}`, {m['date']}" + (
        f"; {tf32}" if tf32 else ""
    )


def _ceil(c: dict) -> str:
    parts = [f"fp32 matrix product {c['fp32_matmul_flops'] / 1e12:.2f} TFLOP/s"]
    if "tf32_matmul_flops" in c:
        parts.append(f"TF32 {c['tf32_matmul_flops'] / 1e12:.1f} TFLOP/s")
    parts.append(f"copy {c['copy_bytes_per_s'] / 1e9:.0f} GB/s")
    return ", ".join(parts)


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.2f} GiB"


def _newest_first(runs: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    return sorted(runs, key=lambda pr: pr[1]["machine"].get("date", ""), reverse=True)


def rounds_full(runs: list[tuple[str, dict]], device: str) -> str:
    """Every implementation of every shape, with its share of the measured fp32 matrix-product rate: one table per
    run, newest first (implementations are compared only within a run: same process, same device)."""
    runs = _newest_first([(p, r) for p, r in runs if r["machine"]["device"] == device])
    if not runs:
        return (
            f"No {'GPU' if device == 'cuda' else 'CPU'} run of the round benchmark is committed yet "
            f"(`bash scripts/gpu_check.sh build bench-rounds` makes one on a GPU)."
        )
    lines = [
        "The last column compares the global models, `max |fedfast - loop| / max |loop|`, after the first "
        "round and at the end. In brackets is the loop's own change after its first round when its initial "
        "weights are perturbed by 1e-7. That is how far float rounding alone moves this training."
    ]
    from bench_rounds import floor_seconds

    for path, r in runs:
        lines += [
            "",
            f"Measured on {_machine(r['machine'])}. Ceilings measured in the same run: "
            f"{_ceil(r['ceilings'])}. Command: `python benchmarks/{r['command']}`; data: `{path}`.",
            "",
            "| shape | roofline | implementation | s/round | client-samples/s | TFLOP/s | % of fp32 matmul | "
            "peak memory | x loop | diff vs loop: round 1 (rounding alone); end |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        peak = r["ceilings"]["fp32_matmul_flops"]
        for rec in r["shapes"]:
            label = f"{SHAPE_LABELS.get(rec['shape'], rec['shape'])} | {_ms(floor_seconds(rec, r['ceilings']))}"
            for key, im in rec["impls"].items():
                tiles = " + tiles" if im.get("triton_tiles") else ""
                graphs = ", CUDA graphs" if im.get("cuda_graphs") else ""
                name = "plain loop" if key == "loop" else f"fedfast (conv {im['conv']}{tiles}{graphs})"
                ratio = "1" if key == "loop" else (f"{im['speedup_vs_loop']:.2f}" if "speedup_vs_loop" in im else "-")
                diff = "-"
                if "max_rel_diff_vs_loop" in im:
                    sens = rec.get("loop_sensitivity_first_round")
                    diff = f"{im['rel_diff_vs_loop_first_round']:.1e} ({sens:.1e}); {im['max_rel_diff_vs_loop']:.1e}"
                lines.append(
                    f"| {label} | {name} | {_ms(im['seconds_per_round'])} | {im['samples_per_s']:,.0f} | "
                    f"{im['tflops']:.3f} | {100 * im['tflops'] * 1e12 / peak:.0f} % | "
                    f"{_gib(im['peak_memory_bytes'])} | {ratio} | {diff} |"
                )
    return "\n".join(lines)


def rounds_short(runs: list[tuple[str, dict]], device: str) -> str:
    """The README's view: per shape, from the newest run that has it, the loop's and fedfast's fastest seconds per
    round (engine variants with hand-set tiles left out), the ratio and fedfast's rate."""
    runs = _newest_first([(p, r) for p, r in runs if r["machine"]["device"] == device])
    if not runs:
        return (
            f"Not measured yet: no {'GPU' if device == 'cuda' else 'CPU'} run of `benchmarks/bench_rounds.py` "
            f"is committed."
        )
    newest = {}
    for _, r in runs:
        for rec in r["shapes"]:
            newest.setdefault(rec["shape"], (r, rec))
    order = [s for s in SHAPE_LABELS if s in newest] + [s for s in newest if s not in SHAPE_LABELS]
    used = [r for r in dict.fromkeys(id(newest[s][0]) for s in order)]
    used = [next(r for _, r in runs if id(r) == i) for i in used]
    m = used[0]["machine"]
    gpus = list(dict.fromkeys(r["machine"].get("gpu", "?") for r in used)) if device == "cuda" else []
    where = " and ".join(gpus) if device == "cuda" else f"{m.get('cores', '?')}-core {m.get('cpu', 'CPU')}"
    shas = list(dict.fromkeys(r["machine"]["commit"][:12] for r in used))
    commits = ", ".join(f"`{c}`" for c in shas)
    per_gpu = len(gpus) > 1  # rows from runs on different GPUs: each row names its own
    lines = [
        f"`benchmarks/bench_rounds.py` on {where} (torch {m['torch']}, commit{'s' if len(shas) > 1 else ''} "
        f"{commits}; per shape its newest run{', on the GPU its row names' if per_gpu else ''}; the loop and fedfast "
        f"in one process, same clients, data order and initial weights; details and every implementation in "
        f"[docs/benchmarks.md](docs/benchmarks.md#the-round-benchmark)):",
        "",
        "| workload | plain loop s/round | fedfast s/round | x loop | fedfast TFLOP/s |"
        + (" GPU |" if per_gpu else ""),
        "|---|---|---|---|---|" + ("---|" if per_gpu else ""),
    ]
    for shape in order:
        r, rec = newest[shape]
        loop = rec["impls"].get("loop")
        engines = {k: v for k, v in rec["impls"].items() if k != "loop" and not v.get("triton_tiles")}
        key, best = min(engines.items(), key=lambda kv: kv[1]["seconds_per_round"])
        graphs = ", CUDA graphs" if best.get("cuda_graphs") else ""
        conv = f" ({best['conv']} conv{graphs})" if len(engines) > 1 else ""
        lines.append(
            f"| {SHAPE_LABELS.get(rec['shape'], rec['shape'])} | "
            f"{_ms(loop['seconds_per_round']) if loop else '-'} | "
            f"{_ms(best['seconds_per_round'])}{conv} | "
            f"{best.get('speedup_vs_loop', float('nan')):.2f} | {best['tflops']:.3f} |"
            + (f" {r['machine'].get('gpu', '?')} |" if per_gpu else "")
        )
    return "\n".join(lines)


def conv_table(runs: list[tuple[str, dict]], device: str) -> str:
    runs = [(p, r) for p, r in runs if r["device"].startswith(device)]
    if not runs:
        return f"No {device.upper()} run of `benchmarks/bench_conv.py` is committed yet."
    lines = []
    for path, r in runs:
        where = _machine(r["machine"]) if "machine" in r else (r["gpu"] or f"CPU, {r['threads']} threads")
        lines += [
            f"Measured on {where}. Command: `python benchmarks/{r.get('command', 'bench_conv.py')}`; data: `{path}`.",
            "",
            "| layer (clients, batch, Cin->Cout, HxW, kernel/stride) | implementation | layout | TF32 | "
            "fwd+bwd ms | TFLOP/s |",
            "|---|---|---|---|---|---|",
        ]
        for row in r["rows"]:
            if "error" in row:
                lines.append(
                    f"| {row['layer']} | {row['impl']} | {row['layout']} | {int(row['tf32'])} | {row['error']} | |"
                )
                continue
            n, B, ci, co, H, k, s, p, _ = row["geometry"]
            lines.append(
                f"| {row['layer']} ({n}, {B}, {ci}->{co}, {H}x{H}, {k}/{s}) | {row['impl']} | "
                f"{row['layout']} | {int(row['tf32'])} | {row['seconds'] * 1e3:.2f} | {row['tflops']:.3f} |"
            )
    return "\n".join(lines)


def demo_table() -> str:
    """README's demo table: what `make demo` printed (docs/demo-results.json, scripts/demo_record.py), the machine
    it ran on, and what is stable over seeds."""
    path = os.path.join(ROOT, "docs", "demo-results.json")
    if not os.path.exists(path):
        return "Not recorded yet (`make demo-record` records it)."
    with open(path) as f:
        d = json.load(f)
    m = d["machine"]
    lines = [
        f"What `{d['command']}` printed on {m.get('cpu', 'a CPU')} ({m.get('cores', '?')} cores, "
        f"{m['threads']} threads), torch {m['torch']}, Python {m['python']}, fedfast commit "
        f"`{m['commit'][:12]}` ({d['date']}; `docs/demo-results.json`, `scripts/demo_record.py`):",
        "",
    ]
    lines += d["table"]
    lines += ["", "Other CPUs print other last digits: float sums run in another order (vectorisation, threads)."]
    seeds = d.get("seeds")
    if seeds:
        fin = seeds["final_accuracy"]
        ns = sorted(fin, key=int)
        methods = list(dict.fromkeys(k for s_ in ns for k in fin[s_]))
        always = [
            f"{a} above {b}"
            for a in methods
            for b in methods
            if a != b
            and all(fin[s_].get(a) is not None and fin[s_].get(b) is not None and fin[s_][a] > fin[s_][b] for s_ in ns)
        ]
        spread = {mth: [100 * fin[s_][mth] for s_ in ns if mth in fin[s_]] for mth in methods}
        lo, hi = min(min(v) for v in spread.values()), max(max(v) for v in spread.values())
        width = max(max(v) - min(v) for v in spread.values())
        lines += [
            "",
            f"What is stable is not seed {ns[0]}'s digits but the spread over seeds. Over seeds "
            f"{ns[0]}-{ns[-1]} (`{seeds['command']}`), the final accuracies lie between {lo:.1f} and "
            f"{hi:.1f} %, and one method's range is up to {width:.1f} points wide. In every seed: "
            + (", ".join(always) if always else "no ordering of two methods holds in every seed")
            + "; the other orderings change from seed to seed.",
            "",
        ]
        lines += seeds["table"]
    return "\n".join(lines)


def _pytest_json(name: str) -> tuple[str, dict]:
    path = os.path.join(RESULTS, name)
    with open(path) as f:
        return os.path.relpath(path, ROOT), json.load(f)


def provenance(name: str) -> str:
    """A pytest-benchmark JSON's machine, commit, date and command, in one sentence."""
    path, d = _pytest_json(name)
    mi, ci = d.get("machine_info", {}), d.get("commit_info", {})
    cpu = (mi.get("cpu") or {}).get("brand_raw") or mi.get("processor") or "?"
    count = (mi.get("cpu") or {}).get("count")
    torch_v = next((b["extra_info"].get("torch") for b in d["benchmarks"] if b["extra_info"].get("torch")), None)
    files = sorted({b["fullname"].split("::")[0] for b in d["benchmarks"]})
    commit = f"`{ci['id'][:12]}`" + (" with uncommitted changes" if ci.get("dirty") else "") if ci.get("id") else "?"
    gpu = (
        next((b["extra_info"].get("device_name") for b in d["benchmarks"] if b["extra_info"].get("device_name")), None)
        if any(b["extra_info"].get("device") == "cuda" for b in d["benchmarks"])
        else None
    )
    if gpu is None and any(b["extra_info"].get("device") == "cuda" for b in d["benchmarks"]):
        gpu = name.split("-flat")[0].split(".json")[0]  # the file is named after the GPU (gpu_check.sh)
    if gpu:
        cpu = f"{gpu} (host: {cpu}"
        count = f"{count} logical CPUs)" if count else None
    return (
        f"Measured on {cpu}"
        + (f" ({count} logical CPUs)" if count and not gpu else (f", {count}" if count else (")" if gpu else "")))
        + f", Python "
        f"{mi.get('python_version', '?')}" + (f", torch {torch_v}" if torch_v else "") + f"; fedfast commit "
        f"{commit}, {d.get('datetime', '?')[:10]}. Command: `python -m pytest {' '.join(files)} "
        f"--benchmark-only`; data: `{path}`."
    )


def tune_table(name: str = "nvidia-h100-80gb-hbm3-tune.json") -> str:
    """benchmarks/tune_conv.py: each convolution kernel alone, cuDNN's grouped call against the implicit GEMM with
    the shipped tile (the sweep's first candidate) and with the sweep's fastest valid tile."""
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return f"Not measured yet: `{os.path.relpath(path, ROOT)}` is not committed."
    with open(path) as f:
        d = json.load(f)
    from tune_conv import CANDIDATES

    lines = [
        f"Measured on {_machine(d['machine'])}. Command: `python benchmarks/{d['command']}`; data: "
        f"`{os.path.relpath(path, ROOT)}`. Each kernel alone, median of 10 timed calls; every result within "
        f"the TF32 bound of a float64 reference (largest relative error "
        f"{max(r['rel_err_fp64'] for r in d['rows'] if 'seconds' in r):.1e}).",
        "",
        "| layer (clients, batch, Cin->Cout, HxW, kernel) | kernel | cuDNN grouped | implicit GEMM, shipped tile | "
        "implicit GEMM, fastest tile (tile) |",
        "|---|---|---|---|---|",
    ]
    cells = {}
    for r in d["rows"]:
        if "seconds" in r and r.get("ok", True):
            cells.setdefault((r["layer"], r["kind"]), []).append(r)
    for (layer, kind), rows in cells.items():
        n, B, ci, co, H, k, s_, p_ = rows[0]["geometry"]
        cud = next((r for r in rows if r["impl"] == "cudnn"), None)
        tri = [r for r in rows if r["impl"] == "triton"]
        ship = next((r for r in tri if tuple(r["config"]) == tuple(CANDIDATES[kind][0])), None)
        best = min(tri, key=lambda r: r["seconds"]) if tri else None
        fmt = lambda r: "-" if r is None else f"{r['seconds'] * 1e3:.3f} ms ({r['tflops']:.1f} TFLOP/s)"
        lines.append(
            f"| {layer} ({n}, {B}, {ci}->{co}, {H}x{H}, {k}x{k}) | {kind} | {fmt(cud)} | {fmt(ship)} | "
            f"{fmt(best)}{' ' + str(tuple(best['config'])) if best else ''} |"
        )
    return "\n".join(lines)


def gpu_ops_table(losses: str = "nvidia-h100-80gb-hbm3.json", flat: str = "nvidia-h100-80gb-hbm3-flat.json") -> str:
    """bench_distill / bench_flat on a GPU: each fused op's effective bandwidth (its minimum bytes over its median
    time) as a share of the copy bandwidth measured in the losses' run."""
    out, copy = [], None
    rows = []
    for name in (losses, flat):
        if not os.path.exists(os.path.join(RESULTS, name)):
            return f"Not measured yet: `benchmarks/results/{name}` is not committed."
        path, d = _pytest_json(name)
        out.append(provenance(name))
        for b in d["benchmarks"]:
            e = b["extra_info"]
            copy = copy or e.get("copy_gbps")
            rows.append((e, b["stats"]["median"]))
    lines = [
        " ".join(out),
        "",
        f"Copy bandwidth measured in the losses' run: {copy:.0f} GB/s (bytes read + written).",
        "",
        "| op | shape | implementation | median | GB/s | % of copy |",
        "|---|---|---|---|---|---|",
    ]
    for e, med in rows:
        if "loss" in e:
            op, shape = f"loss {e['loss']} (fwd+bwd)", f"R={e['R']}, C={e['C']}"
        else:
            op, shape = e["op"], f"N={e['N']}, P={e['P']:,}"
        lines.append(
            f"| {op} | {shape} | {e['impl']} | {_ms(med)} | {e['gbps']:.0f} | {100 * e['gbps'] / copy:.0f} % |"
        )
    return "\n".join(lines)


def _own_json(name: str, command: str) -> tuple[dict | None, str]:
    """A JSON written by fedfast's own benchmark scripts (a ``machine`` dict, no pytest-benchmark) and the sentence
    saying where, when and how it was measured; ``(None, "Not measured yet ...")`` when it is not committed."""
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return None, f"Not measured yet: `{os.path.relpath(path, ROOT)}` is not committed."
    with open(path) as f:
        d = json.load(f)
    m = d["machine"]
    return d, (
        f"Measured on {m['cpu']}, {m['cores']} cores, {m['threads']} threads; torch {m['torch']}, Python "
        f"{m['python']}; fedfast commit `{m['commit'][:12]}`, {m['date']}. Command: `{command}`; data: "
        f"`{os.path.relpath(path, ROOT)}`."
    )


def authors_table(name: str = "cpu-2core-amd-epyc-authors.json") -> str:
    """``fedfast bench``: each loss against its authors' code, eager and compiled, time and peak memory."""
    d, head = _own_json(name, "fedfast bench --out ...")
    if d is None:
        return head
    lines = [
        f"{head} Forward + backward, median; peak memory is the growth of the "
        f"peak resident set in a fresh process, in units of one logits buffer (R x C x 4 bytes; shown from 4 MB of "
        f"logits, below which it is page-granular noise).",
        "",
        "| loss | R x C | authors' code | fedfast | x authors | authors compiled | x compiled | peak memory: "
        "authors / fedfast / compiled |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def ms(v):
        return f"{v * 1e3:.3f} ms" if v < 1 else f"{v:.2f} s"

    for r in d["rows"]:
        s_ = r["seconds"]
        pk = (r.get("peak_bytes") or {}) if r["logits_bytes"] >= 4 << 20 else {}  # smaller: page-granular noise
        mem = (
            " / ".join(
                "-" if pk.get(k) is None else f"{pk[k] / r['logits_bytes']:.2f}"
                for k in ("authors", "fedfast", "authors_compiled")
            )
            if pk
            else "-"
        )
        comp = s_.get("authors_compiled")
        lines.append(
            f"| {r['loss']} | {r['R']} x {r['C']} | {ms(s_['authors'])} | {ms(s_['fedfast'])} | "
            f"{r['speedup_vs_authors']:.2f} | {ms(comp) if comp else '-'} | "
            f"{r['speedup_vs_compiled']:.2f} | {mem} |"
            if comp
            else f"| {r['loss']} | {r['R']} x {r['C']} | {ms(s_['authors'])} | {ms(s_['fedfast'])} | "
            f"{r['speedup_vs_authors']:.2f} | - | - | {mem} |"
        )
    return "\n".join(lines)


def linear_table(name: str = "cpu-2core-intel-xeon-linear-kd.json") -> str:
    """``fedfast bench``'s LinearKDLoss rows: the fused layer + loss against F.linear + KDLoss and F.linear + the
    authors' lines, forward + backward time and peak memory beyond the inputs and beyond the outputs too."""
    d, head = _own_json(name, "fedfast bench --linear-only --out ...")
    if d is None:
        return head
    if not d.get("linear"):
        return head + " (no LinearKDLoss rows in it)"
    lines = [
        f"{head} Forward + backward (median of the timed calls, each implementation in its own process, "
        f"the teacher given as logits); peak memory: the growth of the peak resident set over the inputs, in "
        f"logits buffers (R x V x 4 bytes), and that growth less the outputs (the gradients of the hidden "
        f"states and the weight, which every implementation returns).",
        "",
        "| R x H x V | logits buffer | implementation | forward + backward | x fused | GFLOP/s (3 GEMMs) | "
        "peak growth | beyond outputs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in d["linear"]:
        L = r["logits_bytes"]
        fused = r["cases"]["fused"].get("median_s")
        for impl in ("fused", "unfused", "authors"):
            c = r["cases"][impl]
            shape = f"{r['R']} x {r['H']} x {r['V']}" if impl == "fused" else ""
            size = f"{L / 2**30:.2f} GiB" if impl == "fused" else ""
            if "median_s" not in c:
                lines.append(f"| {shape} | {size} | {impl} | not measured: {c.get('error', '?')[:60]} | | | | |")
                continue
            rel = f"{c['median_s'] / fused:.2f}" if fused else "-"
            lines.append(
                f"| {shape} | {size} | {impl} | {c['median_s']:.2f} s | {rel} | "
                f"{r['flops'] / c['median_s'] / 1e9:.0f} | {c['peak_bytes'] / L:.2f} | "
                f"{c['beyond_outputs_logits']:.2f} |"
            )
    return "\n".join(lines)


LIGER_LABELS = {
    "fedfast": "fedfast LinearKDLoss (fused kernels)",
    "fedfast_options": "fedfast LinearKDLoss, options' rows (`jsd_beta`, `return_terms`)",
    "liger": "Liger LigerFusedLinearJSDLoss, compiled=False",
    "liger_compiled": "Liger LigerFusedLinearJSDLoss, compiled=True",
    "unfused": "F.linear + fedfast KDLoss",
    "torch": "F.linear + F.cross_entropy + the divergence in PyTorch ops",
}


def liger_table(name: str = "cpu-2core-amd-epyc-liger.json") -> str:
    """``benchmarks/liger_compare.py``: LinearKDLoss against Liger-Kernel's chunked loss and F.linear + the loss."""
    d, head = _own_json(name, "python benchmarks/liger_compare.py --out ...")
    if d is None:
        return head
    lines = [
        f"{head} Liger-Kernel {d.get('liger_kernel')}. Forward + backward, median of the timed calls, each case in "
        f"its own process; peak memory: the growth of the peak resident set over the inputs, in logits buffers "
        f"(R x V x 4 bytes), and that growth less the outputs (the gradients of the hidden states and the weight).",
        "",
        "| R x H x V | beta | implementation | forward + backward | x Liger (compiled=False) | peak growth | "
        "beyond outputs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        ref = r["cases"].get("liger", {}).get("median_s")
        first = True
        for k, c in r["cases"].items():
            shape = f"{r['R']} x {r['H']} x {r['V']}" if first else ""
            beta = f"{r['beta']:g}" if first else ""
            first = False
            if "median_s" not in c:
                lines.append(
                    f"| {shape} | {beta} | {LIGER_LABELS[k]} | not measured: {c.get('error', '?')[:60]} | | | |"
                )
                continue
            rel = f"{ref / c['median_s']:.2f}" if ref else "-"
            lines.append(
                f"| {shape} | {beta} | {LIGER_LABELS[k]} | {c['median_s']:.2f} s | {rel} | {c['peak_logits']:.2f} | "
                f"{c['beyond_outputs_logits']:.2f} |"
            )
    return "\n".join(lines)


def zoo_table(name: str = "cpu-2core-amd-epyc-zoo.json") -> str:
    """``benchmarks/zoo_executors.py``: torchvision's models, one FedAvg round: traced program, vmap, plain loop."""
    d, head = _own_json(name, "python benchmarks/zoo_executors.py --clients 8 --out ...")
    if d is None:
        return head
    st = d["settings"]
    lines = [
        f"{head} FedAvg, {st['clients']} clients x {st['samples']} samples (3x32x32, 10 classes), one epoch at "
        f"B = {st['batch']}, SGD momentum 0.9; median of {st['reps']} rounds after a warm-up.",
        "",
        "| model | parameters | GFLOP / round | engine (traced program) | engine on vmap | plain loop | "
        "x vmap | x plain loop |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(c):
        if "median_s" in c:
            return f"{c['median_s']:.2f} s ({c['gflops_per_s']:.1f} GFLOP/s)"
        return f"fails: {c.get('error', '?').split(': ', 1)[-1][:70]}"

    for model, r in d["models"].items():
        e, v, p = r["engine"], r["vmap"], r["plain_loop"]
        ratio = [f"{o['median_s'] / e['median_s']:.2f}" if "median_s" in o and "median_s" in e else "-" for o in (v, p)]
        lines.append(
            f"| {model} | {r['params'] / 1e6:.1f} M | {r['round_flops'] / 1e9:.0f} | {cell(e)} | {cell(v)} | "
            f"{cell(p)} | {ratio[0]} | {ratio[1]} |"
        )
    return "\n".join(lines)


PEER_LABELS = {
    "cnn_1000x60": "FedAvg, simple_cnn, 1000 × 60, 50/round, B=10",
    "cnn_100x600": "same, 100 × 600, 10/round, B=50",
    "wrapped_cnn_1000x60": "same model wrapped in a module, 1000 × 60",
    "mlp_1000x60": "FedAvg, MLP 784-200-200-10, 1000 × 60, B=10",
    "fedntd_cnn_100x600_e5": "FedNTD (β=1, τ=1), simple_cnn, 100 × 600, B=50, E=5, momentum 0.9",
    "resnet8_cifar": "FedAvg, ResNet-8 (GN), synthetic 3×32×32, 200 × 50, 20/round, B=10",
}


def peers_table(name: str = "cpu-2core-amd-epyc-peers.json") -> str:
    """bench_peers: engine vs plain loop per shape, their FLOP-roofline shares, and the whole commands."""
    path, d = _pytest_json(name)
    rows = {b["extra_info"]["shape"]: b["extra_info"] for b in d["benchmarks"] if "engine_s" in b["extra_info"]}
    whole: dict = {}
    for b in d["benchmarks"]:
        e = b["extra_info"]
        if "engine_command_s" in e:
            whole.setdefault(e["shape"], {})[e["workers"]] = e
    lines = [
        provenance(name),
        "",
        "| shape | plain loop s/round | fedfast s/round | × loop | fedfast % of FLOP roofline (loop's) | "
        "whole command, 5 rounds: loop → fedfast |",
        "|---|---|---|---|---|---|",
    ]
    for shape, e in rows.items():
        own = " of the loop's FLOPs" if shape.startswith("fedntd") else ""  # the engine caches the teacher
        share = f"{100 * e['engine_roofline']:.0f} %{own} ({100 * e['loop_roofline']:.0f} %)"
        if e["engine_bandwidth_roofline"] > 0.25:
            share += f"; {100 * e['engine_bandwidth_roofline']:.0f} % of the bandwidth roofline"
        w = whole.get(shape, {})
        cmd = ""
        if 1 in w:
            cmd = f"{w[1]['loop_command_s']:.1f} s → {w[1]['engine_command_s']:.1f} s"
            if 2 in w:
                cmd += f" (2 workers: {w[2]['engine_command_s']:.1f} s)"
        lines.append(
            f"| {PEER_LABELS.get(shape, shape)} | {e['loop_s']:.3g} | {e['engine_s']:.3g} | "
            f"{e['speedup']:.2f} | {share} | {cmd} |"
        )
    return "\n".join(lines)


METHOD_NOTES = {
    "fedcurv": " (+ Fisher pass)",
    "fedsam": " (2 passes)",
    "fedspeed": " (2 passes)",
    "fedgen": " (+ 50 generator steps)",
    "fedgkd_plus": " (projection head)",
}


def methods_table(name: str = "cpu-2core-amd-epyc-methods.json") -> str:
    """bench_methods: each comparison method against its literal loop."""
    path, d = _pytest_json(name)
    lines = [
        provenance(name),
        "",
        "| method | loop s/round | fedfast s/round | × loop | GFLOP/round | fedfast / loop share of sgemm |",
        "|---|---|---|---|---|---|",
    ]
    for b in d["benchmarks"]:
        e = b["extra_info"]
        star = "*" if e["method"] in ("fedsam+asd", "fedspeed+asd") else ""  # the loop's teacher in both passes
        lines.append(
            f"| {e['method']}{METHOD_NOTES.get(e['method'], '')} | {e['loop_s']:.2f} | {e['engine_s']:.2f} "
            f"| {e['speedup']:.2f} | {e['round_flops'] / 1e9:.0f}{star} | "
            f"{e['engine_roofline']:.2f}{star} / {e['loop_roofline']:.2f} |"
        )
    return "\n".join(lines)


def population_table(name: str = "cpu-2core-amd-epyc-population.json") -> str:
    """bench_population: K clients of which 1000 train per round, FedAvg and SCAFFOLD (issue 38)."""
    d, head = _own_json(name, "python benchmarks/bench_population.py --out ...")
    if d is None:
        return head
    lines = [
        f"{head} Set-up: the synthetic data and the compact partition; s/round: the mean after the first round; "
        f"parameters: FedAvg's MLP 32-64-10, SCAFFOLD's 32-1280-10 (55,050, 20 rounds x 1000 clients write 4.4 GB "
        f"of control variates); store: `state_store`; state in memory: the rows in use and the client map; on "
        f"disk: the rows written to the file.",
        "",
        "| K | samples/client | method | parameters | rounds | store | set-up s | init s | s/round | "
        "peak RSS GB | data GB | state GB in memory / on disk (clients with a row) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        store = r.get("state_store", "auto")
        if "error" in r:
            lines.append(
                f"| {r['K']:,} | {r['samples_per_client']} | {r['algorithm']} | | {r['rounds']} | {store} | "
                f"failed: {r['error'][-80:]} | | | | | |"
            )
            continue
        lines.append(
            f"| {r['K']:,} | {r['samples_per_client']} | {r['algorithm']} | {r['num_params']:,} | "
            f"{r['rounds']} | {store} | {r['setup_s']:.2f} | {r['init_s']:.2f} | {r['s_per_round']:.3f} | "
            f"{r['peak_rss_bytes'] / 2**30:.2f} | {r['data_bytes'] / 2**30:.2f} | "
            f"{r['state_bytes'] / 2**30:.3f} / {r.get('state_file_bytes', 0) / 2**30:.3f} "
            f"({r['state_rows']:,}) |"
        )
    return "\n".join(lines)


TABLES = {
    "demo": demo_table,
    "population": population_table,
    "conv-kernels-gpu": tune_table,
    "losses-authors": authors_table,
    "losses-authors-xeon": lambda: authors_table("cpu-2core-intel-xeon-authors.json"),
    "losses-authors-1thread": lambda: authors_table("cpu-2core-amd-epyc-authors-1thread.json"),
    "linear-kd": linear_table,
    "liger": liger_table,
    "zoo": zoo_table,
    "ops-gpu": gpu_ops_table,
    "peers": peers_table,
    "methods": methods_table,
    "rounds-gpu": lambda: rounds_full(_load("*-rounds*.json"), "cuda"),
    "rounds-cpu": lambda: rounds_full(_load("cpu-*-rounds*.json"), "cpu"),
    "rounds-gpu-short": lambda: rounds_short(_load("*-rounds*.json"), "cuda"),
    "rounds-cpu-short": lambda: rounds_short(_load("cpu-*-rounds*.json"), "cpu"),
    "conv-cpu": lambda: conv_table(_load("cpu-*-conv.json"), "cpu"),
    "conv-gpu": lambda: conv_table(
        [(p, r) for p, r in _load("*-conv.json") if not p.split("/")[-1].startswith("cpu")], "cuda"
    ),
}
_MARK = re.compile(r"(<!-- table:(?P<name>[\w.:-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)


def render(text: str) -> str:
    def sub(m):
        name = m.group("name")
        if name.startswith("prov:"):  # the provenance sentence of a committed pytest-benchmark JSON
            if not os.path.exists(os.path.join(RESULTS, name[5:])):
                raise SystemExit(f"tables.py: {name}: no such file in benchmarks/results")
            return m.group(1) + provenance(name[5:]) + "\n" + m.group(4)
        if name not in TABLES:
            raise SystemExit(f"tables.py: unknown table {name!r} (known: {', '.join(TABLES)}, prov:FILE)")
        return m.group(1) + TABLES[name]() + "\n" + m.group(4)

    return _MARK.sub(sub, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is out of date")
    a = ap.parse_args(argv)
    stale = []
    for rel in FILES:
        path = os.path.join(DOC_ROOT, rel)
        with open(path) as f:
            old = f.read()
        new = render(old)
        if new != old:
            stale.append(rel)
            if not a.check:
                tmp = path + ".tmp"
                with open(tmp, "w") as f:
                    f.write(new)
                os.replace(tmp, path)
    if a.check and stale:
        print(f"tables.py: out of date (run python benchmarks/tables.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
