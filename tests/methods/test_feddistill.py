"""FedDistill+ against a literal per-client loop (the per-label logit tracker and the server's average of the
others' written out as FedGKD's code intends them), on the batched executor and on vmap; its defaults."""

import pytest
import torch
from sequential_loop import PlainLoop, engine_vs

import fedfast


class DistillLoop(PlainLoop):
    """CE + coef tau^2 KL(softmax(G_k[y]/tau) || softmax(z/tau)); A_k = per-label logit sums / (1 + counts);
    G_k = (sum_j A_j - A_k) / (K - 1) over all K clients."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        C = self.train.num_classes
        self.A = {k: torch.zeros(C, C) for k in range(self.K)}

    def round_start(self, sampled):
        total = sum(self.A.values())
        self.G = {k: (total - self.A[k]) / (self.K - 1) for k in range(self.K)}
        self.track = {}

    def loss(self, local, x, y, k):
        o, z, C = self.o, local(x), self.train.num_classes
        S, N = self.track.setdefault(k, (torch.zeros(C, C), torch.ones(C)))
        with torch.no_grad():  # LogitTracker.update: per-label sums of the training logits
            for i in range(len(y)):
                S[y[i]] += z[i]
                N[y[i]] += 1
        loss = torch.nn.functional.cross_entropy(z, y)
        if self.rnd == 0 and o["skip_first_round"]:
            return loss
        p = torch.softmax(self.G[k][y] / o["tau"], 1)
        kl = (p * (torch.log(p) - torch.log_softmax(z / o["tau"], 1))).sum(1).mean()
        return loss + o["coef"] * (o["tau"] ** 2 if o["tau_squared"] else 1) * kl

    def client_end(self, k, local, nsteps):
        S, N = self.track[k]
        self.A[k] = S / N[:, None]


@pytest.mark.parametrize("executor", ["auto", "vmap"])
@pytest.mark.parametrize(
    "options,extra",
    [({}, {}), (dict(coef=1.0, tau=2.0, skip_first_round=False), dict(client_chunk=3, max_grad_norm=None))],
)
def test_matches_literal_loop(options, extra, executor):
    err, sim, loop = engine_vs(
        DistillLoop, "feddistill_plus", options, rounds=3, executor=executor, lr_decay=0.99, **extra
    )
    assert err <= 1e-4, err
    A = torch.stack([loop.A[k] for k in range(loop.K)])
    uploads = sim.method.client_state.dense().reshape(A.shape)  # the server's per-client uploads (zeros: none yet)
    assert float((uploads - A).abs().max() / A.abs().max()) <= 1e-4


def test_distillation_changes_training_and_defaults():
    """coef 0.1 (FedGKD §5.1), tau 1 with tau^2 and no KD in round 1 (worker_feddistill.py), clipping at 10
    (pcode/workers/worker.py)."""
    _, fd, _ = engine_vs(DistillLoop, "feddistill_plus", dict(coef=2.0), rounds=3)
    _, avg, _ = engine_vs(PlainLoop, "fedavg", {}, rounds=3)
    assert float((fd.global_flat - avg.global_flat).abs().max() / avg.global_flat.abs().max()) > 1e-3
    cfg = fedfast.SimConfig(algorithm="feddistill_plus")
    o = cfg.method().opts
    assert (o.coef, o.tau, o.tau_squared, o.skip_first_round, cfg.max_grad_norm) == (0.1, 1.0, True, True, 10.0)
    for key, bad in (("coef", -0.1), ("tau", 0.0)):
        with pytest.raises(ValueError, match=f"feddistill_plus.{key}"):
            fedfast.SimConfig(algorithm="feddistill_plus", options={key: bad})
