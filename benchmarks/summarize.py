"""Print a table (and speedups vs eager / compiled) from a pytest-benchmark JSON file.

    python benchmarks/summarize.py benchmarks/results/<file>.json
"""
import json
import sys
from collections import defaultdict


def main(path):
    data = json.load(open(path))
    rows = defaultdict(dict)
    for b in data["benchmarks"]:
        e = b["extra_info"]
        rows[(e["loss"], e["R"], e["C"])][e["impl"]] = (b["stats"]["median"], e)
    print(f"{'loss':10} {'R':>6} {'C':>6} {'impl':9} {'median ms':>10} {'GB/s':>8} {'%copy':>6} "
          f"{'x eager':>8} {'x compiled':>10}")
    for (loss, R, C), impls in sorted(rows.items()):
        eager = impls.get("eager", (None,))[0]
        comp = impls.get("compiled", (None,))[0]
        for impl, (med, e) in sorted(impls.items(), key=lambda kv: kv[1][0]):
            xe = f"{eager / med:8.2f}" if eager else "       -"
            xc = f"{comp / med:10.2f}" if comp else "         -"
            print(f"{loss:10} {R:6d} {C:6d} {impl:9} {med * 1e3:10.3f} {e['gbps']:8.1f} {e['pct_of_copy']:6.1f} "
                  f"{xe} {xc}")


if __name__ == "__main__":
    main(sys.argv[1])
