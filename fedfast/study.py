"""Studies: many runs in one directory, and their tables.

``fedfast sweep [STUDY.toml | --preset NAME | CONFIG.toml] --methods a,b --seeds 0,1,2 [--grid KEY=v1,v2 ...]
--out DIR`` runs the cross product of methods, grid points and seeds into ``DIR/<method>[/<point>]/seed<k>/``
(each a run directory, :mod:`fedfast.runner`; ``<point>`` names the grid values, ``fedprox.mu=0.1,lr=0.05``). A
study file or preset name with several cells runs each cell as a part, ``DIR/<cell>/...``. A complete run is
skipped, an interrupted one resumed from its checkpoint, so the same command continues a study; ``--jobs N``
runs N runs at once (the cores divided between them), ``--shard I/N`` the I-th of N disjoint parts of the runs
(a scheduler's job array), and the run directories' locks keep any two processes from running one run.
``DIR/study.json`` records what the study is: its cell (with the reported numbers, so its report needs no study
file), methods, seeds, grid and overrides.

``fedfast report DIR [DIR ...] [--format md|csv|latex] [--select METRIC]`` prints the table and writes
``DIR/report.<ext>`` (one DIR) or ``-o FILE``:

* one study: a row per method and grid point with the number of seeds, final and best test accuracy, the mean of
  the last 10 evaluations, forgetting, validation accuracy (with ``val_fraction``) and wall time, each as mean ±
  std over seeds (sample std, n - 1), and for a study with reported numbers the paper's number and Δ = ours −
  paper on the column the paper reports; then a "selected" row per gridded method: the grid point with the best
  mean of METRIC over seeds (default the final accuracy on the validation split, never the test set), with what
  was chosen and on what written under the table;
* several studies (or a study of several cells): methods as rows, studies (cells) as columns, each the mean ±
  std of the metric the cell's paper reports (the selected grid point of a gridded method), the paper's number
  and Δ where known, the best of each column in bold.
"""
from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

from .checkpoint import write_atomic

STUDY = "study.json"

# metrics a grid point can be selected on: summary key -> (higher is better, in words)
SELECT = {
    "final_val_accuracy": (True, "final validation accuracy"),
    "best_val_accuracy": (True, "best validation accuracy over the rounds"),
    "mean_last10_val_accuracy": (True, "mean validation accuracy of the last 10 evaluations"),
    "final_val_loss": (False, "final validation loss"),
    "final_test_accuracy": (True, "final test accuracy"),
    "best_test_accuracy": (True, "best test accuracy over the rounds"),
    "mean_last10_test_accuracy": (True, "mean test accuracy of the last 10 evaluations"),
    "final_test_loss": (False, "final test loss"),
    "final_forgetting": (False, "final forgetting"),
}
SELECT_ALIASES = {"val": "final_val_accuracy", "val_best": "best_val_accuracy", "val_last10": "mean_last10_val_accuracy",
                  "test": "final_test_accuracy", "test_best": "best_test_accuracy"}
DEFAULT_SELECT = "final_val_accuracy"
GRID_VAL_FRACTION = 0.1  # a gridded sweep's validation split when none is given


def select_key(name: str | None, what: str = "--select") -> str:
    """The summary key a selection metric name (or alias) means; ValueError naming the choices."""
    name = (name or DEFAULT_SELECT).strip()
    key = SELECT_ALIASES.get(name, name)
    if key not in SELECT:
        raise ValueError(f"{what}: {name!r} is not a metric to select on (one of {', '.join(SELECT)}, or "
                         f"{', '.join(SELECT_ALIASES)})")
    return key


# -- grids ----------------------------------------------------------------------------------------------------

def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """``--grid KEY=v1,v2,...`` items as ``{key: [value strings]}`` (a key given twice: an error naming it)."""
    out: dict[str, list[str]] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--grid: expected KEY=v1,v2,... (e.g. fedprox.mu=0.01,0.1), got {item!r}")
        k, v = (p.strip() for p in item.split("=", 1))
        vals = _split_values(v)
        if not k or not vals:
            raise ValueError(f"--grid: expected KEY=v1,v2,... (e.g. fedprox.mu=0.01,0.1), got {item!r}")
        if k in out:
            raise ValueError(f"--grid {k}: given twice (one --grid per key, its values comma-separated)")
        out[k] = vals
    return out


def _split_values(v: str) -> list[str]:
    """Comma-separated values; commas inside brackets stay (a list-valued key: adam_betas=[0.9,0.99],[0.9,0.999])."""
    vals, depth, cur = [], 0, ""
    for ch in v:
        depth += ch in "[("
        depth -= ch in "])"
        if ch == "," and depth == 0:
            vals.append(cur.strip())
            cur = ""
        else:
            cur += ch
    vals.append(cur.strip())
    return [x for x in vals if x]


def _token(v) -> str:
    """A study file's grid value as a --set value string."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _label_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return format(v, "g")
    if isinstance(v, (list, tuple)):
        return "_".join(_label_value(x) for x in v)
    return str(v).replace(os.sep, "_")


def point_label(cfg_json: dict, keys: list[str]) -> str:
    """The grid point of a run (its resolved config) over ``keys``: ``fedprox.mu=0.1,lr=0.05``; keys the run's
    method does not read are left out."""
    parts = []
    for k in keys:
        if "." in k:
            t, kk = k.split(".", 1)
            table = cfg_json.get(t)
            if not isinstance(table, dict) or kk not in table:
                continue
            v = table[kk]
        elif k in cfg_json:
            v = cfg_json[k]
        else:
            continue
        parts.append(f"{k}={_label_value(v)}")
    return ",".join(parts)


# -- runs and studies on disk --------------------------------------------------------------------------------

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


def _read_study(d: str) -> dict:
    path = os.path.join(d, STUDY)
    if not os.path.isfile(path):
        return {}
    from .rundir import read_json
    meta = read_json(path, "study")
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: damaged (expected a JSON object)")
    for k, typ in (("methods", list), ("parts", list), ("grid", dict), ("cell", dict)):
        if meta.get(k) is not None and not isinstance(meta[k], typ):
            raise ValueError(f"{path}: damaged ({k} is not a {typ.__name__})")
    return meta


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


_STATS = ("final_test_accuracy", "best_test_accuracy", "mean_last10_test_accuracy", "final_forgetting",
          "final_test_loss", "final_val_accuracy", "best_val_accuracy", "mean_last10_val_accuracy", "final_val_loss",
          "wall_seconds")


@dataclass
class Study:
    """One study directory read back: its runs, what study.json says of it, and its rows."""
    dir: str
    meta: dict
    cell: dict | None     # the cell's card (name, paper, table, metric, reported, reported_note, notes)
    runs: list
    grid: list            # the grid's keys

    @property
    def title(self) -> str:
        return self.cell["name"] if self.cell else os.path.basename(os.path.abspath(self.dir))

    @property
    def metric(self) -> str:
        """The summary key of the accuracy the cell's paper reports (final unless it says best)."""
        return "best_test_accuracy" if self.cell and self.cell.get("metric") == "best" else "final_test_accuracy"

    @property
    def reported(self) -> dict:
        return (self.cell or {}).get("reported") or {}


