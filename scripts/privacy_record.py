"""docs/privacy.md's study record: the sweep of docs/studies/privacy-mnist.toml summarised into
docs/privacy-results.json (per method, mechanism and epsilon: final test accuracy of each seed, the epsilon spent and
the last clip) and docs/privacy-accuracy.png (accuracy against epsilon, mean and std over seeds; DP-FedAvg solid,
DP-FTRL dashed).

    fedfast sweep --preset docs/studies/privacy-mnist.toml --out runs/privacy-mnist --quiet
    python scripts/privacy_record.py runs/privacy-mnist
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CELLS = {
    "eps1": 1.0,
    "eps4": 4.0,
    "eps8": 8.0,
    "ftrl1": 1.0,
    "ftrl4": 4.0,
    "ftrl8": 8.0,
    "inf": float("inf"),
}
LINES = {"DP-FedAvg": ("eps1", "eps4", "eps8", "inf"), "DP-FTRL": ("ftrl1", "ftrl4", "ftrl8", "inf")}


def collect(study: str) -> dict:
    out = {}
    for cell, eps in CELLS.items():
        for mdir in sorted(glob.glob(os.path.join(study, cell, "*", ""))):
            method = os.path.basename(os.path.dirname(mdir))
            rows = []
            for sdir in sorted(glob.glob(os.path.join(mdir, "seed*"))):
                with open(os.path.join(sdir, "summary.json")) as f:
                    s = json.load(f)
                with open(os.path.join(sdir, "metrics.jsonl")) as f:
                    last = json.loads(f.read().splitlines()[-1])
                rows.append(
                    {
                        "seed": s["seed"],
                        "final_test_accuracy": s["final_test_accuracy"],
                        "dp_epsilon": s.get("dp_epsilon"),
                        "last_clip": last.get("dp_clip"),
                        "commit": (s.get("versions") or {}).get("commit"),
                    }
                )
            accs = [r["final_test_accuracy"] for r in rows]
            out.setdefault(method, {})[cell] = {
                "target_epsilon": None if eps == float("inf") else eps,
                "mean": statistics.mean(accs),
                "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "runs": rows,
            }
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 3.6), dpi=120)
    xs = list(range(4))
    for i, (method, cells) in enumerate(res.items()):
        for mech, row in LINES.items():
            if not all(c in cells for c in row):
                continue
            m = [100 * cells[c]["mean"] for c in row]
            s = [100 * cells[c]["std"] for c in row]
            style = dict(color=f"C{i}", linestyle="-" if mech == "DP-FedAvg" else "--")
            ax.errorbar(xs, m, yerr=s, marker="o", capsize=3, label=f"{method}, {mech}", **style)
    ax.set_xticks(xs, ["1", "4", "8", "inf"])
    ax.set_xlabel("epsilon (delta = 1e-5)")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title("MNIST, 6000 clients, 600 a round, 60 rounds", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    study = argv[0] if argv else "runs/privacy-mnist"
    res = collect(study)
    out = os.path.join(ROOT, "docs", "privacy-results.json")
    with open(out + ".tmp", "w") as f:
        json.dump({"study": "docs/studies/privacy-mnist.toml", "results": res}, f, indent=1)
    os.replace(out + ".tmp", out)
    plot(res, os.path.join(ROOT, "docs", "privacy-accuracy.png"))
    for method, cells in res.items():
        print(method, {c: f"{100 * v['mean']:.2f} +- {100 * v['std']:.2f}" for c, v in cells.items()})


if __name__ == "__main__":
    main()
