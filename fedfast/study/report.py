"""Reading a study's runs and writing its tables: means and spreads over seeds, grid-point selection on a
validation metric, the papers' numbers beside ours, as Markdown, CSV or LaTeX."""

from __future__ import annotations

import csv
import io
import math
import os
from dataclasses import dataclass

from .. import presets
from .._io import read_json, write_atomic
from ..fingerprint import identity
from ..rundir import REPLACED, recover
from .plan import STUDY, _label_value, point_label

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
SELECT_ALIASES = {
    "val": "final_val_accuracy",
    "val_best": "best_val_accuracy",
    "val_last10": "mean_last10_val_accuracy",
    "test": "final_test_accuracy",
    "test_best": "best_test_accuracy",
}
DEFAULT_SELECT = "final_val_accuracy"


def select_key(name: str | None, what: str = "--select") -> str:
    """The summary key a selection metric name (or alias) means; ValueError naming the choices."""
    name = (name or DEFAULT_SELECT).strip()
    key = SELECT_ALIASES.get(name, name)
    if key not in SELECT:
        raise ValueError(
            f"{what}: {name!r} is not a metric to select on (one of {', '.join(SELECT)}, or "
            f"{', '.join(SELECT_ALIASES)})"
        )
    return key


# -- grids ----------------------------------------------------------------------------------------------------


def run_dirs(root: str) -> list[str]:
    """Run directories (holding a summary.json) at or below ``root``, sorted. A run whose ``--force`` replacement
    was killed before its first round is put back first (:func:`fedfast.rundir.recover`); the folder it was set
    aside in is never a run of its own."""
    out = []
    for d, sub, files in os.walk(root):
        if REPLACED in sub:
            recover(d)
            files = os.listdir(d)
            sub[:] = [s for s in sub if s != REPLACED]
        if "summary.json" in files and "config.json" in files:
            out.append(d)
    return sorted(out)


def load_run(d: str) -> dict:
    """A run's summary.json with its config.json (``config``); ValueError naming a damaged file."""
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


_STATS = (
    "final_test_accuracy",
    "best_test_accuracy",
    "mean_last10_test_accuracy",
    "final_forgetting",
    "final_test_loss",
    "final_val_accuracy",
    "best_val_accuracy",
    "mean_last10_val_accuracy",
    "final_val_loss",
    "wall_seconds",
)


@dataclass
class Study:
    """One study directory read back: its runs, what study.json says of it, and its rows."""

    dir: str
    meta: dict
    cell: dict | None  # the cell's card (name, paper, table, metric, reported, reported_note, notes)
    runs: list
    grid: list  # the grid's keys

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
        cell = presets.get(meta["preset"], what=f"{os.path.join(d, STUDY)}: preset").card()
    return Study(d, meta, cell, runs, list((meta.get("grid") or {}).keys()))