def load_studies(dirs: list[str]) -> list[Study]:
    """The studies the directories hold (a study of several cells: each part); ValueError naming an empty one."""
    out = []
    for d in dirs:
        if not os.path.isdir(d):
            raise ValueError(f"report: {d}: no such directory")
        meta = _read_study(d)
        if meta.get("parts"):
            parts = [os.path.join(d, p) for p in meta["parts"] if os.path.isdir(os.path.join(d, p))]
            subs = [_load_study(p, _read_study(p)) for p in parts if run_dirs(p)]
            if not subs:
                raise ValueError(f"{d}: no finished or checkpointed runs (no summary.json below it)")
            out += subs
        else:
            out.append(_load_study(d, meta))
    return out


def _load_study(d: str, meta: dict) -> Study:
    runs = [load_run(x) for x in run_dirs(d)]
    if not runs:
        raise ValueError(f"{d}: no finished or checkpointed runs (no summary.json below it)")
    cell = meta.get("cell")
    if cell is None and meta.get("preset"):  # a study from before study.json carried its cell: the package's
        from . import presets
        cell = presets.get(meta["preset"], what=f"{os.path.join(d, STUDY)}: preset").card()
    return Study(d, meta, cell, runs, list((meta.get("grid") or {}).keys()))


def study_rows(st: Study) -> list[dict]:
    """A row per method and grid point: mean ± std over seeds of each summary metric (diverged runs counted,
    not averaged), the paper's number and Δ where the cell reports one."""
    order = st.meta.get("methods") or []
    groups: dict[tuple, list[dict]] = {}
    for r in st.runs:
        groups.setdefault((r["config"]["algorithm"], point_label(r["config"], st.grid)), []).append(r)
    methods = [m for m in order if any(k[0] == m for k in groups)]
    methods += sorted({k[0] for k in groups} - set(methods))
    rows = []
    for m in methods:
        for key in sorted((k for k in groups if k[0] == m), key=lambda k: _point_order(k[1], st.meta)):
            every = groups[key]
            g = [r for r in every if r["status"] != "diverged"]  # diverged runs: counted, not averaged
            div = sorted(((r["config"]["seed"], r.get("diverged_round")) for r in every if r["status"] == "diverged"),
                         key=lambda x: (x[0] is None, x))
            row = {"study": st.title, "method": m, "point": key[1], "seeds": sorted(r["config"]["seed"] for r in g),
                   "complete": all(r["complete"] for r in g), "rounds": min((r["rounds"] for r in g), default=None),
                   "diverged": div, "runs": len(every), "selected": False,
                   "replaced": next((r["config"]["replaced_methods"] for r in every
                                     if r["config"].get("replaced_methods")), None)}
            for k in _STATS:
                row[k] = mean_std([r.get(k) for r in g])
            if m in st.reported:
                rep = st.reported[m]
                row["paper"] = (rep[0], rep[1] if len(rep) > 1 else None)
                ours = row[st.metric][0]
                row["delta"] = 100 * ours - rep[0] if ours is not None else None
            rows.append(row)
    return rows


def _point_order(label: str, meta: dict):
    """Grid points in the order of the grid's values (as given), not as strings."""
    grid = meta.get("grid") or {}
    out = []
    for part in label.split(",") if label else []:
        k, v = part.split("=", 1)
        vals = [_label_value(_num(x)) for x in grid.get(k, [])]
        out.append(vals.index(v) if v in vals else len(vals))
    return out, label


def _num(x):
    if isinstance(x, str):
        for f in (int, float):
            try:
                return f(x)
            except ValueError:
                pass
        if x.lower() in ("true", "false"):
            return x.lower() == "true"
    return x


