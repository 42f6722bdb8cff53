"""Planning a study: option grids and their labels, the runs of a sweep (methods x grid points x seeds, parts of a
study file), shards of it for a job array, and the protocol each part records."""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass

from .. import methods as _methods
from ..config import KEYS, build_config

STUDY = "study.json"
GRID_VAL_FRACTION = 0.1  # a gridded sweep's validation split when none is given


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


@dataclass(kw_only=True)
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
        raise ValueError(
            f"--shard: I/N with integers 0 <= I < N (e.g. 0/4; a Slurm array: "
            f"$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT), got {text!r}"
        ) from None
    if not 0 <= i < n:
        raise ValueError(f"--shard: I/N needs 0 <= I < N (shards are numbered from 0), got {text!r}")
    return i, n


def _given(key: str, overrides: list[str], file_keys, base: dict) -> bool:
    """Whether the user set ``key``: an override, the config file (its keys) or the study's cell."""
    return key in base or key in file_keys or any(o.split("=", 1)[0].strip() == key for o in overrides)


def _applies(key: str, methods: list[str]) -> bool:
    """Whether a grid key varies some of ``methods``: an engine or run key, or an option table one reads."""
    return "." not in key or any(key.split(".", 1)[0] in _methods.get(m).option_tables() for m in methods)


def _sweep_axes(overrides: list[str], file_keys: dict, config: str | None, methods, seeds):
    """The sweep's methods and seeds, with what would otherwise be silently dropped refused or used: ``--set
    algorithm`` / ``--set seed`` (a sweep's methods and seeds are ``--methods`` and ``--seeds``), a config file's
    ``algorithm`` not among ``--methods``; a config file's ``algorithm`` / ``seed`` are the defaults of
    ``--methods`` / ``--seeds``."""
    for o in overrides:
        k, _, v = o.partition("=")
        if k.strip() in ("algorithm", "seed"):
            axis = "methods" if k.strip() == "algorithm" else "seeds"
            raise ValueError(
                f"--set {k.strip()}: a sweep runs the {axis} of --{axis} (or the study's); use --{axis} {v.strip()}"
            )
    methods, seeds = list(methods or []), list(seeds or [])
    algo = file_keys.get("algorithm")
    if algo is not None:
        if methods and algo not in methods:
            raise ValueError(
                f"{config}: algorithm = {algo!r} is not among --methods {','.join(methods)}: a sweep "
                f"runs the --methods; drop the file's algorithm or add it to --methods"
            )
        methods = methods or [algo]
    if file_keys.get("seed") is not None and not seeds:
        seeds = [int(file_keys["seed"])]
    return methods, seeds


def check_grid(grid: dict, methods, where: str) -> None:
    """A study's grid keys against its methods: a ``table.key`` that no registered method reads (a misspelled
    table) or that none of ``methods`` reads is an error naming ``where`` and the key (it would vary nothing)."""
    known = {t for name in _methods.names() for t in _methods.get(name).option_tables()}
    for k in grid:
        if "." not in k:
            continue
        table = k.split(".", 1)[0]
        if table not in known:
            raise ValueError(
                f"{where} {k}: no method reads an option table {table!r} (misspelled? the tables: "
                f"{', '.join(sorted(known))})"
            )
        if methods and not _applies(k, list(methods)):
            raise ValueError(
                f"{where} {k}: none of the study's methods ({', '.join(methods)}) reads the table "
                f"{table!r}, so the grid would vary nothing; add the method that reads it, or drop "
                f"the key"
            )


def _plan(
    sub: str,
    cell,
    methods: list[str],
    seeds: list[int],
    grid: dict,
    overrides: list[str],
    config: str | None,
    file_keys,
    plugins,
) -> list[_Run]:
    """Every (method, grid point, seed) of one study with its config, built (so validated) before any run."""
    for k in grid:
        if k in ("algorithm", "seed"):
            raise ValueError(f"--grid {k}: use --{'methods' if k == 'algorithm' else 'seeds'} for it")
        if "." not in k and k not in KEYS:
            raise ValueError(
                f"--grid {k}: unknown config key (engine and run keys: `fedfast run` keys; method "
                f"options: method.key, e.g. fedprox.mu)"
            )
    tables = {m: set(_methods.get(m).option_tables()) for m in methods}
    for k in grid:
        if "." in k and not any(k.split(".", 1)[0] in t for t in tables.values()):
            raise ValueError(
                f"--grid {k}: no method of the study reads the table {k.split('.', 1)[0]!r} (methods: "
                f"{', '.join(methods)})"
            )
    plan, seen = [], set()
    for m in methods:
        axes = [(k, vals) for k, vals in grid.items() if "." not in k or k.split(".", 1)[0] in tables[m]]
        for pt in itertools.product(*[[(k, v) for v in vals] for k, vals in axes]):
            for s in seeds:
                base = cell.config(m) if cell is not None else {}
                sets = [f"{k}={v}" for k, v in pt]
                try:
                    cfg = build_config(
                        config,
                        [*overrides, *sets, f"algorithm={m}", f"seed={s}"],
                        base=base,
                        plugins=plugins,
                        source=cell.source if cell is not None else None,
                        root=cell.root if cell is not None else None,
                    )
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
                plan.append(
                    _Run(
                        method=m,
                        seed=s,
                        point=point,
                        cfg=cfg,
                        dir=d,
                        threads_given=_given("threads", overrides, file_keys, base),
                    )
                )
    return plan


def _protocol(c) -> dict | None:
    if c is None:
        return None
    return json.loads(
        json.dumps({"keys": c.keys, "options": c.options, "engine": c.engine}, sort_keys=True, default=str)
    )


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
        diff = sorted(
            f"{part}.{k}" if part != "keys" else k
            for part in set(a) | set(b)
            for k in set(a.get(part) or {}) | set(b.get(part) or {})
            if (a.get(part) or {}).get(k) != (b.get(part) or {}).get(k)
        )
        raise ValueError(
            f"{sub}: its study's protocol changed since it ran ({', '.join(diff)} differ in "
            f"{spec['study'] or spec['preset']}); use another --out, or put the study file back"
        )
    og = old.get("grid") or {}
    if og and set(og) != set(spec["grid"]):
        raise ValueError(
            f"{sub}: is a study with a grid over {', '.join(og)}, not "
            f"{', '.join(spec['grid']) or 'no grid'}; use another --out"
        )
    if not og and spec["grid"] and old.get("methods"):
        raise ValueError(f"{sub}: is a study without a grid; a grid over {', '.join(spec['grid'])} needs another --out")
    if not isinstance(old.get("methods", []), list) or not isinstance(old.get("seeds", []), list):
        raise ValueError(f"{path}: damaged (methods or seeds is not a list)")
    grid = {k: list(og.get(k, [])) + [v for v in vals if v not in og.get(k, [])] for k, vals in spec["grid"].items()}
    return {
        **spec,
        "methods": old.get("methods", []) + [m for m in spec["methods"] if m not in old.get("methods", [])],
        "seeds": old.get("seeds", []) + [s for s in spec["seeds"] if s not in old.get("seeds", [])],
        "grid": grid,
    }
