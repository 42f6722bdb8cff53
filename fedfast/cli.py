"""The ``fedfast`` command (also ``python -m fedfast``).

* ``fedfast run [CONFIG.toml] [--set key=value | --set method.key=value ...] [--plugin FILE.py] [--out DIR]``:
  writes ``DIR/config.json`` (the resolved configuration, the method's options included) and
  ``DIR/metrics.jsonl`` (one JSON object per round: round, test_accuracy, best_test_accuracy, test_loss,
  train_loss, forgetting, class_accuracy, seconds, timers, client_chunk). Before partitioning, the method's
  ``hold_out`` takes its server-held splits out of the training set (FedGKD-VOTE's validation split, FedCAD's
  auxiliary set with ``fedcad.aux_holdout = true``).
* ``fedfast methods [NAME] [--plugin FILE.py]``: every method with its options, defaults and paper; one in full.

``--plugin FILE.py`` imports a file that registers methods (``@fedfast.methods.register("name")``), so
``--set algorithm=name`` runs a method fedfast does not ship."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from . import __version__, methods, presets
from ._deprecation import show_once
from ._io import read_json
from .bench import main as bench
from .config import build_config
from .doctor import main as doctor
from .jobs import EXIT_DIVERGED, EXIT_WORKER_DIED, WorkerDied, plugin_where, run, run_workers
from .plot import accuracy_curves
from .rundir import recover
from .runner import Interrupted, RunDiverged
from .study import parse_shard, report, sweep


def _methods_cmd(name: str | None) -> int:
    if name:
        print(methods.describe(name))
        return 0
    for n in methods.names(asd=False):
        print(methods.describe(n, full=False))
        print()
    print(
        "ASD add-on (algorithm = '<base>+asd', options in [asd]): "
        + ", ".join(n for n in methods.names() if n.endswith("+asd"))
    )
    print(f"  engine default: max_grad_norm={methods.ASD.max_grad_norm:g} ({methods.ASD.max_grad_norm_source})")
    d = methods.describe("fedavg+asd", full=False)
    print(d[d.index("  [asd]") :])
    return 0


def console() -> None:
    """The ``fedfast`` command (and ``python -m fedfast``): :func:`main`, then exit without the interpreter's
    teardown. Every output is written and closed by then; the teardown only frees memory and unloads torch, and
    took ~0.5 s of every command on the 2-core VM (``import torch`` then a normal exit: 2.5 s, with ``os._exit``:
    2.0 s). Each fedfast deprecation notice is shown once (a plug-in's old forms: Python's default filters would hide
    them)."""
    show_once()
    try:
        code = main()
    except SystemExit as e:  # argparse errors and --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def _parser() -> argparse.ArgumentParser:
    """The command line: every subcommand with its arguments (in the order ``--help`` lists them)."""
    ap = argparse.ArgumentParser(prog="fedfast", description="fedfast: batched federated KD simulation")
    ap.add_argument(
        "--version",
        action="version",
        version=f"fedfast {__version__} (torch {torch.__version__}, python {sys.version.split()[0]})",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for add in (_run_parser, _listing_parsers, _sweep_parser, _output_parsers, _tool_parsers):
        add(sub)
    ap.epilog = "Under torchrun (WORLD_SIZE > 1) each process trains its share of every round's clients."
    return ap


def _run_parser(sub) -> None:
    """``fedfast run``."""
    r = sub.add_parser("run", help="run a simulation into a run directory")
    r.add_argument("config", nargs="?", help="TOML config file, or a run's config.json (runs it again)")
    r.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (engine/run keys: key=value; method options: method.key=value)",
    )
    r.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="FILE.py",
        help="import a file that registers methods (@fedfast.methods.register)",
    )
    r.add_argument("--out", default=None, help="run directory (default runs/latest)")
    r.add_argument(
        "--resume", metavar="DIR", help="continue the run in DIR from its checkpoint (--set rounds=N extends it)"
    )
    r.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    r.add_argument("--quiet", action="store_true", help="no progress output")
    r.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="N local processes over torch.distributed, each training its share of every round's "
        "clients with cores/N threads (CPU)",
    )
    r.add_argument(
        "--preset",
        metavar="NAME",
        help="a preset (fedfast presets) or a study file's cell "
        "(STUDY.toml/CELL); --set algorithm=... picks the row "
        "(default: its first)",
    )


def _listing_parsers(sub) -> None:
    """``fedfast methods`` and ``fedfast presets``."""
    mt = sub.add_parser("methods", help="list the methods with their options, defaults and papers")
    mt.add_argument("name", nargs="?", help="show one method in full (e.g. fedntd, fedavg+asd)")
    mt.add_argument("--plugin", action="append", default=[], metavar="FILE.py")
    pr = sub.add_parser("presets", help="list the paper presets (protocols and reported numbers)")
    pr.add_argument(
        "name",
        nargs="?",
        help="show one preset in full; a study file (STUDY.toml) lists its cells, STUDY.toml/CELL shows one",
    )


def _sweep_parser(sub) -> None:
    """``fedfast sweep``."""
    sw = sub.add_parser(
        "sweep",
        help="run methods x grid points x seeds into a study directory (skips complete runs, resumes interrupted ones)",
    )
    sw.add_argument("config", nargs="?", help="a study file (STUDY.toml, STUDY.toml/CELL) or a TOML run config")
    sw.add_argument("--preset", metavar="NAME", help="a preset (FILE/CELL, or FILE: every cell)")
    sw.add_argument("--methods", default="", help="comma-separated methods (default: the study's rows)")
    sw.add_argument("--seeds", default="", help="comma-separated seeds (default: the study's, else 0)")
    sw.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="run every value (repeatable: the cross product); engine/run keys or method.key",
    )
    sw.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sw.add_argument("--plugin", action="append", default=[], metavar="FILE.py")
    sw.add_argument("--out", required=True, help="study directory")
    sw.add_argument("--quiet", action="store_true")
    sw.add_argument("--workers", type=int, default=1, metavar="N", help="each run in N local processes")
    sw.add_argument(
        "--jobs", type=int, default=1, metavar="N", help="N runs at once, each in its own process with cores/N threads"
    )
    sw.add_argument(
        "--shard",
        metavar="I/N",
        help="run only the I-th of N disjoint parts of the study (0 <= I < N; a job array's task)",
    )


def _output_parsers(sub) -> None:
    """``fedfast report`` and ``fedfast plot``."""
    rp = sub.add_parser(
        "report",
        help="the study's table (mean ± std over seeds, the paper's numbers); several "
        "studies: merged, methods x cells. Prints it and writes DIR/report.<ext>",
    )
    rp.add_argument("dirs", nargs="+", metavar="DIR", help="study directories")
    rp.add_argument("--format", default="md", choices=("md", "csv", "latex"))
    rp.add_argument(
        "--select",
        default=None,
        metavar="METRIC",
        help="the metric a grid point is selected on (default final_val_accuracy: the validation "
        "split, never the test set)",
    )
    rp.add_argument("-o", "--out", default=None, metavar="FILE", help="also write the table to FILE")
    pl = sub.add_parser("plot", help="test accuracy against round, mean ± std over seeds, one line per method")
    pl.add_argument("dirs", nargs="+", help="study or run directories")
    pl.add_argument("-o", "--out", required=True, help="PNG file to write")
    pl.add_argument("--title", default=None)


def _tool_parsers(sub) -> None:
    """``fedfast bench`` and ``fedfast doctor``."""
    bn = sub.add_parser(
        "bench", help="the fused losses against their authors' code (time, peak memory)", add_help=False
    )
    bn.add_argument("bench_args", nargs=argparse.REMAINDER)
    dr = sub.add_parser(
        "doctor",
        help="versions, devices, built backends; every backend checked against the reference (ops and an engine round)",
    )
    dr.add_argument("--quick", action="store_true", help="ops only, no engine round")
    dr.add_argument(
        "--triton-interpret",
        action="store_true",
        help="also check the Triton kernels in Triton's interpreter (CPU-only machines)",
    )


def main(argv=None) -> int:
    """Exit status: 0 done; 2 bad input (config, files, a directory in use: the message names it); 3 a
    ``--workers`` process died; 4 the run diverged (its directory records it); 128 + N stopped by signal N after
    a round (checkpointed: ``--resume`` continues)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own options (fedfast.bench.main); the subparser only lists it
        return bench(argv[1:])
    args = _parser().parse_args(argv)
    if args.cmd == "doctor":
        if args.triton_interpret:
            os.environ["TRITON_INTERPRET"] = "1"
        return doctor(quick=args.quick)
    try:
        code = _dispatch(args)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and torch.distributed.is_initialized():  # under torchrun
            torch.distributed.destroy_process_group()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # skip interpreter teardown, where gloo's threads can abort a finished process
        return code
    except Interrupted as e:
        print(f"fedfast: {e}", file=sys.stderr)
        return 128 + e.signum
    except WorkerDied as e:
        print(f"fedfast: {e}", file=sys.stderr)
        return EXIT_WORKER_DIED
    except RunDiverged as e:
        print(f"fedfast: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except (ValueError, OSError, TypeError, MemoryError) as e:  # bad config, data, partitions, memory: no traceback
        print(f"fedfast: {plugin_where(e)}{e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - an error inside a plug-in's code: its file and line, no traceback
        where = plugin_where(e)
        if not where:
            raise
        print(f"fedfast: {where}{type(e).__name__}: {e}", file=sys.stderr)
        return 2


def _dispatch(args) -> int:
    for p in args.plugin if hasattr(args, "plugin") else []:
        methods.load_plugin(p)
    if args.cmd == "methods":
        return _methods_cmd(args.name)
    if args.cmd == "presets":
        return _presets_cmd(args.name)
    if args.cmd == "report":
        text, _ = report(args.dirs, args.format, args.select, args.out)
        print(text, end="")
        return 0
    if args.cmd == "plot":
        accuracy_curves(args.dirs, args.out, title=args.title)
        print(f"wrote {args.out}")
        return 0
    if args.cmd == "sweep":
        return _sweep_cmd(args)
    cfg, out, mode = _resumed_config(args, methods) if args.resume else _new_config(args)
    if args.workers < 1:
        raise ValueError(f"--workers: must be >= 1, got {args.workers}")
    if args.workers > 1:
        run_workers(cfg, out, args.workers, mode=mode, quiet=args.quiet)
    else:
        run(cfg, out, mode=mode, quiet=args.quiet)
    return 0


def _sweep_cmd(args) -> int:
    """``fedfast sweep``: the study's runs, then its report."""
    ms = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seeds: comma-separated integers, got {args.seeds!r}") from None
    sweep(
        args.out,
        ms,
        seeds,
        preset=args.preset,
        config=args.config,
        overrides=args.set,
        plugins=args.plugin,
        quiet=args.quiet,
        workers=args.workers,
        grid=args.grid,
        jobs=args.jobs,
        shard=parse_shard(args.shard),
    )
    if not args.quiet and int(os.environ.get("RANK", "0")) == 0:
        print(report(args.out)[0], end="")
    return 0


def _resumed_config(args, methods):
    """``fedfast run --resume DIR``: the run's own config.json with the few keys a resume may change; (config,
    directory, mode)."""
    given = [
        f
        for f, v in (
            ("a config file", args.config),
            ("--out", args.out),
            ("--preset", args.preset),
            ("--force", args.force),
        )
        if v
    ]
    if given:
        raise ValueError(
            f"--resume: continues the run directory with its own config.json; {given[0]} cannot go "
            f"with it (only --set rounds/eval_every/checkpoint_every/tensorboard/device/threads, "
            f"--workers, --quiet)"
        )
    cfg_path = os.path.join(args.resume, "config.json")
    if not os.path.isdir(args.resume):
        raise ValueError(f"--resume: {args.resume}: no such run directory")
    recover(args.resume)  # a --force replacement killed before its first round: the old run back first
    try:
        base = read_json(cfg_path, "config")
    except FileNotFoundError:
        raise ValueError(f"--resume: {args.resume} is not a fedfast run directory (no config.json)") from None
    if not isinstance(base, dict):
        raise ValueError(f"{cfg_path}: damaged config (expected a JSON object)")
    for p in base.get("plugins", []):
        if p not in args.plugin:
            methods.load_plugin(p)
    bad = [o.split("=", 1)[0] for o in args.set if o.split("=", 1)[0].strip() not in RESUME_SET]
    if bad:
        raise ValueError(f"--resume: {bad[0]} cannot change when resuming (only {', '.join(RESUME_SET)})")
    cfg = build_config(None, args.set, base=base, plugins=args.plugin, source=cfg_path)
    return cfg, args.resume, "resume"


def _new_config(args):
    """``fedfast run [CONFIG | --preset NAME]``: the config of a new run; (config, directory, mode)."""
    base = None
    if args.config and presets.names_study(args.config):
        if args.preset:  # `fedfast run STUDY.toml/CELL` is `--preset STUDY.toml/CELL`
            raise ValueError(f"{args.config} is a study file; give it or --preset, not both")
        args.preset, args.config = args.config, None
    if args.preset:
        pre = presets.get(args.preset)
        if not pre.methods and not any(o.split("=", 1)[0].strip() == "algorithm" for o in args.set):
            raise ValueError(f"--preset {args.preset}: names no method rows; pick one with --set algorithm=NAME")
        alg = next(
            (o.split("=", 1)[1].strip() for o in args.set if o.split("=", 1)[0].strip() == "algorithm"),
            pre.methods[0] if pre.methods else "",
        )
        base = pre.config(alg)
        args.plugin = list(args.plugin) + [p for p in pre.plugins if p not in args.plugin]
    cfg = build_config(
        args.config,
        args.set,
        base=base,
        plugins=args.plugin,
        source=pre.source if args.preset else None,
        root=pre.root if args.preset else None,
    )
    return cfg, args.out or "runs/latest", ("force" if args.force else "new")


RESUME_SET = ("rounds", "eval_every", "checkpoint_every", "tensorboard", "device", "threads")


def _presets_cmd(name: str | None) -> int:
    cells = presets.resolve(name, "presets") if name else []
    if len(cells) > 1:  # a study file (or a preset file): its cells
        for p in cells:
            print(f"{p.name:36s} {p.keys.get('dataset', ''):14s} {p.table:28s} {', '.join(p.methods)}")
        print(f"({len(cells)} cells of {cells[0].source}; `fedfast presets NAME/CELL` shows one)")
        return 0
    if name:
        p = cells[0]
        print(f"{p.name}: {p.paper}, {p.table}; the paper reports the {p.metric} test accuracy; seeds {p.seeds}")
        print("protocol: " + ", ".join(f"{k}={v!r}" for k, v in p.keys.items() if not isinstance(v, dict)))
        for m in p.methods:
            extra = {**p.engine.get(m, {}), **p.options.get(m, {})}
            rep = p.reported.get(m)
            num = (f"{rep[0]:.2f}" + (f" ± {rep[1]:.2f}" if len(rep) > 1 else "")) if rep else "-"
            print(f"  {m:14s} paper {num:>14s}" + (f"   {extra}" if extra else ""))
        for m, why in p.missing.items():
            print(f"  {m:14s} (no number in this column: {why})")
        if p.reported_note:
            print(f"note on the reported numbers: {p.reported_note}")
        if p.grid:
            print("grid: " + ", ".join(f"{k} in {v}" for k, v in p.grid.items()))
        if p.plugins:
            print("plugins: " + ", ".join(p.plugins))
        if not p.packaged:
            print(f"study file: {p.source}")
        print("notes: " + " ".join(p.notes.split()))
        return 0
    for p in presets.load_all().values():
        print(f"{p.name:36s} {p.keys.get('dataset', ''):14s} {p.table:28s} {', '.join(p.methods)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
