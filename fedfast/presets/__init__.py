"""Paper presets: the protocols of the five papers' result tables, shipped as TOML files in this folder.

A file is one table of one paper. It holds:

* ``[preset]``: ``paper``, ``table``, ``metric`` (``"final"`` or ``"best"``: which accuracy the paper reports),
  ``seeds``, and ``notes``;
* ``[protocol]``: the run keys every cell shares (the keys of a ``fedfast run`` config);
* ``[options.<method>]``: the options a method runs with in this paper (flat keys: its own table; a nested
  table, e.g. ``asd = {lam = 30.0}``, another table it reads);
* ``[engine.<method>]``: engine keys that differ for one method (e.g. ASD's FedDyn runs 10 local epochs);
* ``[cells.<cell>]``: the keys of one column of the table and ``reported``, the paper's number for each method
  row: ``[mean, std]`` in %, or ``[mean]`` where no std is given; ``options`` (``{method = {key = value}}``):
  options of a method in this cell only; ``missing`` (``{method = "why"}``): rows of the paper's table that have
  no number in this column, and why; ``reported_note``: what a reader must know before comparing with the
  reported numbers of this cell (e.g. the authors' statement that the released code differs from the paper's
  runs), which ``fedfast presets`` and ``fedfast report`` print beside the numbers.

A preset is one cell, named ``<file>/<cell>`` (``fedntd-table1/mnist-shards``). ``fedfast presets`` lists them;
``fedfast run --preset NAME --set algorithm=fedntd`` runs one method of one; ``fedfast sweep --preset NAME``
runs several methods over several seeds. Every method row of the five papers' tables runs in fedfast (a test
checks that each row names a registered method); rows a column does not have are listed with why.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field

_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Preset:
    name: str
    paper: str
    table: str
    cell: str
    metric: str                      # "final" or "best"
    seeds: list
    keys: dict                       # run and engine keys of the cell
    options: dict = field(default_factory=dict)   # {method: {option table: {...}}} as the paper runs them
    engine: dict = field(default_factory=dict)    # {method: {engine key: value}}
    reported: dict = field(default_factory=dict)  # {method: [mean] or [mean, std]} in %
    notes: str = ""
    default_methods: list = field(default_factory=list)
    missing: dict = field(default_factory=dict)   # {method: why the table has no number for it in this cell}
    reported_note: str = ""                       # what qualifies this cell's reported numbers (a fidelity note)

    def config(self, algorithm: str) -> dict:
        """The config dict (as a TOML file would give it) of ``algorithm`` in this cell."""
        from ..methods import get
        out = {**self.keys, **self.engine.get(algorithm, {}), "algorithm": algorithm}
        own = get(algorithm).table_name()
        for k, v in self.options.get(algorithm, {}).items():  # flat keys: the method's own table
            if isinstance(v, dict):
                out.setdefault(k, {}).update(v)
            else:
                out.setdefault(own, {})[k] = v
        return out

    @property
    def methods(self) -> list[str]:
        """The method rows of the cell (the paper's rows fedfast runs)."""
        return list(self.reported) or list(self.default_methods)


def _load_file(path: str) -> list[Preset]:
    stem = os.path.splitext(os.path.basename(path))[0]
    with open(path, "rb") as f:
        d = tomllib.load(f)
    meta = d.get("preset", {})
    out = []
    for cell, c in d.get("cells", {}).items():
        c = dict(c)
        reported = {k: list(v) for k, v in c.pop("reported", {}).items()}
        missing = {k: str(v) for k, v in c.pop("missing", {}).items()}
        note = " ".join(str(c.pop("reported_note", "")).split())
        opts = {m: dict(o) for m, o in d.get("options", {}).items()}
        for m, o in c.pop("options", {}).items():  # this cell's options of a method, over the file's
            merged = dict(opts.get(m, {}))
            for k, v in o.items():
                merged[k] = {**merged.get(k, {}), **v} if isinstance(v, dict) else v
            opts[m] = merged
        keys = {**d.get("protocol", {}), **c}
        out.append(Preset(f"{stem}/{cell}", meta.get("paper", ""), meta.get("table", ""), cell,
                          meta.get("metric", "final"), list(meta.get("seeds", [0, 1, 2])), keys, opts,
                          {m: dict(v) for m, v in d.get("engine", {}).items()}, reported, meta.get("notes", ""),
                          list(meta.get("methods", [])), missing, note))
    return out


def load_all() -> dict[str, Preset]:
    out = {}
    for fn in sorted(os.listdir(_DIR)):
        if fn.endswith(".toml"):
            for p in _load_file(os.path.join(_DIR, fn)):
                out[p.name] = p
    return out


def get(name: str) -> Preset:
    allp = load_all()
    if name not in allp:
        raise ValueError(f"--preset: no preset {name!r} (`fedfast presets` lists them)")
    return allp[name]


__all__ = ["Preset", "load_all", "get"]
