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

The package's parts: :mod:`.plan` (grids, labels, the runs of a sweep, shards, protocols), :mod:`.execute` (running
them: processes, threads, signals, the study's lock) and :mod:`.report` (reading runs, selecting grid points, the
tables as Markdown, CSV or LaTeX); :func:`sweep` joins planning and running.
"""

from __future__ import annotations

import json
import os

from .. import presets as _presets
from .._io import write_atomic
from ..config import read_config_file
from .execute import _assign_threads, _run_jobs, _run_serial, _study_lock
from .plan import (
    GRID_VAL_FRACTION,
    STUDY,
    _applies,
    _given,
    _merge_spec,
    _plan,
    _protocol,
    _sweep_axes,
    _token,
    check_grid,
    parse_grid,
    parse_shard,
    point_label,
)
from .report import (
    DEFAULT_SELECT,
    FORMATS,
    SELECT,
    SELECT_ALIASES,
    Study,
    _read_study,
    load_run,
    load_studies,
    mean_std,
    report,
    run_dirs,
    select,
    select_key,
    study_rows,
    tex,
)

__all__ = [
    "DEFAULT_SELECT",
    "FORMATS",
    "GRID_VAL_FRACTION",
    "SELECT",
    "SELECT_ALIASES",
    "STUDY",
    "Study",
    "load_run",
    "load_studies",
    "mean_std",
    "parse_grid",
    "parse_shard",
    "point_label",
    "report",
    "run_dirs",
    "select",
    "select_key",
    "study_rows",
    "sweep",
    "tex",
]


def sweep(
    out: str,
    methods: list[str],
    seeds: list[int],
    *,
    preset: str | None = None,
    config: str | None = None,
    overrides: list[str] | None = None,
    plugins=(),
    quiet: bool = False,
    workers: int = 1,
    grid: list[str] | None = None,
    jobs: int = 1,
    shard: tuple[int, int] | None = None,
) -> list[str]:
    """Run every (method, grid point, seed) of a study into ``out``; finished runs (complete or diverged) are
    skipped, interrupted ones resumed. ``preset``: a study file (``STUDY.toml``, ``STUDY.toml/CELL``) or a preset
    name; ``config``: a run config (or a study file). ``grid``: ``KEY=v1,v2`` items (over a study file's
    ``[grid]``). ``jobs``: runs at once, each with ``cores / (jobs * workers)`` threads. ``shard``: ``(I, N)``,
    the runs whose index in the plan is I mod N. Each run is taken under its directory's lock, so sweeps on one
    study (shards, restarted jobs, other machines on a shared filesystem) split its runs: a run another process
    holds is skipped at once. A diverged run is recorded and the sweep goes on. Every config is validated before
    anything is written. Returns the run directories of this process's part."""
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
    file_keys = read_config_file(config) if config else {}
    methods, seeds = _sweep_axes(overrides, file_keys, config, methods, seeds)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out: {out} is a file, not a study directory")
    multi = len(cells) > 1
    plan, specs, grid_added = [], [], False
    for c in cells:
        sub, spec, runs, added = _cell_plan(
            c, out, multi, methods, seeds, cli_grid, overrides, file_keys, config, plugins, quiet
        )
        specs.append((sub, spec))
        plan += runs
        grid_added = grid_added or added
    _record(out, cells, specs, multi)
    total = len(plan)
    for i, r in enumerate(plan):
        r.label = f"[{i + 1}/{total}] {r.method}{' ' + r.point if r.point else ''} seed {r.seed}"
    if shard is not None:
        plan = [r for i, r in enumerate(plan) if i % shard[1] == shard[0]]
        if not quiet:
            print(f"shard {shard[0]}/{shard[1]}: {len(plan)} of the study's {total} runs", flush=True)
    if grid_added and not quiet:
        print(
            f"grid: val_fraction = {GRID_VAL_FRACTION} of each run's training data is held out as the validation "
            f"split that `fedfast report` selects grid points on (--set val_fraction=F to change it)",
            flush=True,
        )
    _assign_threads(plan, jobs, workers)
    if jobs > 1:
        return _run_jobs(plan, jobs, workers, quiet, out)
    return _run_serial(plan, workers, quiet)


def _cell_plan(c, out, multi, methods, seeds, cli_grid, overrides, file_keys, config, plugins, quiet) -> tuple:
    """``(part directory, its study.json spec, its runs, whether the validation split was added for a grid)`` of
    one cell ``c`` of a sweep (None: a plain config) over ``methods`` x the grid x ``seeds``."""
    sub = os.path.join(out, c.cell) if multi else out
    ms = list(methods) or (c.methods if c is not None else [])
    if not ms:
        raise ValueError("--methods: which methods to run (a preset's or study file's rows are the default)")
    ss = list(seeds) if seeds else (c.seeds if c is not None else [0])
    if c is not None:
        check_grid(c.grid, c.methods, f"{c.source}: [grid]")  # the study's own grid against its own rows
    g = {
        k: [_token(v) for v in vals]
        for k, vals in (c.grid if c is not None else {}).items()
        if k not in cli_grid and _applies(k, ms)
    }  # the file's grid over methods this sweep runs
    skipped = sorted(set(c.grid if c is not None else {}) - set(g) - set(cli_grid))
    if skipped and not quiet:
        print(
            f"grid: {', '.join(skipped)} of {c.source} vary no method of --methods {','.join(ms)}: not swept",
            flush=True,
        )
    g.update(cli_grid)
    ov, added = list(overrides), False
    base_keys = c.keys if c is not None else {}
    if g and not _given("val_fraction", ov, file_keys, base_keys):
        ov.append(f"val_fraction={GRID_VAL_FRACTION}")  # grid points are selected on a validation split
        added = True
    plugs = tuple(plugins) + tuple(p for p in (c.plugins if c is not None else ()) if p not in plugins)
    spec = {
        "preset": c.name if c is not None else None,
        "study": c.source if c is not None and not c.packaged else None,
        "cell": c.card() if c is not None else None,
        "protocol": _protocol(c),
        "config": os.path.abspath(config) if config else None,
        "methods": ms,
        "seeds": ss,
        "overrides": overrides,
        "plugins": [os.path.abspath(x) for x in plugs],
        "grid": g,
        "select": c.select if c is not None else "",
    }
    if spec["select"]:
        select_key(spec["select"], f"{c.source}: preset.select")
    return sub, spec, _plan(sub, c, ms, ss, g, ov, config, file_keys, plugs), added


def _record(out: str, cells, specs, multi: bool) -> None:
    """Write (or merge into) each part's ``study.json``, and a several-cell study's list of parts; a study that
    changed what it is (its cell, protocol, methods' options) is refused before anything is written."""
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
