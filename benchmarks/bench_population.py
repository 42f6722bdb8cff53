"""Populations far larger than a round's cohort (issue 38): set-up, Simulation init, seconds per round, peak RSS
and the per-client state held, for K clients of which 1000 train per round, FedAvg and SCAFFOLD.

Each (K, method) runs in a fresh process (its peak RSS is its own): synthetic feature rows (32 fp16 values per
sample, class-conditional Gaussians, made in 2**16-row chunks), a compact partition (``Partition.from_csr``:
``samples_per_client`` contiguous rows of a seeded permutation per client), an MLP (FedAvg: 32-64-10, 2,762
parameters; SCAFFOLD: 32-1280-10, 55,050 parameters, about the issue's 55,210, so that 20 rounds of 1000 clients
write 4.4 GB of control variates), B = 10, lr 0.05, one local epoch; ``rounds`` rounds timed after the first
(which pays for lazy set-up). SCAFFOLD runs with the state store in memory and on disk (``state_store``: a
memory-mapped file; peak RSS then counts the rows of one round mapped, not the file's pages in the page cache).

What each number must stay within (the targets of issue 38 on the 2-core CPU): FedAvg at K = 1,000,000 set-up +
init <= 5 s and peak RSS <= data + 1 GB; K = 10,000,000 (1 sample per client) runs; SCAFFOLD at K = 1,000,000,
20 rounds: peak RSS <= 4 GB and s/round <= 1.5x the same run at K = 10,000.

Run: python benchmarks/bench_population.py --out benchmarks/results/cpu-2core-amd-epyc-population.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time

import torch

import fedfast
from fedfast._io import write_atomic
from fedfast.bench import machine
from fedfast.data.datasets import ArrayDataset
from fedfast.data.partition import Partition
from fedfast.models import MLP

# (K, samples per client, method, rounds, hidden widths of the MLP, state_store)
SMALL, WIDE = (64,), (1280,)  # 2,762 parameters; 55,050 (about the 55,210-parameter MLP)
CASES = [
    (1_000, 10, "fedavg", 3, SMALL, "auto"),
    (10_000, 10, "fedavg", 3, SMALL, "auto"),
    (100_000, 10, "fedavg", 3, SMALL, "auto"),
    (1_000_000, 10, "fedavg", 3, SMALL, "auto"),
    (10_000_000, 1, "fedavg", 3, SMALL, "auto"),
    (10_000, 10, "scaffold", 20, WIDE, "memory"),
    (100_000, 10, "scaffold", 20, WIDE, "memory"),
    (1_000_000, 10, "scaffold", 20, WIDE, "memory"),
    (1_000_000, 10, "scaffold", 20, WIDE, "disk"),
]
FEATURES, CLASSES, COHORT = 32, 10, 1000


def _data(K: int, per: int):
    """Feature rows [K * per, 32] fp16 and labels, made in chunks (no full-size fp32 temporary)."""
    g = torch.Generator().manual_seed(0)
    N = K * per
    y = torch.randint(0, CLASSES, (N,), generator=g)
    means = torch.randn(CLASSES, FEATURES, generator=g)
    x = torch.empty(N, FEATURES, dtype=torch.float16)
    for s in range(0, N, 1 << 16):  # 8 MiB fp32 temporaries: the benchmark's data adds little to the peak
        e = min(N, s + (1 << 16))
        x[s:e] = (means[y[s:e]] + torch.randn(e - s, FEATURES, generator=g)).half()
    return x, y, g


def case(K: int, per: int, algorithm: str, rounds: int, hidden: tuple, store: str) -> dict:
    """One (K, method) in this process: the measurements as a dict (``store = "disk"``: the per-client state in a
    memory-mapped file of a temporary directory, as a run keeps it in its run directory)."""
    torch.manual_seed(0)
    t0 = time.perf_counter()
    x, y, g = _data(K, per)
    train = ArrayDataset(x, y, CLASSES)
    test = ArrayDataset(x[:2000].clone(), y[:2000].clone(), CLASSES)
    N = K * per
    part = Partition.from_csr(torch.randperm(N, generator=g), torch.arange(0, N + 1, per), CLASSES)
    t1 = time.perf_counter()
    cfg = fedfast.SimConfig(
        algorithm=algorithm,
        clients_per_round=min(COHORT, K),
        rounds=rounds,
        batch_size=10,
        lr=0.05,
        seed=0,
        state_store=store,
    )
    tmp = tempfile.TemporaryDirectory(prefix="fedfast-bench-state-")
    sim = fedfast.Simulation(cfg, MLP(FEATURES, hidden, CLASSES), train, test, part, state_dir=tmp.name)
    t2 = time.perf_counter()
    times = []
    for _ in range(rounds):
        a = time.perf_counter()
        sim.round()
        times.append(time.perf_counter() - a)
    st = sim.method.client_state
    return dict(
        K=K,
        samples_per_client=per,
        algorithm=algorithm,
        rounds=rounds,
        num_params=sim.num_params,
        setup_s=t1 - t0,
        init_s=t2 - t1,
        first_round_s=times[0],
        s_per_round=sum(times[1:]) / max(len(times) - 1, 1),
        round_s=[round(t, 4) for t in times],
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        data_bytes=x.numel() * x.element_size() + y.numel() * y.element_size(),
        state_bytes=st.nbytes if st is not None else 0,
        state_rows=st.written if st is not None else 0,
        state_store=store,
        state_on_disk=bool(st is not None and st.on_disk),
        state_file_bytes=st.file_bytes if st is not None else 0,
        final_test_accuracy=sim.history[-1]["test_accuracy"],
    )


def scatter_repeat(stores: int = 3, rounds: int = 10) -> list:
    """The disk store's scatter alone: ``stores`` stores one after another in this process (each removed before the
    next), each taking ``rounds`` scatters of 1000 new clients' rows of 55,050 fp32 values (220 MB) into its file;
    the median seconds per scatter of each store (the first pays for page-cache memory the machine never used)."""
    import shutil

    import numpy as np

    from fedfast.store.state import ClientState

    rows, out = torch.randn(COHORT, 55_050), []
    for _ in range(stores):
        d = tempfile.mkdtemp(prefix="fedfast-bench-scatter-")
        st = ClientState(1_000_000, rows.shape[1], store="disk", directory=d, max_rows=1 + rounds * COHORT)
        rng, times = np.random.default_rng(0), []
        for _ in range(rounds):
            ids = rng.choice(1_000_000, COHORT, replace=False)
            t = time.perf_counter()
            st.scatter_(ids, rows)
            times.append(time.perf_counter() - t)
        out.append(float(np.median(times[2:])))
        del st
        shutil.rmtree(d)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--max-k", type=int, default=10_000_000, help="skip cases with more clients")
    ap.add_argument("--_case", help=argparse.SUPPRESS)
    ap.add_argument("--only", default="", help="run only the cases of this method")
    ap.add_argument("--scatter", action="store_true", help="only time the disk store's scatter (scatter_repeat)")
    a = ap.parse_args(argv)
    if a._case:
        print(json.dumps(case(*json.loads(a._case))))
        return 0
    if a.scatter:
        print(json.dumps({"median_s_per_scatter": scatter_repeat()}))
        return 0
    res = dict(benchmark="population", machine=machine("cpu"), command=" ".join(sys.argv), rows=[])
    for K, per, alg, rounds, hidden, store in CASES:
        if K > a.max_k or (a.only and alg != a.only):
            continue
        p = subprocess.run(
            [sys.executable, __file__, "--_case", json.dumps([K, per, alg, rounds, hidden, store])],
            capture_output=True,
            text=True,
        )
        if p.returncode:
            row = dict(
                K=K,
                samples_per_client=per,
                algorithm=alg,
                rounds=rounds,
                state_store=store,
                error=p.stderr.strip()[-400:],
            )
        else:
            row = json.loads(p.stdout.strip().splitlines()[-1])
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        if a.out:
            write_atomic(a.out, json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
