"""Figures (matplotlib, an optional extra: ``pip install matplotlib``), drawn headless.

* :func:`accuracy_curves` - ``fedfast plot DIR... -o fig.png``: test accuracy against round, one line per method
  (and per study directory when several are given), the mean over seeds with a ± std band;
* :func:`heatmap` - a matrix's column shares in grey; :func:`partition_heatmap` - a partition's class-by-client
  matrix.
"""

from __future__ import annotations

import io
import os

import numpy as np

from ._io import read_json, write_atomic
from .rundir import read_jsonl, status
from .study import STUDY, point_label


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plot: needs matplotlib (pip install matplotlib, or the fedfast[plot] extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(run_dir: str) -> tuple[dict, np.ndarray, np.ndarray]:
    """(config, rounds, accuracies) of the evaluated rounds of one run directory (a diverged round's
    non-finite accuracy is ``null`` and left out)."""
    cfg_path = os.path.join(run_dir, "config.json")
    cfg = read_json(cfg_path, "config")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("algorithm"), str):
        raise ValueError(f"{cfg_path}: damaged config (no algorithm)")
    r, a = [], []
    for rec in read_jsonl(os.path.join(run_dir, "metrics.jsonl")):
        if isinstance(rec.get("test_accuracy"), (int, float)):
            r.append(rec["round"])
            a.append(rec["test_accuracy"])
    return cfg, np.array(r), np.array(a)


def curves(dirs: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """``{label: (rounds, mean, std, n_seeds)}`` over the runs below each directory (rounds every seed has)."""
    groups: dict[str, list] = {}
    for root in dirs:
        runs = [d for d, _, files in os.walk(root) if "metrics.jsonl" in files and "config.json" in files]
        if not runs:
            raise ValueError(f"plot: {root} holds no run (no metrics.jsonl below it)")
        prefix = f"{os.path.basename(os.path.abspath(root))}: " if len(dirs) > 1 else ""
        order = []
        if os.path.isfile(os.path.join(root, STUDY)):
            spec = read_json(os.path.join(root, STUDY), "study")
            order = spec.get("methods", []) if isinstance(spec, dict) else []
        grids: dict = {}  # study directory -> its grid's keys (each study.json read once)
        for d in sorted(runs):
            if status(d) == "diverged":  # as in the report: a diverged run is out of the mean (the report counts it)
                continue
            cfg, r, a = _series(d)
            groups.setdefault(prefix + _label(cfg, d, root, grids), []).append((r, a))
        for m in order:  # the study's method order first
            if prefix + m in groups:
                groups[prefix + m] = groups.pop(prefix + m)
    out = {}
    for label, ss in groups.items():
        common = sorted(set.intersection(*(set(r.tolist()) for r, _ in ss)))
        if not common:
            continue
        A = np.stack([a[np.searchsorted(r, common)] for r, a in ss])
        std = A.std(0, ddof=1) if len(ss) > 1 else np.zeros(len(common))
        out[label] = (np.array(common), A.mean(0), std, len(ss))
    return out


def _study_of(d: str, root: str) -> str | None:
    """The nearest directory from ``d`` up to ``root`` that holds a study.json."""
    d, root = os.path.abspath(d), os.path.abspath(root)
    while True:
        if os.path.isfile(os.path.join(d, STUDY)):
            return d
        if d == root or os.path.dirname(d) == d:
            return None
        d = os.path.dirname(d)


def _label(cfg: dict, d: str, root: str, grids: dict) -> str:
    """A run's line: ``cell: `` for a part of a study of several cells, the method, `` [fedprox.mu=0.1]`` for a
    grid point."""
    s = _study_of(d, root)
    if s is None:
        return cfg["algorithm"]
    if s not in grids:
        grids[s] = list((read_json(os.path.join(s, STUDY), "study") or {}).get("grid") or {})
    where = f"{os.path.basename(s)}: " if s != os.path.abspath(root) else ""
    point = point_label(cfg, grids[s]) if grids[s] else ""
    return where + cfg["algorithm"] + (f" [{point}]" if point else "")


def accuracy_curves(dirs: list[str], out: str, title: str | None = None) -> dict:
    """Draw test accuracy (%) against round to ``out`` (PNG); returns the plotted :func:`curves`."""
    data = curves(dirs)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for label, (r, m, s, n) in data.items():
        (line,) = ax.plot(r, 100 * m, label=f"{label} (n={n})" if n > 1 else label, lw=1.6)
        if n > 1:
            ax.fill_between(r, 100 * (m - s), 100 * (m + s), color=line.get_color(), alpha=0.2, lw=0)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return data


def heatmap(matrix, out: str, xlabel: str = "client", ylabel: str = "class", cell: float = 0.08) -> None:
    """A grayscale heatmap of ``matrix`` [rows, cols] (its values' share of each column: white 0, black 1)."""
    m = np.asarray(matrix, dtype=float)
    share = m / np.maximum(m.sum(0, keepdims=True), 1)
    plt = _plt()
    w = min(max(3.0, m.shape[1] * cell), 20.0)
    h = min(max(2.0, m.shape[0] * cell * 3), 12.0)
    fig, ax = plt.subplots(figsize=(w, h), dpi=100)
    ax.imshow(share, cmap="Greys", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)


def partition_heatmap(partition, out: str) -> None:
    """A partition's class-by-client heatmap (rows: classes, columns: clients); a cell's darkness is the class's
    share of that client's data (white = absent, black = all of it). Needs matplotlib."""
    heatmap(partition.histogram.t().numpy(), out)


def _save(fig, out: str) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    d = os.path.dirname(os.path.abspath(out))
    os.makedirs(d, exist_ok=True)
    write_atomic(out, buf.getvalue())
