"""Every built-in method's 4-round oracle: sha256 of the final global model's bytes and of the round records'
losses and accuracies, for a refactor that must leave behaviour byte-identical (issue 50).

    python scripts/method_oracle.py --out /tmp/before.json      # on the commit before the change
    python scripts/method_oracle.py --compare /tmp/before.json  # after: exit 1 naming the methods that differ

Bytes depend on the machine (the C++ kernels are compiled for several instruction sets and pick one at load time):
compare two runs on the same machine, never against a file from another. Each method runs on the tests' synthetic
data (8 clients of unequal sizes, 4 per round, the MLP; tests/sequential_loop.py) with its paper defaults, plain
and with ASD where it takes it, and under the BatchNorm CNN for the methods that keep per-client state."""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def run(name: str, model_kind: str) -> dict:
    from sequential_loop import setup_data

    import fedfast

    train, test, part, model = setup_data(model_kind)
    cfg = fedfast.SimConfig(
        algorithm=name, clients_per_round=4, rounds=4, local_epochs=2, batch_size=16, lr=0.05, momentum=0.5, seed=3
    )
    tr, splits = cfg.method().hold_out(train, cfg.seed)
    sim = fedfast.Simulation(
        cfg,
        copy.deepcopy(model),
        tr,
        test,
        part if len(tr) == len(train) else fedfast.data.iid(tr.y, part.num_clients, seed=0),
        **splits,
    )
    hist = sim.run()
    rec = [[r["train_loss"], r["test_loss"], r["test_accuracy"], r["clients"]] for r in hist]
    out = {"global": _digest(sim.global_flat), "records": hashlib.sha256(json.dumps(rec).encode()).hexdigest()[:16]}
    st = sim.method.client_state
    if st is not None:
        out["client_state"] = _digest(st.dense())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--compare", default="")
    a = ap.parse_args(argv)
    import fedfast

    torch.set_num_threads(1)
    res = {}
    for name in fedfast.methods.names():
        for kind in ("mlp", "bn"):
            key = f"{name}/{kind}"
            try:
                res[key] = run(name, kind)
            except (ValueError, TypeError, NotImplementedError) as e:  # a method that refuses this model
                res[key] = {"refused": f"{type(e).__name__}: {str(e)[:80]}"}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
    if a.compare:
        want = json.load(open(a.compare))
        diff = sorted(k for k in set(want) | set(res) if want.get(k) != res.get(k))
        print(f"{len(res)} runs, {len(diff)} differ" + (": " + ", ".join(diff) if diff else ""))
        return 1 if diff else 0
    print(f"{len(res)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
