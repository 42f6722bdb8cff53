"""torch.distributed: 2 CPU processes (gloo) split each round's clients; every rank ends with the global model
and client state of a single-process run."""

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fedfast
from fedfast import data, models

CASES = [
    ("fedavgm", {}),
    ("scaffold", {}),
    ("feddyn", dict(alpha=0.1)),
    ("fedntd", dict(tau=2.0)),
    ("moon", {}),
    ("fedgkd_vote", dict(buffer=2)),
    # the methods of issue 18 that reduce per-client rows or server sums across ranks, set their own
    # aggregation weights, keep two rows per client or take SAM steps
    ("fedcurv", {}),
    ("fednova", dict(ccvr_server=True)),
    ("feddisco", {}),
    ("feddistill_plus", {}),
    ("fedgen", dict(hidden=16, server_steps=5)),
    ("fedspeed", dict(evaluated="all_clients")),
    ("fedsam", {}),
]
# the per-client state in one memory-mapped file both ranks share: from the start, and moved there in round 2
STORES = {
    "scaffold": dict(state_store="disk"),
    "fedcurv": dict(state_store="disk"),
    "feddyn": dict(state_store="auto", state_memory_gb=7 * 677 * 4 / 2**30),
}  # 677 parameters


# private runs (issue 58): the secret is rank 0's on every rank (the same noise and cohorts); DP-FedAvg with adaptive
# clipping (its count all-reduced), SCAFFOLD's upload clipped with its update, FedCurv under DP-FTRL
PRIVATE = dict(dp_clip=0.3, dp_noise_multiplier=0.7)
PRIVATE_CASES = [
    ("dp-fedavg", "fedavg", dict(client_sampling="poisson", dp_clip_quantile=0.5, dp_clip_count_noise=1.0)),
    ("dp-scaffold", "scaffold", dict(client_sampling="poisson")),
    ("dp-ftrl-fedcurv", "fedcurv", dict(dp_mechanism="dp_ftrl", dp_ftrl_restart=2)),
]


def _private_cfg(algorithm, extra):
    return fedfast.SimConfig(
        algorithm=algorithm,
        clients_per_round=5,
        rounds=3,
        local_epochs=1,
        batch_size=16,
        lr=0.05,
        seed=3,
        momentum=0.0,
        **PRIVATE,
        **extra,
    )


# a model with BatchNorm running statistics (issue 46): the clients' buffers summed across ranks, and under
# bn_stats = "local" each client's own rows exchanged as per-client state
BN_CASES = [
    ("bn-global", "fedavg", {}),
    ("bn-local", "fedavg", dict(bn_stats="local")),
    ("bn-moon", "moon", dict(options=dict(projection_dim=0))),
]


def _setup(bn=False):
    train, test = data.synthetic(5, 400, 100, (1, 6, 6), separation=0.7, seed=0)
    part = data.dirichlet_lda(train.y, 8, alpha=0.5, seed=1, min_size=5)
    torch.manual_seed(0)
    if bn:
        nn = torch.nn
        return (
            train,
            test,
            part,
            nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5)),
        )
    return train, test, part, models.MLP(36, (16,), 5)


def _bn_cfg(algorithm, extra):
    extra = dict(extra)
    return fedfast.SimConfig(
        algorithm=algorithm,
        clients_per_round=5,
        rounds=3,
        local_epochs=1,
        batch_size=16,
        lr=0.05,
        seed=3,
        momentum=0.9,
        options=extra.pop("options", {}),
        **extra,
    )


