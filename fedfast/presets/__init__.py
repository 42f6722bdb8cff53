"""Study files: the protocol of a table (a paper's, or your own), its method rows, cells and reported numbers.

The papers' presets are study files that ship in this folder; ``fedfast sweep STUDY.toml``, ``fedfast presets
STUDY.toml`` and ``fedfast run --preset STUDY.toml/CELL`` take the same format from any path. A file is one table.
It holds:

* ``[preset]``: ``paper``, ``table``, ``metric`` (``"final"`` or ``"best"``: which accuracy the reported numbers
  are), ``seeds``, ``notes``, ``methods`` (rows every cell runs besides the rows it reports: a cell runs the
  union, its reported rows first; ``fedfast sweep --methods`` narrows it), ``plugins`` (plug-in method
  files, paths relative to the study file, imported when the file is loaded) and ``select`` (the metric
  ``fedfast report`` selects a grid point on; default the final validation accuracy);
* ``[protocol]``: the run keys every cell shares (the keys of a ``fedfast run`` config);
* ``[options.<method>]``: the options a method runs with (flat keys: its own table; a nested table, e.g.
  ``asd = {lam = 30.0}``, another table it reads);
* ``[engine.<method>]``: engine keys that differ for one method (e.g. ASD's FedDyn runs 10 local epochs);
* ``[grid]``: option grids, ``"fedprox.mu" = [0.01, 0.1, 1.0]`` or ``lr = [0.01, 0.05]`` (``fedfast sweep --grid``
  adds to them and overrides a key given in both);
* ``[cells.<cell>]``: the keys of one column of the table and ``reported``, the paper's number for each method
  row: ``[mean, std]`` in %, or ``[mean]`` where no std is given; ``options`` (``{method = {key = value}}``):
  options of a method in this cell only; ``missing`` (``{method = "why"}``): rows of the paper's table that have
  no number in this column, and why; ``reported_note``: what a reader must know before comparing with the
  reported numbers of this cell (e.g. the authors' statement that the released code differs from the paper's
  runs), which ``fedfast presets`` and ``fedfast report`` print beside the numbers. A file without cells has one,
  named ``default``.

A preset is one cell, named ``<file>/<cell>`` (``fedntd-table1/mnist-shards``); ``<file>`` alone names every cell
of a file. ``fedfast presets`` lists the package's; ``fedfast run --preset NAME --set algorithm=fedntd`` runs one
method of one; ``fedfast sweep --preset NAME`` runs several methods over several seeds. Every method row of the
five papers' tables runs in fedfast (a test checks that each row names a registered method); rows a column does
not have are listed with why. Unknown tables and keys are refused with the file and key named.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .. import methods
from ..config import read_config_file

_DIR = os.path.dirname(os.path.abspath(__file__))
_TOP = ("preset", "protocol", "options", "engine", "grid", "cells")
_META = ("paper", "table", "metric", "seeds", "notes", "methods", "plugins", "select")
_CELL_OWN = ("reported", "missing", "reported_note", "options")


@dataclass
class Preset:
    name: str
    paper: str
    table: str
    cell: str
    metric: str  # "final" or "best"
    seeds: list
    keys: dict  # run and engine keys of the cell
    options: dict = field(default_factory=dict)  # {method: {option table: {...}}} as the paper runs them
    engine: dict = field(default_factory=dict)  # {method: {engine key: value}}
    reported: dict = field(default_factory=dict)  # {method: [mean] or [mean, std]} in %
    notes: str = ""
    default_methods: list = field(default_factory=list)  # [preset] methods: rows every cell runs
    missing: dict = field(default_factory=dict)  # {method: why the table has no number for it in this cell}
    reported_note: str = ""  # what qualifies this cell's reported numbers (a fidelity note)
    source: str = ""  # the study file (absolute path)
    plugins: tuple = ()  # plug-in method files it names (absolute paths)
    grid: dict = field(default_factory=dict)  # {key: [values]}: option grids of the study
    select: str = ""  # the metric report selects grid points on ("" = the default)

    def config(self, algorithm: str) -> dict:
        """The config dict (as a TOML file would give it) of ``algorithm`` in this cell."""
        out = {**self.keys, **self.engine.get(algorithm, {}), "algorithm": algorithm}
        own = methods.get(algorithm).table_name()
        for k, v in self.options.get(algorithm, {}).items():  # flat keys: the method's own table
            if isinstance(v, dict):
                out.setdefault(k, {}).update(v)
            else:
                out.setdefault(own, {})[k] = v
        return out

    @property
    def methods(self) -> list[str]:
        """The method rows of the cell: the rows it reports numbers for, then the file's ``methods`` not among
        them (a study that lists a paper's baselines and adds its own method runs both)."""
        return list(dict.fromkeys([*self.reported, *self.default_methods]))

    @property
    def packaged(self) -> bool:
        return os.path.dirname(self.source) == _DIR

    @property
    def root(self) -> str | None:
        """The directory relative paths of the cell resolve against: the study file's; None (the working
        directory) for the presets fedfast ships, whose ``data_dir = "data"`` is the user's data."""
        return None if self.packaged or not self.source else os.path.dirname(self.source)

    def card(self) -> dict:
        """What a study directory records of its cell (study.json), so that its report needs no study file."""
        return {
            "name": self.name,
            "source": self.source,
            "paper": self.paper,
            "table": self.table,
            "cell": self.cell,
            "metric": self.metric,
            "reported": self.reported,
            "notes": self.notes,
            "missing": self.missing,
            "reported_note": self.reported_note,
        }


def _fail(path: str, where: str, msg: str) -> ValueError:
    return ValueError(f"{path}: {where}: {msg}")


def _table(path: str, where: str, v) -> dict:
    if not isinstance(v, dict):
        raise _fail(path, where, f"expected a table, got {type(v).__name__} {v!r}")
    return v


def flat_grid(path: str, grid: dict, where: str = "grid") -> dict:
    """``{"fedprox.mu": [...]}`` or ``{fedprox = {mu = [...]}}`` (TOML's dotted keys) as flat keys to value lists."""
    out = {}
    for k, v in grid.items():
        if isinstance(v, dict):
            for k2, v2 in flat_grid(path, v, f"{where}.{k}").items():
                out[f"{k}.{k2}"] = v2
        elif isinstance(v, list) and v and all(isinstance(x, (bool, int, float, str)) for x in v):
            out[k] = list(v)
        else:
            raise _fail(path, f"{where}.{k}", f"expected a non-empty list of values, got {v!r}")
    return out


def load_file(path: str) -> list[Preset]:
    """The cells of a study file, its plug-in method files imported; ValueError naming the file and key of what
    is wrong."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"study file {path}: no such file")
    d = read_config_file(path)
    bad = [k for k in d if k not in _TOP]
    if bad:
        raise _fail(
            path,
            bad[0],
            f"unknown table or key of a study file (known: {', '.join(_TOP)}; a study's "
            f"run keys go in [protocol] or a cell)",
        )
    meta, metric, seeds = _study_meta(path, d)
    plugins = _study_plugins(path, meta)
    protocol = _table(path, "protocol", d.get("protocol", {}))
    options = {
        m: dict(_table(path, f"options.{m}", o)) for m, o in _table(path, "options", d.get("options", {})).items()
    }
    engine = {m: dict(_table(path, f"engine.{m}", e)) for m, e in _table(path, "engine", d.get("engine", {})).items()}
    grid = flat_grid(path, _table(path, "grid", d.get("grid", {})))
    cells = _table(path, "cells", d.get("cells", {"default": {}}))
    stem = os.path.splitext(os.path.basename(path))[0]
    out = []
    for cell, c in cells.items():
        c = dict(_table(path, f"cells.{cell}", c))
        reported, missing, note, opts = _cell_tables(path, cell, c, options)
        keys = {**protocol, **c}
        out.append(
            Preset(
                f"{stem}/{cell}",
                meta.get("paper", ""),
                meta.get("table", ""),
                cell,
                metric,
                list(seeds),
                keys,
                opts,
                engine,
                reported,
                meta.get("notes", ""),
                list(meta.get("methods", [])),
                missing,
                note,
                path,
                tuple(plugins),
                grid,
                meta.get("select", ""),
            )
        )
    return out


def _study_meta(path: str, d: dict) -> tuple:
    """``(meta, metric, seeds)``: a study file's ``[preset]`` table, checked key by key."""
    meta = _table(path, "preset", d.get("preset", {}))
    bad = [k for k in meta if k not in _META]
    if bad:
        raise _fail(path, f"preset.{bad[0]}", f"unknown key (known: {', '.join(_META)})")
    metric = meta.get("metric", "final")
    if metric not in ("final", "best"):
        raise _fail(
            path, "preset.metric", f'"final" or "best" (which accuracy the reported numbers are), got {metric!r}'
        )
    seeds = meta.get("seeds", [0, 1, 2])
    if not isinstance(seeds, list) or not seeds or not all(type(s) is int and s >= 0 for s in seeds):
        raise _fail(path, "preset.seeds", f"expected a non-empty list of integers >= 0, got {seeds!r}")
    for k in ("paper", "table", "notes", "select"):
        if not isinstance(meta.get(k, ""), str):
            raise _fail(path, f"preset.{k}", f"expected a string, got {meta[k]!r}")
    for k in ("methods", "plugins"):
        v = meta.get(k, [])
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise _fail(path, f"preset.{k}", f"expected a list of strings, got {v!r}")
    return meta, metric, seeds


def _study_plugins(path: str, meta: dict) -> list:
    """The plug-in method files ``[preset] plugins`` names (beside the study file), imported; their paths."""
    plugins = []
    for p in meta.get("plugins", []):
        full = os.path.join(os.path.dirname(path), p)
        if not os.path.isfile(full):
            raise _fail(path, "preset.plugins", f"{p}: no such file beside the study file ({full})")
        plugins.append(os.path.abspath(full))
    if plugins:
        for p in plugins:
            methods.load_plugin(p)
    return plugins


def _cell_tables(path: str, cell: str, c: dict, options: dict) -> tuple:
    """``(reported, missing, note, options)`` of cell ``cell`` (its dict ``c``, these keys popped from it): the
    paper's numbers, the methods it lacks and why, its note, and the methods' options, the cell's over the file's."""
    reported = {}
    for m, v in _table(path, f"cells.{cell}.reported", c.pop("reported", {})).items():
        if not (
            isinstance(v, list)
            and 1 <= len(v) <= 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
        ):
            raise _fail(path, f"cells.{cell}.reported.{m}", f"expected [mean] or [mean, std] in %, got {v!r}")
        reported[m] = [float(x) for x in v]
    missing = {k: str(v) for k, v in _table(path, f"cells.{cell}.missing", c.pop("missing", {})).items()}
    note = " ".join(str(c.pop("reported_note", "")).split())
    opts = {m: dict(o) for m, o in options.items()}
    for m, o in _table(path, f"cells.{cell}.options", c.pop("options", {})).items():
        merged = dict(opts.get(m, {}))  # this cell's options of a method, over the file's
        for k, v in _table(path, f"cells.{cell}.options.{m}", o).items():
            merged[k] = {**merged.get(k, {}), **v} if isinstance(v, dict) else v
        opts[m] = merged
    return reported, missing, note, opts


def is_study_file(path: str) -> bool:
    """A TOML file with a study file's tables (``[preset]``, ``[protocol]``, ``[cells]``, ...), not a run config
    (whose keys can be none of them)."""
    if not (path.endswith(".toml") and os.path.isfile(path)):
        return False
    d = read_config_file(path)
    return any(k in d for k in _TOP)


def names_study(spec: str) -> bool:
    """Whether a positional argument names a study file or one of its cells (``STUDY.toml[/CELL]``) rather
    than a run config."""
    return is_study_file(spec) or (".toml/" in spec and not os.path.isfile(spec))


def load_all() -> dict[str, Preset]:
    """The presets that ship with fedfast, by name."""
    out = {}
    for fn in sorted(os.listdir(_DIR)):
        if fn.endswith(".toml"):
            for p in load_file(os.path.join(_DIR, fn)):
                out[p.name] = p
    return out


def resolve(spec: str, what: str = "--preset") -> list[Preset]:
    """The cells ``spec`` names: a study file (every cell), ``STUDY.toml/CELL``, a preset ``FILE/CELL``, or a
    preset file's name ``FILE`` (every cell)."""
    if os.path.isfile(spec):
        return load_file(spec)
    i = spec.rfind(".toml/")
    if i >= 0 and os.path.isfile(spec[: i + 5]):
        cells = load_file(spec[: i + 5])
        want = spec[i + 6 :]
        hit = [p for p in cells if p.cell == want]
        if not hit:
            raise ValueError(
                f"{what}: {spec[: i + 5]} has no cell {want!r} (its cells: {', '.join(p.cell for p in cells)})"
            )
        return hit
    if spec.endswith(".toml") or ".toml/" in spec:
        raise ValueError(f"{what}: study file {spec[: i + 5] if i >= 0 else spec}: no such file")
    allp = load_all()
    if spec in allp:
        return [allp[spec]]
    whole = [p for p in allp.values() if p.name.split("/", 1)[0] == spec]
    if whole:
        return whole
    raise ValueError(
        f"{what}: no preset {spec!r} and no such study file (`fedfast presets` lists the presets; a "
        f"study file is a path ending in .toml)"
    )


def get(name: str, what: str = "--preset") -> Preset:
    """The one cell ``name`` names (see :func:`resolve`)."""
    cells = resolve(name, what)
    if len(cells) > 1:
        raise ValueError(
            f"{what}: {name} has {len(cells)} cells; name one as {name}/CELL (cells: "
            f"{', '.join(p.cell for p in cells)})"
        )
    return cells[0]


__all__ = ["Preset", "load_all", "load_file", "resolve", "get", "is_study_file", "names_study", "flat_grid"]
