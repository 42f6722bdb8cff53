"""Studies: many runs in one directory, and their report.

``fedfast sweep [--preset NAME | CONFIG.toml] --methods a,b,c --seeds 0,1,2 --out DIR`` runs the cross product
into ``DIR/<method>/seed<k>/`` (each a run directory, :mod:`fedfast.runner`): a complete run is skipped, an
interrupted one resumed from its checkpoint, so the same command continues a study. ``DIR/study.json`` records
the preset, methods, seeds and overrides.

``fedfast report DIR`` prints and writes ``DIR/report.md``: per method the number of seeds, final and best test
accuracy, the mean of the last 10 evaluations, forgetting and wall time, each as mean ± std over seeds (sample
std, n - 1), and, for a study made from a preset, the paper's number for that row beside the matching column.
"""
from __future__ import annotations

import json
import math
import os

from .checkpoint import write_atomic

STUDY = "study.json"


def run_dirs(root: str) -> list[str]:
    """Run directories (holding a summary.json) at or below ``root``, sorted."""
    out = []
    for d, _, files in os.walk(root):
        if "summary.json" in files and "config.json" in files:
            out.append(d)
    return sorted(out)


def load_run(d: str) -> dict:
    with open(os.path.join(d, "summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(d, "config.json")) as f:
        s["config"] = json.load(f)
    s["dir"] = d
    return s


def mean_std(xs: list) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1; None for fewer than 2 values) of the non-None values."""
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _fmt(m, s, scale=100.0, digits=2):
    if m is None:
        return "–"
    return f"{scale * m:.{digits}f}" + (f" ± {scale * s:.{digits}f}" if s is not None else "")


def report(root: str) -> tuple[str, list[dict]]:
    """The study's table as Markdown, and its rows (one per method)."""
    runs = [load_run(d) for d in run_dirs(root)]
    if not runs:
        raise ValueError(f"{root}: no finished or checkpointed runs (no summary.json below it)")
    study = {}
    if os.path.isfile(os.path.join(root, STUDY)):
        with open(os.path.join(root, STUDY)) as f:
            study = json.load(f)
    preset = None
    if study.get("preset"):
        from . import presets
        preset = presets.get(study["preset"])
        if not preset.reported:  # a protocol without paper numbers (the demo): no paper columns
            preset = None
    order = study.get("methods") or []
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["config"]["algorithm"], []).append(r)
    names = [m for m in order if m in groups] + sorted(m for m in groups if m not in order)
    rows = []
    for m in names:
        g = groups[m]
        row = {"method": m, "seeds": sorted(r["config"]["seed"] for r in g), "complete": all(r["complete"] for r in g),
               "rounds": min(r["rounds"] for r in g)}
        for key in ("final_test_accuracy", "best_test_accuracy", "mean_last10_test_accuracy", "final_forgetting",
                    "wall_seconds"):
            row[key] = mean_std([r.get(key) for r in g])
        if preset is not None and m in preset.reported:
            rep = preset.reported[m]
            row["paper"] = (rep[0], rep[1] if len(rep) > 1 else None)
            ours = row["best_test_accuracy" if preset.metric == "best" else "final_test_accuracy"][0]
            row["delta"] = 100 * ours - rep[0] if ours is not None else None
        rows.append(row)
    lines = []
    if preset is not None:
        lines += [f"# {preset.name}: {preset.paper}, {preset.table}", "",
                  f"The paper reports the **{preset.metric}** test accuracy; Δ = ours − paper on that column.", ""]
    else:
        lines += [f"# Study {os.path.basename(os.path.abspath(root))}", ""]
    head = ["method", "seeds", "rounds", "final acc %", "best acc %", "last-10 mean %", "forgetting", "wall s"]
    if preset is not None:
        head += ["paper %", "Δ"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["method"] + ("" if r["complete"] else " (incomplete)"), ",".join(map(str, r["seeds"])),
                 str(r["rounds"]), _fmt(*r["final_test_accuracy"]), _fmt(*r["best_test_accuracy"]),
                 _fmt(*r["mean_last10_test_accuracy"]), _fmt(*r["final_forgetting"], scale=1.0, digits=4),
                 _fmt(*r["wall_seconds"], scale=1.0, digits=1)]
        if preset is not None:
            p = r.get("paper")
            cells += [_fmt(p[0], p[1], scale=1.0) if p else "–",
                      f"{r['delta']:+.2f}" if r.get("delta") is not None else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    dev = sorted({r["device"] for r in runs})
    lines += ["", f"{len(runs)} runs; device {', '.join(dev)}; mean ± sample std over seeds."]
    if preset is not None and preset.notes:
        lines += ["", "Protocol: " + " ".join(preset.notes.split())]
    text = "\n".join(lines) + "\n"
    write_atomic(os.path.join(root, "report.md"), text)
    return text, rows


def sweep(out: str, methods: list[str], seeds: list[int], *, preset: str | None = None, config: str | None = None,
          overrides: list[str] | None = None, plugins=(), quiet: bool = False, workers: int = 1) -> list[str]:
    """Run every (method, seed) into ``out/<method>/seed<k>``; complete runs are skipped, interrupted ones resumed.
    Returns the run directories."""
    from .cli import run, run_workers
    from .config import build_config
    from .runner import is_complete
    from . import presets as _presets
    overrides = list(overrides or [])
    p = _presets.get(preset) if preset else None
    if not methods:
        if p is None:
            raise ValueError("--methods: which methods to run (a preset's rows are the default)")
        methods = p.methods
    seeds = list(seeds) if seeds else (p.seeds if p is not None else [0])
    os.makedirs(out, exist_ok=True)
    spec = {"preset": preset, "config": os.path.abspath(config) if config else None, "methods": methods,
            "seeds": seeds, "overrides": overrides, "plugins": [os.path.abspath(x) for x in plugins]}
    path = os.path.join(out, STUDY)
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        for k in ("preset", "config", "overrides"):
            if old.get(k) != spec[k]:
                raise ValueError(f"{out}: is a study with {k} = {old.get(k)!r}, not {spec[k]!r}; use another --out")
        spec["methods"] = old["methods"] + [m for m in methods if m not in old["methods"]]
        spec["seeds"] = old["seeds"] + [s for s in seeds if s not in old["seeds"]]
    # every config is built (and so validated) before the first run starts
    plan = []
    for m in methods:
        for s in seeds:
            base = p.config(m) if p is not None else {}
            cfg = build_config(config, [*overrides, f"algorithm={m}", f"seed={s}"], base=base, plugins=plugins)
            plan.append((m, s, cfg, os.path.join(out, m, f"seed{s}")))
    write_atomic(path, json.dumps(spec, indent=2))
    dirs = []
    for i, (m, s, cfg, d) in enumerate(plan):
        label = f"[{i + 1}/{len(plan)}] {m} seed {s}"
        if is_complete(d):
            if not quiet:
                print(f"{label}: complete, skipped", flush=True)
        else:
            resume = os.path.isfile(os.path.join(d, "checkpoint.pt"))
            if workers > 1:
                run_workers(cfg, d, workers, resume=resume, force=not resume, quiet=quiet, label=label)
            else:
                run(cfg, d, resume=resume, force=not resume, quiet=quiet, label=label)
        dirs.append(d)
    return dirs