def _cfg(algorithm, extra, **store):
    return fedfast.SimConfig(
        algorithm=algorithm,
        clients_per_round=5,
        rounds=3,
        local_epochs=1,
        batch_size=16,
        lr=0.05,
        seed=3,
        momentum=0.9,
        options=extra,
        **store,
    )


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        for algorithm, extra in CASES:
            train, test, part, model = _setup()
            sim = fedfast.Simulation(
                _cfg(algorithm, extra), model, train, test, part, process_group="default", val=test
            )
            hist = sim.run()
            st = sim.method.client_state
            state = st.dense() if st is not None else torch.zeros(1)
            torch.save(
                dict(
                    g=sim.global_flat,
                    ev=sim.eval_flat,
                    state=state,
                    loss=hist[-1]["train_loss"],
                    acc=hist[-1]["test_accuracy"],
                    test_loss=hist[-1]["test_loss"],
                ),
                os.path.join(out_dir, f"{algorithm}-{rank}.pt"),
            )
        for algorithm, extra in CASES:
            if algorithm not in STORES:
                continue
            train, test, part, model = _setup()
            d = os.path.join(out_dir, f"store-{algorithm}")
            os.makedirs(d, exist_ok=True)
            sim = fedfast.Simulation(
                _cfg(algorithm, extra, **STORES[algorithm]),
                model,
                train,
                test,
                part,
                process_group="default",
                val=test,
                state_dir=d,
            )
            sim.run()
            st = sim.method.client_state
            torch.save(
                dict(g=sim.global_flat, state=st.dense(), on_disk=st.on_disk),
                os.path.join(out_dir, f"{algorithm}-disk-{rank}.pt"),
            )
        for name, algorithm, extra in PRIVATE_CASES:
            train, test, part, model = _setup()
            sim = fedfast.Simulation(_private_cfg(algorithm, extra), model, train, test, part, process_group="default")
            sim.run()
            torch.save(dict(g=sim.global_flat, key=sim.privacy.secret.key), os.path.join(out_dir, f"{name}-{rank}.pt"))
        for name, algorithm, extra in BN_CASES:
            train, test, part, model = _setup(bn=True)
            sim = fedfast.Simulation(_bn_cfg(algorithm, extra), model, train, test, part, process_group="default")
            sim.run()
            own = sim.client_buffers.dense() if sim.client_buffers is not None else torch.zeros(1)
            torch.save(
                dict(g=sim.global_flat, b=sim.state.global_buffers, own=own), os.path.join(out_dir, f"{name}-{rank}.pt")
            )
    finally:
        dist.destroy_process_group()
    os._exit(0)  # results are saved: skip interpreter teardown, where gloo's threads occasionally abort the process


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
def test_two_ranks_equal_one_process(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for algorithm, extra in CASES:
        train, test, part, model = _setup()
        sim = fedfast.Simulation(_cfg(algorithm, extra), copy.deepcopy(model), train, test, part, val=test)
        hist = sim.run()
        ranks = [torch.load(tmp_path / f"{algorithm}-{r}.pt") for r in range(2)]
        assert torch.equal(ranks[0]["g"], ranks[1]["g"]), algorithm  # the ranks agree exactly
        ref = sim.global_flat
        assert (ranks[0]["g"] - ref).abs().max() <= 1e-5 * ref.abs().max(), algorithm
        assert (ranks[1]["ev"] - sim.eval_flat).abs().max() <= 1e-5 * sim.eval_flat.abs().max(), algorithm
        if sim.method.client_state is not None:
            assert (ranks[1]["state"] - sim.method.client_state.dense()).abs().max() <= 1e-5 * (
                sim.method.client_state.dense().abs().max() + 1e-12
            ), algorithm
        assert abs(ranks[0]["loss"] - hist[-1]["train_loss"]) <= 1e-5 * abs(hist[-1]["train_loss"])
        # the test set is split between the ranks and the sums all-reduced: the same evaluation as one process
        assert ranks[0]["acc"] == ranks[1]["acc"] == hist[-1]["test_accuracy"], algorithm
        assert abs(ranks[1]["test_loss"] - hist[-1]["test_loss"]) <= 1e-5 * hist[-1]["test_loss"], algorithm
        if algorithm in STORES:  # the shared file: both ranks read the one-process state from it
            disk = [torch.load(tmp_path / f"{algorithm}-disk-{r}.pt") for r in range(2)]
            assert disk[0]["on_disk"] and disk[1]["on_disk"], algorithm
            assert torch.equal(disk[0]["g"], ranks[0]["g"]) and torch.equal(disk[1]["g"], ranks[1]["g"]), algorithm
            assert torch.equal(disk[0]["state"], disk[1]["state"]), algorithm
            assert torch.equal(disk[0]["state"], ranks[0]["state"]), algorithm
            assert sorted(os.listdir(tmp_path / f"store-{algorithm}")) == [
                f"client-state-{algorithm}.rows",
                f"client-state-{algorithm}.stamps",
            ]
    for name, algorithm, extra in PRIVATE_CASES:
        ranks = [torch.load(tmp_path / f"{name}-{r}.pt") for r in range(2)]
        assert ranks[0]["key"] == ranks[1]["key"] and torch.equal(ranks[0]["g"], ranks[1]["g"]), name
        train, test, part, model = _setup()
        sim = fedfast.Simulation(_private_cfg(algorithm, extra), copy.deepcopy(model), train, test, part)
        sim.privacy.secret.key = ranks[0]["key"]  # the ranks' secret: the same noise and cohorts in one process
        sim.run()
        assert (ranks[0]["g"] - sim.global_flat).abs().max() <= 1e-5 * sim.global_flat.abs().max(), name
    for name, algorithm, extra in BN_CASES:
        train, test, part, model = _setup(bn=True)
        sim = fedfast.Simulation(_bn_cfg(algorithm, extra), copy.deepcopy(model), train, test, part)
        sim.run()
        ranks = [torch.load(tmp_path / f"{name}-{r}.pt") for r in range(2)]
        assert torch.equal(ranks[0]["g"], ranks[1]["g"]) and torch.equal(ranks[0]["b"], ranks[1]["b"]), name
        assert (ranks[0]["g"] - sim.global_flat).abs().max() <= 1e-5 * sim.global_flat.abs().max(), name
        ref = sim.state.global_buffers
        assert ref.numel() and (ranks[1]["b"] - ref).abs().max() <= 1e-5 * ref.abs().max(), name
        if sim.client_buffers is not None:
            own = sim.client_buffers.dense()
            assert torch.equal(ranks[0]["own"], ranks[1]["own"]), name
            assert (ranks[0]["own"] - own).abs().max() <= 1e-5 * own.abs().max(), name