def study_rows(st: Study) -> list[dict]:
    """A row per method and grid point: mean ± std over seeds of each summary metric (diverged runs counted,
    not averaged), the paper's number and Δ where the cell reports one."""
    order = st.meta.get("methods") or []
    groups: dict[tuple, list[dict]] = {}
    for r in st.runs:  # runs of other code or data (another fingerprint) are a row of their own: never one mean
        groups.setdefault(
            (
                r["config"]["algorithm"],
                point_label(r["config"], st.grid),
                identity(r["config"].get("fingerprint")) or "",
            ),
            [],
        ).append(r)
    split = {k[:2] for k in groups if sum(1 for j in groups if j[:2] == k[:2]) > 1}
    methods = [m for m in order if any(k[0] == m for k in groups)]
    methods += sorted({k[0] for k in groups} - set(methods))
    rows = []
    for m in methods:
        for key in sorted((k for k in groups if k[0] == m), key=lambda k: (_point_order(k[1], st.meta), k[2])):
            every = groups[key]
            g = [r for r in every if r["status"] != "diverged"]  # diverged runs: counted, not averaged
            div = sorted(
                ((r["config"]["seed"], r.get("diverged_round")) for r in every if r["status"] == "diverged"),
                key=lambda x: (x[0] is None, x),
            )
            row = {
                "study": st.title,
                "method": m,
                "point": key[1],
                "seeds": sorted(r["config"]["seed"] for r in g),
                "complete": all(r["complete"] for r in g),
                "rounds": min((r["rounds"] for r in g), default=None),
                "diverged": div,
                "runs": len(every),
                "selected": False,
                "fingerprint": (key[2] or "unrecorded") if key[:2] in split else None,
                "replaced": _replaced_of(every),
            }
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
    for st, key in zip(studies, chosen_on, strict=True):
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
        fr = sorted(
            {r["config"].get("val_fraction") for r in st.runs if r["config"]["algorithm"] in gridded} - {None, 0}
        )
        if not fr:
            return [
                f"Selection: none. The runs have no validation split (val_fraction = 0), and grid points are "
                f"selected on the {words} by default, never on the test set: sweep with --set "
                f"val_fraction=0.1, or name a metric with --select (e.g. --select final_test_accuracy, "
                f"which selects on the test set)."
            ]
        out.append(
            f"Selected per method: the grid point with the {'highest' if SELECT[key][0] else 'lowest'} mean "
            f"{words} over seeds (`{key}`; a validation split of val_fraction = "
            f"{', '.join(format(f, 'g') for f in fr)} of the training data, held out before partitioning, "
            f"not the test set); points with a diverged seed are not eligible."
        )
    else:
        out.append(
            f"Selected per method: the grid point with the {'highest' if SELECT[key][0] else 'lowest'} mean "
            f"{words} over seeds (`{key}`)"
            + (
                "; this selects on the test set, so the selected rows are optimistic estimates."
                if "test" in key
                else "."
            )
        )
    for m in gridded:
        r = picked.get(m)
        if r is None:
            out.append(f"- {m}: none selected (no point has the metric on every seed without divergence)")
        else:
            scale = 100.0 if "accuracy" in key else 1.0
            out.append(
                f"- {m}: {r['point']} ({_fmt(*r[key], scale=scale, digits=2 if scale == 100 else 4)}"
                + (", incomplete" if not r["complete"] else "")
                + ")"
            )
    return out


def _replaced_of(runs: list[dict]) -> dict | None:
    """What the rows' runs ran under a name a plug-in replaced: the method, and the dataset, partition or model."""
    out = {}
    for r in runs:
        out.update(r["config"].get("replaced_methods") or {})
        for kind, names in (r["config"].get("replaced_entries") or {}).items():
            out.update({f"{kind} {n}": v for n, v in names.items()})
    return out or None


def _label(r: dict) -> str:
    return (
        r["method"]
        + (" ‡" if r.get("replaced") else "")
        + (f" [{r['point']}]" if r["point"] else "")
        + (f" §{r['fingerprint']}" if r.get("fingerprint") else "")
    )


def _replaced_notes(rows: list[dict]) -> list[str]:
    """Rows whose method name (or dataset, partition, model) a plug-in replaced (register(..., replace=True)): what
    ran under that name; rows split by fingerprint: why."""
    seen = {}
    for r in rows:
        for name, v in (r.get("replaced") or {}).items():
            seen[name] = v
    out = [
        f"‡ {name} here is {v['by']}, registered with replace=True over {v['replaced']}: not fedfast's {name}."
        for name, v in sorted(seen.items())
    ]
    if any(r.get("fingerprint") for r in rows):
        out.append(
            "§ runs of one method and grid point made with other code or data (fedfast's source, the plug-ins "
            "and the modules they import, the data files: the run's fingerprint, in its config.json) are rows "
            "of their own, marked with the fingerprint, never averaged into one mean."
        )
    return out


def _tag(r: dict) -> str:
    tag = "" if r["complete"] else " (incomplete)"
    if r["diverged"]:
        tag += (
            f" ({len(r['diverged'])} of {r['runs']} diverged: "
            + ", ".join(f"seed {s} at round {d}" for s, d in r["diverged"])
            + "; not in the mean)"
        )
    return tag


