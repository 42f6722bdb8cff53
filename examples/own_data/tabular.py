"""Your own data in fedfast: a CSV table, split into clients by one of its columns, trained with a model of your
own - a plug-in file, the worked example of docs/own-data.md.

It registers three entries a run configuration can then name, each with options of its own (a ``[name]`` table in
the config, as a method's options):

* ``dataset = "csv"``: a CSV file with a header; one column of integer class labels, one column naming the user
  (client) each row belongs to, every other column a numeric feature. ``[csv]``: ``path``, ``label_column``,
  ``group_column``, ``test_fraction``, ``split_seed``, ``standardize``.
* ``partition = "by_column"``: one client per distinct value of the group column (the number of clients is the
  data's, so ``num_clients`` is not read). ``[by_column]``: ``min_samples``.
* ``model = "tabular_mlp"``: an MLP sized to the feature rows. ``[tabular_mlp]``: ``hidden``, ``layers``.

    python examples/own_data/make_sensors_csv.py                       # writes examples/own_data/sensors.csv
    fedfast run examples/own_data/run.toml --out runs/own-data          # run.toml names this file in `plugins`
"""

import csv
import itertools
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedfast import data, models
from fedfast.methods import opt


# -- the dataset ---------------------------------------------------------------------------------------------
@dataclass
class CSVOptions:
    path: str = opt("sensors.csv", "the CSV file (a relative path: to the config or study file)", path=True)
    label_column: str = opt("label", "the column of integer class labels 0 .. C-1")
    group_column: str = opt("site", "the column naming the user (client) a row belongs to")
    test_fraction: float = opt(0.2, "the fraction of each group's rows held out as the test set", check="(0,1)")
    split_seed: int = opt(
        0, "seed of the train/test split (fixed: every run of a study tests on the same rows)", check=">=0"
    )
    standardize: bool = opt(True, "scale each feature to mean 0, std 1 (statistics of the training rows)")


def _read(o: CSVOptions):
    """The table's features [N, F] (float32), labels [N] and group names [N]; errors name the file and line."""
    if not os.path.isfile(o.path):
        raise FileNotFoundError(
            2, f"no such file; make it with `python examples/own_data/make_sensors_csv.py {o.path}`", o.path
        )
    with open(o.path, newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if not header:
            raise ValueError(f"{o.path}: empty file (expected a header row)")
        for key in ("label_column", "group_column"):
            if getattr(o, key) not in header:
                raise ValueError(f"csv.{key}: no column {getattr(o, key)!r} in {o.path} (columns: {', '.join(header)})")
        lab, grp = header.index(o.label_column), header.index(o.group_column)
        feat = [j for j in range(len(header)) if j not in (lab, grp)]
        x, y, g = [], [], []
        for line, row in enumerate(rows, 2):
            if not row:
                continue
            if len(row) != len(header):
                raise ValueError(f"{o.path}:{line}: {len(row)} values, the header has {len(header)}")
            try:
                x.append([float(row[j]) for j in feat])
                y.append(int(row[lab]))
            except ValueError as e:
                raise ValueError(f"{o.path}:{line}: not a number ({e})") from None
            g.append(row[grp])
    x = np.asarray(x, dtype=np.float32)
    bad = np.flatnonzero(~np.isfinite(x).all(1))
    if bad.size:
        raise ValueError(f"{o.path}: lines {(bad[:5] + 2).tolist()} hold NaN or inf features")
    return x, np.asarray(y, dtype=np.int64), np.asarray(g)


def load_csv(spec):
    """``(train, test)``: each group's rows split at random (``split_seed``), the group kept per row in
    ``ArrayDataset.groups`` (the partition below reads it)."""
    o = spec["options"]
    x, y, g = _read(o)
    names, gid = np.unique(g, return_inverse=True)
    rng = np.random.default_rng(o.split_seed)
    test = np.zeros(len(y), dtype=bool)
    for k in range(len(names)):
        rows = np.flatnonzero(gid == k)
        test[rng.choice(rows, size=int(round(o.test_fraction * len(rows))), replace=False)] = True
    C = int(y.max()) + 1
    mean, std = (0.0,), (1.0,)
    if o.standardize:  # the training rows' statistics, applied to both splits by ArrayDataset.batch
        mean = tuple(x[~test].mean(0).tolist())
        std = tuple(np.where(x[~test].std(0) > 0, x[~test].std(0), 1.0).tolist())

    def split(mask, name):
        return data.ArrayDataset(
            torch.from_numpy(x[mask]),
            torch.from_numpy(y[mask]),
            C,
            mean,
            std,
            name=name,
            groups=torch.from_numpy(gid[mask]),
        )

    return split(~test, "csv"), split(test, "csv test")


data.register_dataset("csv", load_csv, options=CSVOptions)


# -- the partition -------------------------------------------------------------------------------------------
@dataclass
class ByColumnOptions:
    min_samples: int = opt(1, "a group with fewer training rows takes no part", check=">=1")


def by_column(train, spec):
    """One client per group (``train.groups``); groups with fewer than ``min_samples`` rows are left out."""
    if train.groups is None:
        raise ValueError(f"partition: by_column needs a dataset with a group per row, not {spec['dataset']!r}")
    g = train.groups.numpy()
    order = np.argsort(g, kind="stable")
    bounds = np.flatnonzero(np.diff(g[order])) + 1
    clients = [c for c in np.split(order, bounds) if len(c) >= spec["options"].min_samples]
    if not clients:
        raise ValueError(f"by_column.min_samples: {spec['options'].min_samples} leaves no group")
    return data.Partition(clients, train.num_classes, train.y, f"by_column(min_samples={spec['options'].min_samples})")


data.register_partition("by_column", by_column, options=ByColumnOptions, sets_num_clients=True)


# -- the model -----------------------------------------------------------------------------------------------
@dataclass
class TabularMLPOptions:
    hidden: int = opt(64, "width of each hidden layer", check=">=1")
    layers: int = opt(2, "hidden layers", check=">=1")


def tabular_mlp(num_classes, shape, o):
    """Linear -> ReLU, ``layers`` times, then the classifier: for feature rows ``[N, F]``."""
    if shape is None or len(shape) != 1:
        raise ValueError(f"model: tabular_mlp takes feature rows [N, F], got samples of shape {shape}")
    dims = [shape[0]] + [o.hidden] * o.layers
    body = [m for a, b in itertools.pairwise(dims) for m in (nn.Linear(a, b), nn.ReLU())]
    return nn.Sequential(*body, nn.Linear(dims[-1], num_classes))


models.register_model("tabular_mlp", tabular_mlp, options=TabularMLPOptions)