def _gridded(rows: list[dict]) -> list[str]:
    """The methods with more than one grid point among one study's rows."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["method"]] = counts.get(r["method"], 0) + 1
    return [m for m, n in counts.items() if n > 1]


def select(rows: list[dict], key: str) -> dict[str, dict]:
    """Per method with more than one grid point: the row with the best mean of ``key`` over seeds; a point with a
    diverged seed or without the metric is not eligible. Marks the chosen rows ``selected``; returns
    ``{method: row}`` (methods with no eligible point are absent)."""
    higher = SELECT[key][0]
    chosen = {}
    for m in _gridded(rows):
        ok = [r for r in rows if r["method"] == m and not r["diverged"] and r[key][0] is not None]
        if ok:
            best = (max if higher else min)(ok, key=lambda r: r[key][0])  # the first of equals: grid order
            best["selected"] = True
            chosen[m] = best
    return chosen


# -- the tables ------------------------------------------------------------------------------------------------

FORMATS = ("md", "csv", "latex")
_EXT = {"md": "md", "csv": "csv", "latex": "tex"}


def report(dirs, fmt: str = "md", select_on: str | None = None, out: str | None = None) -> tuple[str, list[dict]]:
    """The table of one study or several merged (see the module docstring) in ``fmt``; writes it to
    ``DIR/report.<ext>`` when one directory is given, and to ``out`` when given. Returns the text and the rows."""
    if isinstance(dirs, str):
        dirs = [dirs]
    if fmt not in FORMATS:
        raise ValueError(f"--format: one of {', '.join(FORMATS)}; got {fmt!r}")
    studies = load_studies(list(dirs))
    chosen_on = [select_key(select_on or (s.meta.get("select") or None)) for s in studies]
    per, notes = [], []  # each study's rows
    for st, key in zip(studies, chosen_on):
        rs = study_rows(st)
        notes.append(_selection_note(st, rs, select(rs, key), key))
        per.append(rs)
    if fmt == "csv":
        text = _csv(studies, per, chosen_on)
    elif len(studies) == 1:
        text = _single(studies[0], per[0], notes[0], fmt)
    else:
        text = _merged(studies, per, notes, fmt)
    if len(dirs) == 1:
        write_atomic(os.path.join(dirs[0], f"report.{_EXT[fmt]}"), text)
    if out:
        write_atomic(out, text)
    return text, [r for rs in per for r in rs]


def _selection_note(st: Study, rows: list[dict], picked: dict, key: str) -> list[str]:
    gridded = _gridded(rows)
    if not gridded:
        return []
    words = SELECT[key][1]
    out = []
    if key.startswith(("final_val", "best_val", "mean_last10_val")):
        fr = sorted({r["config"].get("val_fraction") for r in st.runs if r["config"]["algorithm"] in gridded}
                    - {None, 0, 0.0})
        if not fr:
            return [f"Selection: none. The runs have no validation split (val_fraction = 0), and grid points are "
                    f"selected on the {words} by default, never on the test set: sweep with --set "
                    f"val_fraction=0.1, or name a metric with --select (e.g. --select final_test_accuracy, "
                    f"which selects on the test set)."]
        out.append(f"Selected per method: the grid point with the {'highest' if SELECT[key][0] else 'lowest'} mean "
                   f"{words} over seeds (`{key}`; a validation split of val_fraction = "
                   f"{', '.join(format(f, 'g') for f in fr)} of the training data, held out before partitioning, "
                   f"not the test set); points with a diverged seed are not eligible.")
    else:
        out.append(f"Selected per method: the grid point with the {'highest' if SELECT[key][0] else 'lowest'} mean "
                   f"{words} over seeds (`{key}`)" + ("; this selects on the test set, so the selected rows are "
                                                      "optimistic estimates." if "test" in key else "."))
    for m in gridded:
        r = picked.get(m)
        if r is None:
            out.append(f"- {m}: none selected (no point has the metric on every seed without divergence)")
        else:
            scale = 100.0 if "accuracy" in key else 1.0
            out.append(f"- {m}: {r['point']} ({_fmt(*r[key], scale=scale, digits=2 if scale == 100 else 4)}"
                       + (", incomplete" if not r["complete"] else "") + ")")
    return out


def _label(r: dict) -> str:
    return r["method"] + (" ‡" if r.get("replaced") else "") + (f" [{r['point']}]" if r["point"] else "")


def _replaced_notes(rows: list[dict]) -> list[str]:
    """Rows whose method name a plug-in replaced (register(..., replace=True)): what ran under that name."""
    seen = {}
    for r in rows:
        for name, v in (r.get("replaced") or {}).items():
            seen[name] = v
    return [f"‡ {name} here is {v['by']}, registered with replace=True over {v['replaced']}: not fedfast's {name}."
            for name, v in sorted(seen.items())]


def _tag(r: dict) -> str:
    tag = "" if r["complete"] else " (incomplete)"
    if r["diverged"]:
        tag += (f" ({len(r['diverged'])} of {r['runs']} diverged: "
                + ", ".join(f"seed {s} at round {d}" for s, d in r["diverged"]) + "; not in the mean)")
    return tag


def _paper_cells(r: dict, dagger: str) -> list:
    """The paper's number and Δ of a row, as table cells (not bold)."""
    p = r.get("paper")
    return [((p[0] / 100, p[1] / 100 if p[1] is not None else None, 100.0, 2) if p else "–", False),
            (f"{r['delta']:+.2f}{dagger}" if r.get("delta") is not None else "–", False)]


def _md_table(head: list[str], body: list[list]) -> list[str]:
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(_md_cell(c, b) for c, b in cells) + " |" for cells in body])


def _best(rows: list[dict], key: str) -> float | None:
    vals = [r[key][0] for r in rows if r[key][0] is not None]
    return max(vals) if vals else None


def _single(st: Study, rows: list[dict], sel_note: list[str], fmt: str) -> str:
    """One study: a row per method and grid point, then the selected rows."""
    has_val = any(r["final_val_accuracy"][0] is not None for r in rows)
    paper = bool(st.reported)
    cols = [("final acc %", "final_test_accuracy", 100.0, 2), ("best acc %", "best_test_accuracy", 100.0, 2),
            ("last-10 mean %", "mean_last10_test_accuracy", 100.0, 2), ("forgetting", "final_forgetting", 1.0, 4)]
    if has_val:
        cols.append(("val acc %", "final_val_accuracy", 100.0, 2))
    cols.append(("wall s", "wall_seconds", 1.0, 1))
    bold = {k for _, k, s, _ in cols if s == 100.0}
    best = {k: _best(rows, k) for k in bold}
    shown = rows + [dict(r, shown_selected=True) for r in rows if r["selected"]]
    head = ["method", "seeds", "rounds"] + [c[0] for c in cols] + (["paper %", "Δ"] if paper else [])
    body = []
    dagger = " †" if (st.cell or {}).get("reported_note") else ""
    for r in shown:
        name = (f"{r['method']} (selected: {r['point']})" if r.get("shown_selected") else _label(r)) + _tag(r)
        cells = [(name, False), (",".join(map(str, r["seeds"])) or "–", False),
                 (str(r["rounds"]) if r["rounds"] is not None else "–", False)]
        for _, k, scale, digits in cols:
            m, s = r[k]
            cells.append(((m, s, scale, digits), k in bold and m is not None and m == best[k]))
        if paper:
            cells += _paper_cells(r, dagger)
        body.append(cells)
    title = (f"{st.cell['name']}: {st.cell['paper']}, {st.cell['table']}" if st.cell and st.cell.get("paper")
             else f"Study {st.title}")
    head_note = f"The paper reports the {st.cell['metric']} test accuracy; Δ = ours − paper on that column." \
        if paper else None
    dev = sorted({str(r.get("device")) for r in st.runs})
    nd = sum(len(r["diverged"]) for r in rows)
    count = (f"{len(st.runs)} runs; device {', '.join(dev)}; mean ± sample std over seeds; bold: the best of the "
             f"column" + (f"; {nd} diverged run{'s' if nd > 1 else ''} left out of the means (marked)." if nd else "."))
    note = f"† On the paper's numbers of this cell: {st.cell['reported_note']}" if dagger else None
    prov = [_provenance(r, st.dir) for r in st.runs]
    protocol = " ".join((st.cell or {}).get("notes", "").split())
    sel_note = _replaced_notes(rows) + sel_note
    if fmt == "latex":
        notes = [n for n in (head_note, count, note) if n] + sel_note + ([f"Protocol: {protocol}"] if protocol else [])
        return _latex([(None, head[1:])], body, title, notes, grouped=False) + \
            "% Runs (provenance):\n" + "".join(f"% {tex(p)}\n" for p in prov)
    lines = [f"# {title}", ""] + ([head_note, ""] if head_note else [])
    lines += _md_table(head, body)
    lines += ["", count] + (["", note] if note else []) + ([""] + sel_note if sel_note else [])
    lines += ["", "Runs (provenance):", ""] + [f"- {p}" for p in prov]
    if protocol:
        lines += ["", "Protocol: " + protocol]
    return "\n".join(lines) + "\n"


