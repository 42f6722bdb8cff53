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

import contextlib
import json
import math
import os
import sys

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
    """A run's summary.json with its config.json (``config``); ValueError naming a damaged file."""
    from .rundir import read_json
    s = read_json(os.path.join(d, "summary.json"), "summary")
    c = read_json(os.path.join(d, "config.json"), "config")
    for path, obj, key in (("summary.json", s, "rounds"), ("config.json", c, "algorithm")):
        if not isinstance(obj, dict) or key not in obj:
            raise ValueError(f"{os.path.join(d, path)}: damaged (expected a JSON object with {key!r})")
    s["config"] = c
    s["dir"] = d
    s.setdefault("status", "complete" if s.get("complete") else "incomplete")
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
        from .rundir import read_json
        study = read_json(os.path.join(root, STUDY), "study")
        if not isinstance(study, dict):
            raise ValueError(f"{os.path.join(root, STUDY)}: damaged (expected a JSON object)")
    preset = None
    if study.get("preset"):
        from . import presets
        preset = presets.get(study["preset"])
        if not preset.reported:  # a protocol without paper numbers (the demo): no paper columns
            preset = None
    order = study.get("methods") or []
    if not isinstance(order, list):
        raise ValueError(f"{os.path.join(root, STUDY)}: damaged (methods is not a list)")
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["config"]["algorithm"], []).append(r)
    names = [m for m in order if m in groups] + sorted(m for m in groups if m not in order)
    rows = []
    for m in names:
        every = groups[m]
        g = [r for r in every if r["status"] != "diverged"]  # diverged runs: counted, not averaged
        div = sorted(((r["config"]["seed"], r.get("diverged_round")) for r in every if r["status"] == "diverged"),
                     key=lambda x: (x[0] is None, x))
        row = {"method": m, "seeds": sorted(r["config"]["seed"] for r in g), "complete": all(r["complete"] for r in g),
               "rounds": min((r["rounds"] for r in g), default=None), "diverged": div, "runs": len(every)}
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
        tag = "" if r["complete"] else " (incomplete)"
        if r["diverged"]:
            tag += (f" ({len(r['diverged'])} of {r['runs']} diverged: "
                    + ", ".join(f"seed {s} at round {d}" for s, d in r["diverged"]) + "; not in the mean)")
        cells = [r["method"] + tag, ",".join(map(str, r["seeds"])) or "–",
                 str(r["rounds"]) if r["rounds"] is not None else "–", _fmt(*r["final_test_accuracy"]), _fmt(*r["best_test_accuracy"]),
                 _fmt(*r["mean_last10_test_accuracy"]), _fmt(*r["final_forgetting"], scale=1.0, digits=4),
                 _fmt(*r["wall_seconds"], scale=1.0, digits=1)]
        if preset is not None:
            p = r.get("paper")
            dagger = " †" if preset.reported_note else ""  # a Δ never stands bare where the cell has a note
            cells += [_fmt(p[0], p[1], scale=1.0) if p else "–",
                      f"{r['delta']:+.2f}{dagger}" if r.get("delta") is not None else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    dev = sorted({str(r.get("device")) for r in runs})
    nd = sum(len(r["diverged"]) for r in rows)
    lines += ["", f"{len(runs)} runs; device {', '.join(dev)}; mean ± sample std over seeds"
              + (f"; {nd} diverged run{'s' if nd > 1 else ''} left out of the means (marked)." if nd else ".")]
    if preset is not None and preset.reported_note:
        lines += ["", f"† On the paper's numbers of this cell: {preset.reported_note}"]
    lines += ["", "Runs (provenance):", ""] + [f"- {_provenance(r, root)}" for r in runs]
    if preset is not None and preset.notes:
        lines += ["", "Protocol: " + " ".join(preset.notes.split())]
    text = "\n".join(lines) + "\n"
    write_atomic(os.path.join(root, "report.md"), text)
    return text, rows


def _provenance(r: dict, root: str) -> str:
    v = r.get("versions") or {}
    rel = os.path.relpath(r["dir"], root)
    return (f"`{rel}`: {r['status']}, fedfast {v.get('fedfast', '?')}"
            + (f" (commit {v['commit']})" if v.get("commit") else "")
            + f", torch {v.get('torch', '?')}, python {v.get('python', '?')}, device {r.get('device', '?')}")


def sweep(out: str, methods: list[str], seeds: list[int], *, preset: str | None = None, config: str | None = None,
          overrides: list[str] | None = None, plugins=(), quiet: bool = False, workers: int = 1) -> list[str]:
    """Run every (method, seed) into ``out/<method>/seed<k>``; finished runs (complete or diverged) are skipped,
    interrupted ones resumed. Each run is taken under its directory's lock, so several ``fedfast sweep`` processes
    on one study (on one machine or several sharing the filesystem) split its runs between them: a run another
    process holds is skipped at once. A run that diverges is recorded (its summary says so) and the sweep goes on.
    Every config is validated before anything is written. Returns the run directories."""
    from .cli import run, run_workers
    from .config import build_config
    from .rundir import RunLocked, read_json, status
    from .runner import RunDiverged
    from . import presets as _presets
    overrides = list(overrides or [])
    p = _presets.get(preset) if preset else None
    if not methods:
        if p is None:
            raise ValueError("--methods: which methods to run (a preset's rows are the default)")
        methods = p.methods
    seeds = list(seeds) if seeds else (p.seeds if p is not None else [0])
    spec = {"preset": preset, "config": os.path.abspath(config) if config else None, "methods": methods,
            "seeds": seeds, "overrides": overrides, "plugins": [os.path.abspath(x) for x in plugins]}
    path = os.path.join(out, STUDY)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out: {out} is a file, not a study directory")

    def merged(old: dict) -> dict:
        if not isinstance(old, dict):
            raise ValueError(f"{path}: damaged (expected a JSON object)")
        for k in ("preset", "config", "overrides"):
            if old.get(k) != spec[k]:
                raise ValueError(f"{out}: is a study with {k} = {old.get(k)!r}, not {spec[k]!r}; use another --out")
        return {**spec, "methods": old["methods"] + [m for m in methods if m not in old["methods"]],
                "seeds": old["seeds"] + [s for s in seeds if s not in old["seeds"]]}
    if os.path.isfile(path):
        merged(read_json(path, "study"))
    # every config is built (and so validated) before anything is written
    plan = []
    for m in methods:
        for s in seeds:
            base = p.config(m) if p is not None else {}
            cfg = build_config(config, [*overrides, f"algorithm={m}", f"seed={s}"], base=base, plugins=plugins)
            plan.append((m, s, cfg, os.path.join(out, m, f"seed{s}")))
    os.makedirs(out, exist_ok=True)
    with _study_lock(out):  # two sweeps on one study: one read-merge-write of study.json at a time
        spec_now = merged(read_json(path, "study")) if os.path.isfile(path) else spec
        write_atomic(path, json.dumps(spec_now, indent=2))
    dirs, held, diverged = [], [], []
    for i, (m, s, cfg, d) in enumerate(plan):
        label = f"[{i + 1}/{len(plan)}] {m} seed {s}"
        try:
            if workers > 1:
                done = run_workers(cfg, d, workers, mode="auto", quiet=quiet, label=label)
            else:
                done = run(cfg, d, mode="auto", quiet=quiet, label=label)
            if done is None and not quiet:
                print(f"{label}: {status(d)}, skipped", flush=True)
        except RunLocked as e:
            held.append(d)
            if not quiet:
                print(f"{label}: skipped, {e}", flush=True)
        except RunDiverged as e:
            diverged.append(d)
            print(f"{label}: {e}", file=sys.stderr, flush=True)
        dirs.append(d)
    if held and not quiet:
        print(f"{len(held)} run(s) were running in other processes; `fedfast sweep` again (or `fedfast report`) "
              f"once they end", flush=True)
    if diverged and not quiet:
        print(f"{len(diverged)} run(s) diverged; the report marks them and leaves them out of the means", flush=True)
    return dirs


@contextlib.contextmanager
def _study_lock(out: str):
    import fcntl
    fd = os.open(os.path.join(out, ".fedfast-study.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
