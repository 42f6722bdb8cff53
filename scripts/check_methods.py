"""Check a study of every method at its defaults (``make check-methods``; examples/study/methods-at-defaults.toml).

    python scripts/check_methods.py runs/methods-at-defaults [--points 10]

For each method row: its final test accuracy (mean over seeds), its diverged runs, and its distance below FedAvg's.
A method that diverges, or ends more than ``--points`` below FedAvg, must say so itself: its class's ``caveats``
(printed by ``fedfast methods NAME``) name the settings and the option to change, and its ``check_settings`` warns
for the run's settings (checked here on the run's own config.json). Exit status 1 when a method fails without a
caveat or without that warning. The table printed is the one ``docs/methods.md`` holds.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _warns(st, method: str) -> bool:
    """Whether building one of the method's runs again (its config.json: data, model, the Simulation; no round)
    gives the method's RuntimeWarning, as the run itself did before its first round."""
    import warnings

    from fedfast.assemble import build
    from fedfast.config import build_config

    run = next(r for r in st.runs if r["config"]["algorithm"] == method)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        build(build_config(os.path.join(run["dir"], "config.json")))
    return any(issubclass(w.category, RuntimeWarning) and str(w.message).startswith(f"{method}: ") for w in got)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", help="the study directory (fedfast sweep --out)")
    ap.add_argument("--points", type=float, default=10.0, help="how far below FedAvg's final accuracy fails")
    a = ap.parse_args(argv)
    from fedfast import methods
    from fedfast.study import load_studies, study_rows

    st = load_studies([a.study])[0]
    rows = [r for r in study_rows(st) if not r["point"]]
    by = {r["method"]: r for r in rows}
    if "fedavg" not in by:
        raise SystemExit(f"check_methods: {a.study} has no FedAvg row to compare with")
    ref = by["fedavg"]["final_test_accuracy"][0]
    bad = 0
    lines = [
        "| method | final acc % | best acc % | last-10 mean % | final - FedAvg | diverged | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["method"]
        fin = r["final_test_accuracy"][0]
        gap = None if fin is None else 100 * (fin - ref)
        fails = bool(r["diverged"]) or gap is None or gap < -a.points
        cls = methods.get(m)
        caveat = (getattr(cls, "caveats", "") or "").strip()
        if not fails:
            verdict = "ok"
        elif not caveat:
            verdict = "FAILS, no caveat"
            bad += 1
        elif not _warns(st, m):
            verdict = "FAILS: caveat, but no warning for these settings"
            bad += 1
        else:
            verdict = "below FedAvg: its caveat, and a warning"
        fmt = lambda k: "–" if r[k][0] is None else f"{100 * r[k][0]:.2f} ± {100 * (r[k][1] or 0):.2f}"  # noqa: E731
        lines.append(
            f"| {m} | {fmt('final_test_accuracy')} | {fmt('best_test_accuracy')} | "
            f"{fmt('mean_last10_test_accuracy')} | {'–' if gap is None else f'{gap:+.2f}'} | "
            f"{len(r['diverged'])} of {r['runs']} | {verdict} |"
        )
    print("\n".join(lines))
    print(
        f"\nFedAvg final: {100 * ref:.2f} %; a method fails when it diverges or ends more than {a.points:g} points "
        f"below. {bad} undocumented failure(s)."
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