def _paper_cells(r: dict, dagger: str) -> list:
    """The paper's number and Δ of a row, as table cells (not bold)."""
    p = r.get("paper")
    return [
        ((p[0] / 100, p[1] / 100 if p[1] is not None else None, 100.0, 2) if p else "–", False),
        (f"{r['delta']:+.2f}{dagger}" if r.get("delta") is not None else "–", False),
    ]


def _md_table(head: list[str], body: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(_md_cell(c, b) for c, b in cells) + " |" for cells in body
    ]


def _best(rows: list[dict], key: str) -> float | None:
    vals = [r[key][0] for r in rows if r[key][0] is not None]
    return max(vals) if vals else None


def _single(st: Study, rows: list[dict], sel_note: list[str], fmt: str) -> str:
    """One study: a row per method and grid point, then the selected rows."""
    has_val = any(r["final_val_accuracy"][0] is not None for r in rows)
    paper = bool(st.reported)
    cols = [
        ("final acc %", "final_test_accuracy", 100.0, 2),
        ("best acc %", "best_test_accuracy", 100.0, 2),
        ("last-10 mean %", "mean_last10_test_accuracy", 100.0, 2),
        ("forgetting", "final_forgetting", 1.0, 4),
    ]
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
        cells = [
            (name, False),
            (",".join(map(str, r["seeds"])) or "–", False),
            (str(r["rounds"]) if r["rounds"] is not None else "–", False),
        ]
        for _, k, scale, digits in cols:
            m, s = r[k]
            cells.append(((m, s, scale, digits), k in bold and m is not None and m == best[k]))
        if paper:
            cells += _paper_cells(r, dagger)
        body.append(cells)
    title = (
        f"{st.cell['name']}: {st.cell['paper']}, {st.cell['table']}"
        if st.cell and st.cell.get("paper")
        else f"Study {st.title}"
    )
    head_note = (
        f"The paper reports the {st.cell['metric']} test accuracy; Δ = ours − paper on that column." if paper else None
    )
    dev = sorted({str(r.get("device")) for r in st.runs})
    nd = sum(len(r["diverged"]) for r in rows)
    count = (
        f"{len(st.runs)} runs; device {', '.join(dev)}; mean ± sample std over seeds; bold: the best of the "
        f"column" + (f"; {nd} diverged run{'s' if nd > 1 else ''} left out of the means (marked)." if nd else ".")
    )
    note = f"† On the paper's numbers of this cell: {st.cell['reported_note']}" if dagger else None
    prov = [_provenance(r, st.dir) for r in st.runs]
    protocol = " ".join((st.cell or {}).get("notes", "").split())
    sel_note = _replaced_notes(rows) + sel_note
    if fmt == "latex":
        notes = [n for n in (head_note, count, note) if n] + sel_note + ([f"Protocol: {protocol}"] if protocol else [])
        return (
            _latex([(None, head[1:])], body, title, notes, grouped=False)
            + "% Runs (provenance):\n"
            + "".join(f"% {tex(p)}\n" for p in prov)
        )
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
            for r in pick if pick else mine:
                shown[(m + (" ‡" if r.get("replaced") else "")) if (pick or len(mine) == 1) else _label(r)] = r
        per.append(shown)
    labels = list(dict.fromkeys(k for shown in per for k in shown))
    groups, body = [], [[(lab, False)] for lab in labels]
    daggers = []
    for st, shown, title in zip(studies, per, titles, strict=True):
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
    metric_words = (
        "final test accuracy (%) unless the column says (best): the best over rounds, as that cell's paper reports"
    )
    notes = [
        f"Each entry: {metric_words}; mean ± sample std over seeds; bold: the best of the column. A gridded "
        f"method's row is its selected grid point."
    ]
    nd = sum(len(r["diverged"]) for rs in per_study for r in rs)
    if nd:
        notes.append(f"{nd} diverged run{'s' if nd > 1 else ''} left out of the means (see each study's report).")
    for title, note in daggers:
        notes.append(f"† {title}: {note}")
    notes += _replaced_notes([r for rs in per_study for r in rs])
    for title, sn in zip(titles, sel_notes, strict=True):
        if sn:
            notes.append(f"{title}: " + sn[0])
            notes += sn[1:]
    vers = sorted({_versions_line(r) for st in studies for r in st.runs})
    notes.append("Runs: " + "; ".join(vers) + ".")
    head_title = "Merged studies: " + ", ".join(f"{t} ({s.dir})" for t, s in zip(titles, studies, strict=True))
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
    return (
        f"fedfast {v.get('fedfast', '?')}"
        + (f" (commit {c if full else c[:12]})" if c else "")
        + f", torch {v.get('torch', '?')}"
        + (f", python {v.get('python', '?')}" if full else "")
        + f", device {r.get('device', '?')}"
    )


