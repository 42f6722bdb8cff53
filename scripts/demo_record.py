"""Record what ``make demo`` printed, for the README's generated demo table (``benchmarks/tables.py``).

    python scripts/demo_record.py runs/demo runs/demo-seeds --out docs/demo-results.json

``runs/demo``: the study ``make demo`` writes (seed 0); its report table is kept verbatim, as the sweep printed
it. ``runs/demo-seeds``: the same preset over several seeds (``make demo-record`` runs ``fedfast sweep --preset
demo/mnist-shards --seeds 0,1,2,3,4``): its report and every run's final accuracy say what is stable across
seeds and what is not. The record names the CPU, the threads, torch, Python and the fedfast commit the runs
were made at (from their own provenance). Written atomically.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _table(text: str) -> list[str]:
    """The Markdown table of a report (its header row to its last row)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| method"))
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[start:end]


def _runs(d: str) -> list[dict]:
    from fedfast.study import load_run, run_dirs

    return [load_run(r) for r in run_dirs(d)]


def record(demo: str, seeds: str | None) -> dict:
    import torch
    from bench_rounds import machine

    from fedfast.study import report

    runs = _runs(demo)
    if not runs:
        raise SystemExit(f"demo_record: {demo} holds no runs (run `make demo` first)")
    vers = runs[0].get("versions") or {}
    m = machine(torch.device("cpu"))
    m.update(
        commit=vers.get("commit") or "unknown",
        torch=vers.get("torch", m["torch"]),
        python=vers.get("python", m["python"]),
        threads=(runs[0]["config"].get("determinism") or {}).get("threads", m["threads"]),
    )
    out = {
        "command": "make demo",
        "machine": m,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "table": _table(report(demo)[0]),
    }
    if seeds:
        finals: dict = {}
        for r in _runs(seeds):
            finals.setdefault(str(r["config"]["seed"]), {})[r["config"]["algorithm"]] = r["final_test_accuracy"]
        out["seeds"] = {
            "command": f"fedfast sweep --preset demo/mnist-shards --seeds "
            f"{','.join(sorted(finals, key=int))} --out {seeds}",
            "table": _table(report(seeds)[0]),
            "final_accuracy": finals,
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("demo", help="the study directory of `make demo` (runs/demo)")
    ap.add_argument("seeds", nargs="?", help="the same preset over several seeds (runs/demo-seeds)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "demo-results.json"))
    a = ap.parse_args(argv)
    from fedfast._io import write_atomic

    write_atomic(a.out, json.dumps(record(a.demo, a.seeds), indent=1) + "\n")
    print(f"wrote {a.out}; now run: python benchmarks/tables.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
