"""examples/fedexp.py, a plug-in written from docs/methods.md's guide alone: FedExP against a literal per-client
loop (the step size from the clients' updates, the averaged last two iterates), its metric in every round's
record, and a resumed run equal to the straight one."""

import json
import os

import pytest
import torch
from sequential_loop import PlainLoop, engine_vs, flat, plugin_fixture

from fedfast.cli import main

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "fedexp.py")


fedexp = plugin_fixture(EXAMPLE, "fedexp")


class ExPLoop(PlainLoop):
    """FedExP written plainly: Delta_i = w - w_i, Delta = mean_i Delta_i, eta = max(1, sum ||Delta_i||^2 /
    (2 M (||Delta||^2 + eps))), w' = w - eta Delta."""

    etas: list

    def round_start(self, sampled):
        self.sq = 0.0
        if not hasattr(self, "etas"):
            self.etas = []

    def client_end(self, k, local, nsteps):
        self.sq += float(((self.gflat - flat(local)) ** 2).sum())

    def server(self, avg, sampled):
        delta = self.gflat - avg
        eta = max(1.0, self.sq / (2 * len(sampled) * (float((delta**2).sum()) + self.o["eps"])))
        self.etas.append(eta)
        self.last = self.gflat
        return self.gflat - eta * delta


@pytest.mark.parametrize("options,extra", [({}, {}), (dict(eps=1e-2), dict(client_chunk=3, momentum=0.0))])
def test_fedexp_matches_the_literal_loop(options, extra):
    err, sim, loop = engine_vs(ExPLoop, "fedexp", options, rounds=3, **extra)
    assert err <= 1e-4, err
    etas = [h["method_metrics"]["eta_g"] for h in sim.history]
    assert etas == pytest.approx(loop.etas, rel=1e-4) and max(etas) > 1.0  # it extrapolates here
    want = 0.5 * (sim.global_flat.cpu() + loop.last)  # the evaluated model: the average of the last two iterates
    assert torch.allclose(sim.eval_flat.cpu(), want, atol=1e-5 * float(want.abs().max()))
    assert sim.method.aggregation_fixed and sim.cfg.aggregate_weights == "uniform"


def test_fedexp_from_the_command_line_resumes_exactly(tmp_path):
    sets = [
        "--plugin",
        EXAMPLE,
        "--set",
        "algorithm=fedexp",
        "--set",
        "dataset=synthetic",
        "--set",
        "num_clients=8",
        "--set",
        "clients_per_round=3",
        "--set",
        "partition=iid",
        "--quiet",
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["run", *sets, "--set", "rounds=3", "--out", str(a)]) == 0
    assert main(["run", *sets, "--set", "rounds=2", "--out", str(b)]) == 0
    assert main(["run", "--resume", str(b), "--set", "rounds=3", "--quiet"]) == 0
    ra = [json.loads(s) for s in (a / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(s) for s in (b / "metrics.jsonl").read_text().splitlines()]
    assert [r["method_metrics"]["eta_g"] for r in ra] == [r["method_metrics"]["eta_g"] for r in rb]
    assert [r["test_loss"] for r in ra] == [r["test_loss"] for r in rb]