_TEX = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "±": r"$\pm$",
    "Δ": r"$\Delta$",
    "†": r"$^\dagger$",
    "−": "-",
    "–": "--",
    "—": "---",
    "≥": r"$\geq$",
    "≤": r"$\leq$",
    "×": r"$\times$",
    "α": r"$\alpha$",
    "β": r"$\beta$",
    "τ": r"$\tau$",
    "μ": r"$\mu$",
    "λ": r"$\lambda$",
    "δ": r"$\delta$",
    "ρ": r"$\rho$",
    "≈": r"$\approx$",
    "→": r"$\to$",
    "←": r"$\leftarrow$",
    "“": "``",
    "”": "''",
    "’": "'",
}


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
    lines = [
        f"% {tex(title)}",
        "% written by fedfast report; needs \\usepackage{booktabs}",
        r"\begin{table}[t]",
        r"\centering",
        r"\small",
        r"\begin{tabular}{l" + "c" * (ncols - 1) + "}",
        r"\toprule",
    ]
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


_CSV_STATS = (
    ("final_test_acc", "final_test_accuracy", 100.0),
    ("best_test_acc", "best_test_accuracy", 100.0),
    ("last10_test_acc", "mean_last10_test_accuracy", 100.0),
    ("forgetting", "final_forgetting", 1.0),
    ("final_test_loss", "final_test_loss", 1.0),
    ("final_val_acc", "final_val_accuracy", 100.0),
    ("best_val_acc", "best_val_accuracy", 100.0),
    ("last10_val_acc", "mean_last10_val_accuracy", 100.0),
    ("final_val_loss", "final_val_loss", 1.0),
    ("wall_s", "wall_seconds", 1.0),
)


def _csv(studies: list[Study], per_study: list[list[dict]], keys: list[str]) -> str:
    """Long format, a line per study, method and grid point (accuracies in %); ``selected`` marks the chosen grid
    point of a gridded method and ``selected_on`` the metric."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    head = (
        ["study", "dir", "method", "point", "selected", "selected_on", "status", "seeds", "n", "diverged", "rounds"]
        + [f"{n}_{x}" for n, _, _ in _CSV_STATS for x in ("mean", "std")]
        + ["paper_metric", "paper_mean", "paper_std", "delta"]
    )
    w.writerow(head)
    for st, rows, key in zip(studies, per_study, keys, strict=True):
        many = set(_gridded(rows))
        for r in rows:
            gridded = r["method"] in many
            line = [
                st.title,
                st.dir,
                r["method"],
                r["point"],
                str(r["selected"]).lower() if gridded else "",
                key if gridded else "",
                "complete" if r["complete"] else "incomplete",
                " ".join(map(str, r["seeds"])),
                len(r["seeds"]),
                " ".join(f"{s}@{d}" for s, d in r["diverged"]),
                r["rounds"] if r["rounds"] is not None else "",
            ]
            for _, k, scale in _CSV_STATS:
                m, s = r[k]
                line += ["" if m is None else f"{scale * m:.10g}", "" if s is None else f"{scale * s:.10g}"]
            p = r.get("paper")
            line += [
                st.cell["metric"] if p else "",
                p[0] if p else "",
                p[1] if p and p[1] is not None else "",
                f"{r['delta']:.4f}" if r.get("delta") is not None else "",
            ]
            w.writerow(line)
    return buf.getvalue()


def _provenance(r: dict, root: str) -> str:
    return f"`{os.path.relpath(r['dir'], root)}`: {r['status']}, {_versions_line(r, full=True)}"


# -- sweeps ----------------------------------------------------------------------------------------------------
