"""A private round's cost against the same round without DP (issue 49: <= 5 % at 1000 clients per round).

Same process, same clients, data, seeds and model; rounds alternate between the two simulations so that drift in
the machine's speed hits both. What DP adds per round, for n clients of P parameters (fp32):

  update norms      no pass of their own: each client's last local step adds up ||X_k - g|| while it writes the
                    row (ops.client_step's delta_norm: P*4 bytes of g read from cache per client); before that
                    change, n*P*4 bytes read (a pass over the clients' rows, ops.update_norms)
  noise             P*4 bytes written (one Gaussian vector) and P*4 read when it is added
  accounting        host only (dp-accounting's RDP accountant, epsilon after the round)

against the round's local training (forward + backward + step of every client) and the aggregation's own pass
(n*P*4 read). ``--adaptive`` adds adaptive clipping (a count in the same norms pass, one host read). ``--ftrl`` adds
a third simulation, DP-FTRL (``dp_mechanism = "dp_ftrl"``): the same clipping, the noise a tree increment (on
average two Gaussian vectors a round: the new node's P*4 bytes written, the dropped nodes' drawn again), timed in
the same alternation.

    python benchmarks/bench_privacy.py --clients 1000 --ftrl --out benchmarks/results/<machine>-privacy.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=1000, help="clients per round (all of them: K = clients)")
    ap.add_argument("--samples", type=int, default=20, help="samples per client")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per variant (after one warm-up)")
    ap.add_argument("--adaptive", action="store_true")
    ap.add_argument("--ftrl", action="store_true", help="also time DP-FTRL (tree-aggregated noise)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    import fedfast
    from fedfast import data

    K, n = a.clients, a.samples
    train, test = data.synthetic(10, K * n, 500, (1, 28, 28), seed=0)
    part = data.iid(train.y, K, seed=0)
    base = dict(
        algorithm="fedavg",
        clients_per_round=K,
        rounds=a.rounds + 1,
        local_epochs=1,
        batch_size=10,
        lr=0.05,
        seed=0,
        aggregate_weights="uniform",
        eval_every=10**6,
    )
    dp = dict(dp_clip=1.0, dp_noise_multiplier=1.0) | (
        dict(dp_clip_quantile=0.5, dp_clip_count_noise=K / 20) if a.adaptive else {}
    )
    sims = {}
    variants = [("plain", {}), ("dp", dict(dp, client_sampling="poisson"))]
    if a.ftrl:
        variants.append(("ftrl", dict(dp_clip=1.0, dp_noise_multiplier=1.0, dp_mechanism="dp_ftrl")))
    for name, extra in variants:
        model = fedfast.models.build("mlp", 10, (1, 28, 28))
        torch.manual_seed(0)
        sims[name] = fedfast.Simulation(fedfast.SimConfig(**base, **extra), model, train, test, part)
    times = {k: [] for k in sims}
    for r in range(a.rounds + 1):
        for name, sim in sims.items():
            t0 = time.perf_counter()
            sim.round()
            if r:  # round 0: warm-up
                times[name].append(time.perf_counter() - t0)
    P = sims["plain"].num_params
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {
        "benchmark": "bench_privacy",
        "clients_per_round": K,
        "samples_per_client": n,
        "num_params": P,
        "adaptive": a.adaptive,
        "seconds_per_round": med,
        "round_seconds": times,
        "overhead_pct": 100 * (med["dp"] / med["plain"] - 1),
        **({"ftrl_overhead_pct": 100 * (med["ftrl"] / med["plain"] - 1)} if a.ftrl else {}),
        "norms": "each client's last local step (ops.client_step delta_norm), no pass of their own",
        "rows_bytes": K * P * 4,
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "command": "python benchmarks/bench_privacy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(
        f"{K} clients x {n} samples, P = {P}: plain {med['plain'] * 1e3:.1f} ms, DP {med['dp'] * 1e3:.1f} ms per "
        f"round: {res['overhead_pct']:+.1f} %"
        + (f"; DP-FTRL {med['ftrl'] * 1e3:.1f} ms: {res['ftrl_overhead_pct']:+.1f} %" if a.ftrl else "")
    )
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