def _md_cell(c, bold: bool) -> str:
    if isinstance(c, tuple):
        c = _fmt(c[0], c[1], scale=c[2], digits=c[3])
    return f"**{c}**" if bold and c != "–" else c


def _merged(studies: list[Study], per_study: list[list[dict]], sel_notes: list[list[str]], fmt: str) -> str:
    """Methods as rows, studies as columns (the metric each cell's paper reports), paper and Δ where known."""
    titles = [s.title for s in studies]
    short = [t.split("/", 1)[1] if "/" in t else t for t in titles]
    if len(set(short)) == len(short):
        titles = short
    per = []  # per study: {row label: row}
    for rs in per_study:
        methods = list(dict.fromkeys(r["method"] for r in rs))
        shown = {}
        for m in methods:
            mine = [r for r in rs if r["method"] == m]
            pick = [r for r in mine if r["selected"]]
            for r in (pick if pick else mine):
                shown[(m + (" ‡" if r.get("replaced") else "")) if (pick or len(mine) == 1) else _label(r)] = r
        per.append(shown)
    labels = list(dict.fromkeys(k for shown in per for k in shown))
    groups, body = [], [[(lab, False)] for lab in labels]
    daggers = []
    for st, shown, title in zip(studies, per, titles):
        paper = bool(st.reported)
        dag = " †" if (st.cell or {}).get("reported_note") else ""
        if dag:
            daggers.append((title, st.cell["reported_note"]))
        sub = ["ours"] + (["paper", "Δ"] if paper else [])
        groups.append((title + (" (best)" if st.metric == "best_test_accuracy" else ""), sub))
        best = _best(list(shown.values()), st.metric)
        for i, lab in enumerate(labels):
            r = shown.get(lab)
            if r is None:
                body[i] += [("–", False)] * len(sub)
                continue
            m, s = r[st.metric]
            body[i].append(((m, s, 100.0, 2), m is not None and m == best))
            if paper:
                body[i] += _paper_cells(r, dag)
    metric_words = ("final test accuracy (%) unless the column says (best): the best over rounds, as that cell's "
                    "paper reports")
    notes = [f"Each entry: {metric_words}; mean ± sample std over seeds; bold: the best of the column. A gridded "
             f"method's row is its selected grid point."]
    nd = sum(len(r["diverged"]) for rs in per_study for r in rs)
    if nd:
        notes.append(f"{nd} diverged run{'s' if nd > 1 else ''} left out of the means (see each study's report).")
    for title, note in daggers:
        notes.append(f"† {title}: {note}")
    notes += _replaced_notes([r for rs in per_study for r in rs])
    for st, title, sn in zip(studies, titles, sel_notes):
        if sn:
            notes.append(f"{title}: " + sn[0])
            notes += sn[1:]
    vers = sorted({_versions_line(r) for st in studies for r in st.runs})
    notes.append("Runs: " + "; ".join(vers) + ".")
    head_title = "Merged studies: " + ", ".join(f"{t} ({s.dir})" for t, s in zip(titles, studies))
    if fmt == "latex":
        return _latex(groups, body, head_title, notes, grouped=True)
    head = ["method"] + [f"{g[0]} {h}" if h != "ours" else g[0] for g in groups for h in g[1]]
    lines = [f"# {head_title}", ""] + _md_table(head, body)
    for n in notes:
        lines += ([] if n.startswith("- ") else [""]) + [n]
    return "\n".join(lines) + "\n"


def _versions_line(r: dict, full: bool = False) -> str:
    """A run's fedfast version (and commit), torch (and python, ``full``) and device."""
    v = r.get("versions") or {}
    c = v.get("commit")
    return (f"fedfast {v.get('fedfast', '?')}" + (f" (commit {c if full else c[:12]})" if c else "")
            + f", torch {v.get('torch', '?')}" + (f", python {v.get('python', '?')}" if full else "")
            + f", device {r.get('device', '?')}")


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "±": r"$\pm$", "Δ": r"$\Delta$",
        "†": r"$^\dagger$", "−": "-", "–": "--", "—": "---", "≥": r"$\geq$", "≤": r"$\leq$", "×": r"$\times$",
        "α": r"$\alpha$", "β": r"$\beta$", "τ": r"$\tau$", "μ": r"$\mu$", "λ": r"$\lambda$", "δ": r"$\delta$",
        "ρ": r"$\rho$", "≈": r"$\approx$", "→": r"$\to$", "←": r"$\leftarrow$", "“": "``", "”": "''", "’": "'"}


def tex(s: str) -> str:
    """``s`` as LaTeX text: special characters escaped, the Unicode signs the tables use as math, anything else
    outside ASCII dropped (pdflatex's default input encoding would reject it)."""
    parts = str(s).split("`")
    if len(parts) > 1 and len(parts) % 2 == 1:  # Markdown's `code` as \texttt
        return "".join(tex(p) if i % 2 == 0 else rf"\texttt{{{tex(p)}}}" for i, p in enumerate(parts))
    out = []
    for ch in str(s):
        if ch in _TEX:
            out.append(_TEX[ch])
        elif ord(ch) < 128:
            out.append(ch)
        else:
            out.append("?")
    return "".join(out).replace("`", "'")


