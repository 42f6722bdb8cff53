"""Print a table from pytest-benchmark JSON files: the fused losses with speedups vs eager / compiled (the
files of one device may be given together, e.g. the main and the compiled-baseline runs), and a line per
other benchmark (flat ops, engine rounds) with its median and the extra_info it recorded.

    python benchmarks/summarize.py benchmarks/results/<file>.json [more.json ...]
"""

import json
import sys
from collections import defaultdict

_SHOW = (
    "shape",
    "impl",
    "N",
    "P",
    "gbps",
    "pct_of_copy",
    "train_seconds",
    "samples_per_s",
    "client_chunk",
    "dispatched_compute_ops",
    "max_memory_gb",
)


def main(paths):
    rows = defaultdict(dict)
    other = []
    for path in paths:
        for b in json.load(open(path))["benchmarks"]:
            e = b["extra_info"]
            if "loss" in e:
                rows[(e["loss"], e["R"], e["C"])][e["impl"]] = (b["stats"]["median"], e)
            else:
                other.append((b["name"], b["stats"]["median"], e))
    if rows:
        print(
            f"{'loss':10} {'R':>6} {'C':>6} {'impl':9} {'median ms':>10} {'GB/s':>8} {'%copy':>6} "
            f"{'x eager':>8} {'x compiled':>10}"
        )
    for (loss, R, C), impls in sorted(rows.items()):
        eager = impls.get("eager", (None,))[0]
        comp = impls.get("compiled", (None,))[0]
        for impl, (med, e) in sorted(impls.items(), key=lambda kv: kv[1][0]):
            xe = f"{eager / med:8.2f}" if eager else "       -"
            xc = f"{comp / med:10.2f}" if comp else "         -"
            print(
                f"{loss:10} {R:6d} {C:6d} {impl:9} {med * 1e3:10.3f} {e['gbps']:8.1f} {e['pct_of_copy']:6.1f} {xe} {xc}"
            )
    for name, med, e in other:
        shown = " ".join(f"{k}={round(e[k], 4) if isinstance(e[k], float) else e[k]}" for k in _SHOW if k in e)
        print(f"{name:60} median {med * 1e3:10.3f} ms  {shown}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
