"""Write ``sensors.csv``: a small tabular data set for the own-data guide (docs/own-data.md).

A stand-in for a real federated table (readings from 24 sites, 12 numeric features, 4 classes): each row has a
``site`` (the user column the clients are split by), ``f0`` ... ``f11`` and a ``label``. Sites differ the way
real clients do: each has its own mix of labels (a Dirichlet draw) and its own offset on the features. The file
is the same on every machine (seeded), 4,800 rows, about 600 KB.

    python examples/own_data/make_sensors_csv.py [OUT.csv]     # default: examples/own_data/sensors.csv
"""

import csv
import os
import sys

import numpy as np

SITES, FEATURES, CLASSES, ROWS = 24, 12, 4, 4800


def main(out: str) -> None:
    rng = np.random.default_rng(2026)
    centers = rng.normal(0.0, 0.6, size=(CLASSES, FEATURES))  # what a class looks like
    site_mix = rng.dirichlet(np.full(CLASSES, 0.5), size=SITES)  # each site's label mix (non-IID)
    site_shift = rng.normal(0.0, 0.8, size=(SITES, FEATURES))  # each site's sensor offset
    sizes = rng.multinomial(ROWS - SITES * 40, np.full(SITES, 1 / SITES)) + 40  # every site >= 40 rows
    tmp = out + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["site", *[f"f{j}" for j in range(FEATURES)], "label"])
        for s in range(SITES):
            labels = rng.choice(CLASSES, size=sizes[s], p=site_mix[s])
            x = centers[labels] + site_shift[s] + rng.normal(0.0, 1.0, size=(sizes[s], FEATURES))
            for lab, row in zip(labels, x, strict=True):
                w.writerow([f"site{s:02d}", *[f"{v:.4f}" for v in row], int(lab)])
    os.replace(tmp, out)
    print(f"wrote {out}: {ROWS} rows, {SITES} sites, {FEATURES} features, {CLASSES} classes")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "sensors.csv"))
