"""FedDisco against a literal per-client loop (its weights written out in numpy), on the batched executor and on
vmap; the defaults of FedDisco's code and ASD's settings; its options refused by name."""

import copy

import numpy as np
import pytest
import torch
from sequential_loop import PlainLoop, asd_term, engine_vs

import fedfast


class DiscoLoop(PlainLoop):
    """FedAvg's local training; the average weighted by ReLU(n_k - a d_k + b), normalised (Ye et al. 2023)."""

    def weights(self, sampled):
        o = self.o
        ids = np.arange(self.K) if o["scope"] == "all" else sampled
        n = self.sizes[ids].astype(float) if self.cfg.aggregate_weights == "size" else np.ones(len(ids))
        n = n / n.sum()
        p = self.hist[ids].double().numpy()
        p = p / p.sum(1, keepdims=True)
        C = p.shape[1]
        q = np.full(C, 1.0 / C) if o["target"] == "uniform" else self.hist.sum(0).double().numpy() / self.sizes.sum()
        if o["distance"] == "kl":  # sum_c p_c log(p_c / q_c), 0 log 0 = 0
            d = np.array([sum(pc * np.log(pc / qc) for pc, qc in zip(row, q, strict=True) if pc > 0) for row in p])
        elif o["distance"] == "l1":
            d = np.abs(p - q).sum(1)
        elif o["distance"] == "l2":
            d = np.linalg.norm(p - q, axis=1)
        else:
            d = 1 - p @ q / (np.linalg.norm(p, axis=1) * np.linalg.norm(q))
        d = d / d.sum()
        w = np.maximum(n - o["a"] * d + o["b"], 0)
        w = w / w.sum()
        if o["scope"] == "all":  # ASD's code: weights over all clients, renormalised over the participants
            w = w[sampled] / w[sampled].sum()
        return torch.tensor(w)


class DiscoASDLoop(DiscoLoop):
    """FedDisco + ASD (ASD Tables 2, 13): ASD's term on the client loss (teacher: the model the client received)."""

    def round_start(self, sampled):
        self.teacher = copy.deepcopy(self.glob).eval()
        self.a = self.cfg.method().asd.__dict__

    def loss(self, local, x, y, k):
        z = local(x)
        with torch.no_grad():
            t = self.teacher(x)
        return torch.nn.functional.cross_entropy(z, y) + asd_term(z, t, y, self.hist[k] / self.hist[k].sum(), self.a)


@pytest.mark.parametrize("executor", ["auto", "vmap"])
@pytest.mark.parametrize(
    "options",
    [dict(asd=dict(lam=3.0)), dict(feddisco=dict(a=0.1, b=0.5, scope="all"), asd=dict(lam=5.0, entropy_tau=2.0))],
)
def test_feddisco_asd_matches_literal_loop(options, executor):
    err, _, _ = engine_vs(DiscoASDLoop, "feddisco+asd", options, executor=executor, lr_decay=0.99, momentum=0.0)
    assert err <= 1e-4, err


@pytest.mark.parametrize("executor", ["auto", "vmap"])
@pytest.mark.parametrize(
    "options,extra",
    [
        ({}, {}),
        (dict(a=0.1, b=0.5, scope="all"), {}),
        (dict(distance="l1", target="global", a=1.0), {}),
        (dict(distance="cosine", a=0.8), dict(aggregate_weights="uniform", client_chunk=3)),
        (dict(distance="l2", a=0.7, b=0.0), {}),
    ],
)
def test_matches_literal_loop(options, extra, executor):
    err, sim, loop = engine_vs(DiscoLoop, "feddisco", options, executor=executor, lr_decay=0.99, **extra)
    assert err <= 1e-4, err
    assert (sim.trainer.stack.plan is None) == (executor == "vmap")


def test_weights_differ_from_fedavg():
    """The setting's discrepancies move the weights: FedDisco's model is not FedAvg's."""
    err, sim, loop = engine_vs(DiscoLoop, "feddisco", {})
    base, fedavg, _ = engine_vs(PlainLoop, "fedavg", {})
    gap = float((sim.global_flat - fedavg.global_flat).abs().max() / fedavg.global_flat.abs().max())
    assert gap > 1e-3 and err <= 1e-4 and base <= 1e-4


def test_defaults_and_options():
    """Defaults of FedDisco's code (MediaBrain-SJTU/FedDisco @f3ea299, args.py: disco_a 0.5, disco_b 0.1,
    measure_difference 'kl'; main.py: global_dist uniform; algorithms/*.py: over each round's participants)."""
    o = fedfast.SimConfig(algorithm="feddisco").method().opts
    assert (o.a, o.b, o.distance, o.target, o.scope) == (0.5, 0.1, "kl", "uniform", "round")
    for key, bad in (("distance", "js"), ("a", -1.0), ("b", -0.1), ("target", "test"), ("scope", "some")):
        with pytest.raises(ValueError, match=f"feddisco.{key}"):
            fedfast.SimConfig(algorithm="feddisco", options={key: bad})
    assert fedfast.SimConfig(algorithm="feddisco+asd").method().asd.entropy_tau == 1.0  # ASD's FedAvgReg path


def test_all_weights_clipped_is_an_error():
    from fedfast.methods.feddisco import FedDisco

    m = FedDisco(a=100.0, b=0.0)
    m.engine = type("E", (), {"config": fedfast.SimConfig(), "aggregate_weights": "size"})()
    m.counts, m.q = np.array([[5.0, 0.0], [0.0, 5.0]]), np.array([0.5, 0.5])
    with pytest.raises(ValueError, match="feddisco.a"):
        m.disco_weights(np.array([0, 1]), np.array([5.0, 5.0]))
    m.opts.a = 0.5
    assert np.allclose(m.disco_weights(np.array([0, 1]), np.array([5.0, 5.0])), [0.5, 0.5])