def _tex_cell(c, bold: bool) -> str:
    if isinstance(c, tuple):
        m, s, scale, digits = c
        if m is None:
            return "--"
        v = f"{scale * m:.{digits}f}"
        v = rf"\textbf{{{v}}}" if bold else v
        return v + (rf"{{\scriptsize$\pm${scale * s:.{digits}f}}}" if s is not None else "")
    return tex(c)


def _latex(groups, body, title: str, notes: list[str], grouped: bool) -> str:
    """A ``table`` float (booktabs rules): ``groups`` = [(title, [sub-column heads])], a header row of the
    titles over their sub-columns when ``grouped``."""
    ncols = 1 + sum(len(g[1]) for g in groups)
    lines = [f"% {tex(title)}", "% written by fedfast report; needs \\usepackage{booktabs}",
             r"\begin{table}[t]", r"\centering", r"\small",
             r"\begin{tabular}{l" + "c" * (ncols - 1) + "}", r"\toprule"]
    if grouped:
        heads, rules, col = [""], [], 2
        for t, sub in groups:
            heads.append(rf"\multicolumn{{{len(sub)}}}{{c}}{{{tex(t)}}}" if len(sub) > 1 else tex(t))
            if len(sub) > 1:
                rules.append(rf"\cmidrule(lr){{{col}-{col + len(sub) - 1}}}")
            col += len(sub)
        lines.append(" & ".join(heads) + r" \\")
        if rules:
            lines.append(" ".join(rules))
    lines.append(" & ".join(["Method"] + [tex(h) for _, sub in groups for h in sub]) + r" \\")
    lines.append(r"\midrule")
    for cells in body:
        lines.append(" & ".join(_tex_cell(c, b) for c, b in cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", rf"\caption{{{tex(title)}}}", r"\label{tab:fedfast}"]
    if notes:
        lines.append(r"\par\smallskip\footnotesize")
        lines += [tex(n) + r"\par" for n in notes]
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


_CSV_STATS = (("final_test_acc", "final_test_accuracy", 100.0), ("best_test_acc", "best_test_accuracy", 100.0),
              ("last10_test_acc", "mean_last10_test_accuracy", 100.0), ("forgetting", "final_forgetting", 1.0),
              ("final_test_loss", "final_test_loss", 1.0), ("final_val_acc", "final_val_accuracy", 100.0),
              ("best_val_acc", "best_val_accuracy", 100.0), ("last10_val_acc", "mean_last10_val_accuracy", 100.0),
              ("final_val_loss", "final_val_loss", 1.0), ("wall_s", "wall_seconds", 1.0))


def _csv(studies: list[Study], per_study: list[list[dict]], keys: list[str]) -> str:
    """Long format, a line per study, method and grid point (accuracies in %); ``selected`` marks the chosen grid
    point of a gridded method and ``selected_on`` the metric."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    head = ["study", "dir", "method", "point", "selected", "selected_on", "status", "seeds", "n", "diverged",
            "rounds"] + [f"{n}_{x}" for n, _, _ in _CSV_STATS for x in ("mean", "std")] + \
           ["paper_metric", "paper_mean", "paper_std", "delta"]
    w.writerow(head)
    for st, rows, key in zip(studies, per_study, keys):
        many = set(_gridded(rows))
        for r in rows:
            gridded = r["method"] in many
            line = [st.title, st.dir, r["method"], r["point"], str(r["selected"]).lower() if gridded else "",
                    key if gridded else "", "complete" if r["complete"] else "incomplete",
                    " ".join(map(str, r["seeds"])), len(r["seeds"]),
                    " ".join(f"{s}@{d}" for s, d in r["diverged"]), r["rounds"] if r["rounds"] is not None else ""]
            for _, k, scale in _CSV_STATS:
                m, s = r[k]
                line += ["" if m is None else f"{scale * m:.10g}", "" if s is None else f"{scale * s:.10g}"]
            p = r.get("paper")
            line += [st.cell["metric"] if p else "", p[0] if p else "", p[1] if p and p[1] is not None else "",
                     f"{r['delta']:.4f}" if r.get("delta") is not None else ""]
            w.writerow(line)
    return buf.getvalue()


def _provenance(r: dict, root: str) -> str:
    return f"`{os.path.relpath(r['dir'], root)}`: {r['status']}, {_versions_line(r, full=True)}"


# -- sweeps ----------------------------------------------------------------------------------------------------

@dataclass
class _Run:
    method: str
    seed: int
    point: str
    cfg: object
    dir: str
    threads_given: bool
    label: str = ""


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``--shard I/N`` (0 <= I < N) as ``(I, N)``."""
    if not text:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard: I/N with integers 0 <= I < N (e.g. 0/4; a Slurm array: "
                         f"$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT), got {text!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard: I/N needs 0 <= I < N (shards are numbered from 0), got {text!r}")
    return i, n


def _given(key: str, overrides: list[str], file_keys, base: dict) -> bool:
    """Whether the user set ``key``: an override, the config file (its keys) or the study's cell."""
    return key in base or key in file_keys or any(o.split("=", 1)[0].strip() == key for o in overrides)


def _applies(key: str, methods: list[str]) -> bool:
    """Whether a grid key varies some of ``methods``: an engine or run key, or an option table one reads."""
    from . import methods as _methods
    return "." not in key or any(key.split(".", 1)[0] in _methods.get(m).option_tables() for m in methods)


def _plan(sub: str, cell, methods: list[str], seeds: list[int], grid: dict, overrides: list[str],
          config: str | None, file_keys, plugins) -> list[_Run]:
    """Every (method, grid point, seed) of one study with its config, built (so validated) before any run."""
    from . import methods as _methods
    from .config import KEYS, build_config
    for k in grid:
        if k in ("algorithm", "seed"):
            raise ValueError(f"--grid {k}: use --{'methods' if k == 'algorithm' else 'seeds'} for it")
        if "." not in k and k not in KEYS:
            raise ValueError(f"--grid {k}: unknown config key (engine and run keys: `fedfast run` keys; method "
                             f"options: method.key, e.g. fedprox.mu)")
    tables = {m: set(_methods.get(m).option_tables()) for m in methods}
    for k in grid:
        if "." in k and not any(k.split(".", 1)[0] in t for t in tables.values()):
            raise ValueError(f"--grid {k}: no method of the study reads the table {k.split('.', 1)[0]!r} (methods: "
                             f"{', '.join(methods)})")
    plan, seen = [], set()
    for m in methods:
        axes = [(k, vals) for k, vals in grid.items() if "." not in k or k.split(".", 1)[0] in tables[m]]
        for pt in itertools.product(*[[(k, v) for v in vals] for k, vals in axes]):
            for s in seeds:
                base = cell.config(m) if cell is not None else {}
                sets = [f"{k}={v}" for k, v in pt]
                try:
                    cfg = build_config(config, [*overrides, *sets, f"algorithm={m}", f"seed={s}"], base=base,
                                       plugins=plugins, source=cell.source if cell is not None else None)
                except (ValueError, TypeError) as e:
                    msg = str(e)
                    for k, _ in pt:  # a grid value's error names --grid, not --set
                        if msg.startswith(f"--set {k}:"):
                            raise type(e)("--grid" + msg[5:]) from None
                    raise
                point = point_label(cfg.to_json(), [k for k, _ in axes])
                d = os.path.join(sub, m, point, f"seed{s}") if point else os.path.join(sub, m, f"seed{s}")
                if d in seen:  # two spellings of one value (0.1, 0.10): one run
                    continue
                seen.add(d)
                plan.append(_Run(m, s, point, cfg, d, _given("threads", overrides, file_keys, base)))
    return plan


def sweep(out: str, methods: list[str], seeds: list[int], *, preset: str | None = None, config: str | None = None,
          overrides: list[str] | None = None, plugins=(), quiet: bool = False, workers: int = 1,
          grid: list[str] | None = None, jobs: int = 1, shard: tuple[int, int] | None = None) -> list[str]:
    """Run every (method, grid point, seed) of a study into ``out``; finished runs (complete or diverged) are
    skipped, interrupted ones resumed. ``preset``: a study file (``STUDY.toml``, ``STUDY.toml/CELL``) or a preset
    name; ``config``: a run config (or a study file). ``grid``: ``KEY=v1,v2`` items (over a study file's
    ``[grid]``). ``jobs``: runs at once, each with ``cores / (jobs * workers)`` threads. ``shard``: ``(I, N)``,
    the runs whose index in the plan is I mod N. Each run is taken under its directory's lock, so sweeps on one
    study (shards, restarted jobs, other machines on a shared filesystem) split its runs: a run another process
    holds is skipped at once. A diverged run is recorded and the sweep goes on. Every config is validated before
    anything is written. Returns the run directories of this process's part."""
    from . import presets as _presets
    overrides = list(overrides or [])
    if int(os.environ.get("RANK", "0")) > 0:  # under torchrun rank 0 speaks for the study
        quiet = True
    if jobs < 1:
        raise ValueError(f"--jobs: must be >= 1, got {jobs}")
    if workers < 1:
        raise ValueError(f"--workers: must be >= 1, got {workers}")
    if jobs > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("--jobs: not under torchrun (each run there spans the torchrun processes)")
    if config and _presets.names_study(config):
        if preset:
            raise ValueError(f"{config} is a study file; give it or --preset, not both")
        preset, config = config, None
    cells = _presets.resolve(preset) if preset else [None]
    cli_grid = parse_grid(grid or [])
    from .config import read_config_file
    file_keys = read_config_file(config) if config else {}
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out: {out} is a file, not a study directory")
    multi = len(cells) > 1
    plan, specs, grid_added = [], [], False
    for c in cells:
        sub = os.path.join(out, c.cell) if multi else out
        ms = list(methods) or (c.methods if c is not None else [])
        if not ms:
            raise ValueError("--methods: which methods to run (a preset's or study file's rows are the default)")
        ss = list(seeds) if seeds else (c.seeds if c is not None else [0])
        g = {k: [_token(v) for v in vals] for k, vals in (c.grid if c is not None else {}).items()
             if k not in cli_grid and _applies(k, ms)}  # the file's grid over methods this sweep runs
        g.update(cli_grid)
        ov = list(overrides)
        base_keys = c.keys if c is not None else {}
        if g and not _given("val_fraction", ov, file_keys, base_keys):
            ov.append(f"val_fraction={GRID_VAL_FRACTION}")  # grid points are selected on a validation split
            grid_added = True
        plugs = tuple(plugins) + tuple(p for p in (c.plugins if c is not None else ()) if p not in plugins)
        spec = {"preset": c.name if c is not None else None,
                "study": c.source if c is not None and not c.packaged else None,
                "cell": c.card() if c is not None else None,
                "protocol": _protocol(c), "config": os.path.abspath(config) if config else None, "methods": ms,
                "seeds": ss, "overrides": overrides, "plugins": [os.path.abspath(x) for x in plugs], "grid": g,
                "select": c.select if c is not None else ""}
        if spec["select"]:
            select_key(spec["select"], f"{c.source}: preset.select")
        specs.append((sub, spec))
        plan += _plan(sub, c, ms, ss, g, ov, config, file_keys, plugs)
    for sub, spec in specs:  # a changed study is refused before anything is written
        if os.path.isfile(os.path.join(sub, STUDY)):
            _merge_spec(sub, _read_study(sub), spec)
    source = (cells[0].name.split("/", 1)[0] if cells[0].packaged else cells[0].source) if multi else None
    if multi and os.path.isfile(os.path.join(out, STUDY)):
        old = _read_study(out)
        if not old.get("parts"):
            raise ValueError(f"{out}: is a study of one cell; a study of several cells needs another --out")
        if old.get("source") != source:
            raise ValueError(f"{out}: is a study of {old.get('source')!r}, not {source!r}; use another --out")
    os.makedirs(out, exist_ok=True)
    with _study_lock(out):  # one read-merge-write of the study files at a time
        if multi:
            old = _read_study(out)
            parts = list(old.get("parts") or []) + [c.cell for c in cells if c.cell not in (old.get("parts") or [])]
            write_atomic(os.path.join(out, STUDY), json.dumps({"source": source, "parts": parts}, indent=2))
        for sub, spec in specs:
            os.makedirs(sub, exist_ok=True)
            now = _merge_spec(sub, _read_study(sub), spec) if os.path.isfile(os.path.join(sub, STUDY)) else spec
            write_atomic(os.path.join(sub, STUDY), json.dumps(now, indent=2))
    total = len(plan)
    for i, r in enumerate(plan):
        r.label = f"[{i + 1}/{total}] {r.method}{' ' + r.point if r.point else ''} seed {r.seed}"
    if shard is not None:
        plan = [r for i, r in enumerate(plan) if i % shard[1] == shard[0]]
        if not quiet:
            print(f"shard {shard[0]}/{shard[1]}: {len(plan)} of the study's {total} runs", flush=True)
    if grid_added and not quiet:
        print(f"grid: val_fraction = {GRID_VAL_FRACTION} of each run's training data is held out as the validation "
              f"split that `fedfast report` selects grid points on (--set val_fraction=F to change it)", flush=True)
    _assign_threads(plan, jobs, workers)
    if jobs > 1:
        return _run_jobs(plan, jobs, workers, quiet, out)
    return _run_serial(plan, workers, quiet)


def _protocol(c) -> dict | None:
    if c is None:
        return None
    return json.loads(json.dumps({"keys": c.keys, "options": c.options, "engine": c.engine}, sort_keys=True,
                                 default=str))


def _merge_spec(sub: str, old: dict, spec: dict) -> dict:
    """The study.json of a study run again: the same cell, config and overrides (else refused), the methods,
    seeds and grid values added."""
    path = os.path.join(sub, STUDY)
    if old.get("parts"):
        raise ValueError(f"{sub}: is a study of several cells; a study of one cell needs another --out")
    def comparable(v, k):  # threads change the summation order, not the study: not compared
        return [o for o in v if o.split("=", 1)[0].strip() != "threads"] if k == "overrides" and v else v
    for k in ("preset", "study", "config", "overrides"):
        if comparable(old.get(k), k) != comparable(spec[k], k):
            raise ValueError(f"{sub}: is a study with {k} = {old.get(k)!r}, not {spec[k]!r}; use another --out")
    if old.get("protocol") is not None and old["protocol"] != spec["protocol"]:
        a, b = old["protocol"], spec["protocol"]
        diff = sorted(f"{part}.{k}" if part != "keys" else k for part in set(a) | set(b)
                      for k in set(a.get(part) or {}) | set(b.get(part) or {})
                      if (a.get(part) or {}).get(k) != (b.get(part) or {}).get(k))
        raise ValueError(f"{sub}: its study's protocol changed since it ran ({', '.join(diff)} differ in "
                         f"{spec['study'] or spec['preset']}); use another --out, or put the study file back")
    og = old.get("grid") or {}
    if og and set(og) != set(spec["grid"]):
        raise ValueError(f"{sub}: is a study with a grid over {', '.join(og)}, not "
                         f"{', '.join(spec['grid']) or 'no grid'}; use another --out")
    if not og and spec["grid"] and old.get("methods"):
        raise ValueError(f"{sub}: is a study without a grid; a grid over {', '.join(spec['grid'])} needs another "
                         f"--out")
    if not isinstance(old.get("methods", []), list) or not isinstance(old.get("seeds", []), list):
        raise ValueError(f"{path}: damaged (methods or seeds is not a list)")
    grid = {k: list(og.get(k, [])) + [v for v in vals if v not in og.get(k, [])] for k, vals in spec["grid"].items()}
    return {**spec, "methods": old.get("methods", []) + [m for m in spec["methods"] if m not in old.get("methods", [])],
            "seeds": old.get("seeds", []) + [s for s in spec["seeds"] if s not in old.get("seeds", [])], "grid": grid}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _assign_threads(plan: list[_Run], jobs: int, workers: int) -> None:
    """Each run's intra-op threads: the user's; an interrupted run's recorded number (so it resumes bit-exact);
    else the cores divided between the runs at once (and their worker processes)."""
    import torch
    from .rundir import read_json, status
    # the cores this process may use (a scheduler's allocation, not the machine's), divided between the runs
    default = max(1, _cores() // (jobs * workers)) if jobs > 1 else (
        0 if workers > 1 else min(torch.get_num_threads(), _cores()))
    for r in plan:
        if r.threads_given:
            continue
        n = default
        if status(r.dir) == "incomplete" and os.path.isfile(os.path.join(r.dir, "config.json")):
            try:
                n = int(read_json(os.path.join(r.dir, "config.json"), "config").get("threads") or n)
            except (ValueError, TypeError, AttributeError):
                pass
        r.cfg.values["threads"] = n


def _run_serial(plan: list[_Run], workers: int, quiet: bool) -> list[str]:
    from .jobs import run, run_workers
    from .rundir import RunLocked, status
    from .runner import Interrupted, RunDiverged
    dirs, held, diverged = [], [], []
    for r in plan:
        try:
            if workers > 1:
                done = run_workers(r.cfg, r.dir, workers, mode="auto", quiet=quiet, label=r.label)
            else:
                done = run(r.cfg, r.dir, mode="auto", quiet=quiet, label=r.label)
            if done is None and not quiet:
                print(f"{r.label}: {status(r.dir)}, skipped", flush=True)
        except RunLocked as e:
            held.append(r.dir)
            if not quiet:
                print(f"{r.label}: skipped, {e}", flush=True)
        except RunDiverged as e:
            diverged.append(r.dir)
            print(f"{r.label}: {e}", file=sys.stderr, flush=True)
        except Interrupted as e:
            raise Interrupted(e.signum, -1, r.dir, message=f"{e}, or run the same `fedfast sweep` command (it "
                                                          f"resumes the run and goes on with the study)") from None
        dirs.append(r.dir)
    _tail(held, diverged, quiet)
    return dirs


def _tail(held: list, diverged: list, quiet: bool) -> None:
    if held and not quiet:
        print(f"{len(held)} run(s) were running in other processes; `fedfast sweep` again (or `fedfast report`) "
              f"once they end", flush=True)
    if diverged and not quiet:
        print(f"{len(diverged)} run(s) diverged; the report marks them and leaves them out of the means", flush=True)


# exit codes of a --jobs process (besides the CLI's: 2 error, 3 worker died, 4 diverged, 128 + N signal N)
_RAN, _SKIPPED, _HELD = 0, 10, 11


def _job_main(r: _Run, workers: int) -> None:
    """One run of ``sweep --jobs`` in its own process; the exit code says how it ended."""
    from . import methods
    from .jobs import EXIT_DIVERGED, EXIT_WORKER_DIED, WorkerDied, exit_now, report_failure, run, run_workers
    from .rundir import RunLocked
    from .runner import Interrupted, RunDiverged
    # started with SIGINT/SIGTERM blocked (no KeyboardInterrupt while starting up): ignored until the run installs
    # its handler (it then stops after a round); the sweep passes the signal on again every second till then
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _pass_on if workers > 1 else signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    for p in r.cfg.plugins:
        methods.load_plugin(p)
    try:
        if workers > 1:
            done = run_workers(r.cfg, r.dir, workers, mode="auto", quiet=True, label=r.label)
        else:
            done = run(r.cfg, r.dir, mode="auto", quiet=True, label=r.label)
        code = _RAN if done is not None else _SKIPPED
    except RunLocked as e:
        print(f"{r.label}: skipped, {e}", flush=True)
        code = _HELD
    except Interrupted as e:
        code = 128 + e.signum
    except RunDiverged as e:
        print(f"{r.label}: {e}", file=sys.stderr, flush=True)
        code = EXIT_DIVERGED
    except WorkerDied as e:
        print(f"fedfast: {r.label}: {e}", file=sys.stderr, flush=True)
        code = EXIT_WORKER_DIED
    except Exception as e:  # noqa: BLE001 - a user's error, or one inside a plug-in's code; a bug re-raises
        code = report_failure(r.label, e, (ValueError, OSError, TypeError, MemoryError))
    exit_now(code)


def _pass_on(signum, _frame):
    """A ``--jobs`` process with ``--workers``: the signal goes on to its worker processes."""
    import multiprocessing as mp
    for p in mp.active_children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signum)


def _run_jobs(plan: list[_Run], jobs: int, workers: int, quiet: bool, out: str) -> list[str]:
    """``jobs`` runs at once, each in a process of its own. SIGINT/SIGTERM: no new run starts, the running ones
    checkpoint after their round and stop, and the sweep raises :class:`fedfast.runner.Interrupted` (the same
    command continues it). A run that fails stops new starts too; the others finish."""
    import multiprocessing as mp

    from .jobs import EXIT_DIVERGED, EXIT_ERROR, EXIT_WORKER_DIED
    from .rundir import status
    from .runner import Interrupted
    ctx = mp.get_context("spawn")
    pending, running, dirs, held, diverged, failed = list(plan), {}, [], [], [], []
    stop: dict = {}

    def forward():  # a scheduler's SIGTERM may reach this process only; a run still starting ignores it: again
        for p in list(running):
            if p.exitcode is None and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, stop["sig"])
        stop["sent"] = time.monotonic()

    def handler(signum, _frame):
        stop.setdefault("sig", signum)
        forward()
    old = {}
    with contextlib.suppress(ValueError):  # not the main thread: no signal handling
        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while pending or running:
            while pending and len(running) < jobs and not stop and not failed:
                r = pending.pop(0)
                p = ctx.Process(target=_job_main, args=(r, workers), daemon=False)
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
                try:
                    p.start()  # the child starts with the signals blocked; this process gets them on unblocking
                    running[p] = r
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                if not quiet:
                    print(f"{r.label}: started ({r.cfg['threads']} thread{'s' if r.cfg['threads'] != 1 else ''}) -> "
                          f"{r.dir}", flush=True)
            for p in [p for p in running if p.exitcode is not None]:
                r = running.pop(p)
                p.join()
                code = p.exitcode
                dirs.append(r.dir)
                if code == _RAN:
                    if not quiet:
                        print(_finished_line(r), flush=True)
                elif code == _SKIPPED:
                    if not quiet:
                        print(f"{r.label}: {status(r.dir)}, skipped", flush=True)
                elif code == _HELD:
                    held.append(r.dir)
                elif code == EXIT_DIVERGED:
                    diverged.append(r.dir)
                elif code is not None and code > 128 and stop:
                    pass  # stopped by the signal the sweep got: checkpointed
                else:
                    failed.append((r, code))
            if pending and stop:
                pending.clear()
            if stop and running and time.monotonic() - stop.get("sent", 0) > 1.0:
                forward()
            time.sleep(0.1)
    finally:
        for p in running:  # only on an error of this process: the runs checkpointed at their last round
            if p.exitcode is None:
                p.kill()
                p.join(10)
        for s, h in old.items():
            signal.signal(s, h)
    _tail(held, diverged, quiet)
    if stop:
        raise Interrupted(stop["sig"], -1, out, message=f"stopped by {signal.Signals(stop['sig']).name}: the running "
                          f"runs checkpointed; the same `fedfast sweep` command continues the study in {out}")
    if failed:
        r, code = failed[0]
        why = {EXIT_ERROR: "an error (its message is above)", EXIT_WORKER_DIED: "a worker process that died"}.get(
            code, f"exit code {code}" if code is not None and code >= 0 else f"signal {-code if code else '?'}")
        raise ValueError(f"{r.label} ({r.dir}) failed with {why}; no further runs were started. Fix it and run the "
                         f"same command again (finished runs are kept)")
    return dirs


def _finished_line(r: _Run) -> str:
    try:
        s = load_run(r.dir)
    except (ValueError, OSError):
        return f"{r.label}: done -> {r.dir}"
    acc = s.get("final_test_accuracy")
    return (f"{r.label}: final test_acc " + (f"{100 * acc:.2f}%" if acc is not None else "-")
            + (f"  val {100 * s['final_val_accuracy']:.2f}%" if s.get("final_val_accuracy") is not None else "")
            + f"  {s.get('wall_seconds', 0):.1f}s  -> {r.dir}")


@contextlib.contextmanager
def _study_lock(out: str):
    import fcntl
    fd = os.open(os.path.join(out, ".fedfast-study.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
