"""FedGKD and FedGKD-VOTE against the plain sequential loop; defaults from Yao et al. and CGCL-codes/FedGKD."""

import copy

import pytest
import torch
from sequential_loop import PlainLoop, engine_vs, engine_vs_loop, setup_data

import fedfast
from fedfast import data


@pytest.mark.parametrize(
    "algorithm,options,extra",
    [
        ("fedgkd", {}, {}),
        ("fedgkd", dict(buffer=2), {}),
        ("fedgkd", dict(buffer=1, skip_first_round=False), {}),
        ("fedgkd", dict(buffer=3, gamma=0.4, tau=2.0), dict(max_grad_norm=0.5)),
        ("fedgkd_vote", dict(buffer=2), {}),
        ("fedgkd_vote", dict(buffer=3, lam=0.3, beta=0.5, tau=2.0), {}),
        ("fedgkd_vote", dict(buffer=2), dict(client_chunk=3)),
    ],
)
def test_matches_sequential_loop(algorithm, options, extra):
    err, sim, _ = engine_vs_loop(algorithm, options, rounds=3, lr_decay=0.99, **extra)
    if algorithm == "fedgkd" and sim.method.opts.buffer > 1:  # the teacher is the buffer average, not the last global
        assert not torch.equal(sim.method.avg, sim.global_flat)
    assert err <= 1e-4, err


def test_defaults():
    """Paper: gamma 0.2, M = 5 (CV), VOTE lambda 0.1 and beta = 1/M; code 72e7bac: clip at 10 every step
    (pcode/workers/worker.py), no KD in round 1 (worker_fedgkd.py)."""
    cfg = fedfast.SimConfig(algorithm="fedgkd")
    o = cfg.method().opts
    assert (o.gamma, o.buffer, o.tau, o.skip_first_round, cfg.max_grad_norm) == (0.2, 5, 1.0, True, 10.0)
    v = fedfast.SimConfig(algorithm="fedgkd_vote")
    assert v.method().opts.beta == pytest.approx(0.2) and v.method().opts.lam == 0.1 and v.max_grad_norm == 10.0
    assert fedfast.SimConfig(algorithm="fedgkd_vote", options={"buffer": 3}).method().opts.beta == pytest.approx(1 / 3)


def test_first_round_skips_distillation():
    """Round 1 with skip_first_round equals FedAvg's round 1; without it, the KD term (to w_0) changes it."""
    train, test, part, model = setup_data()
    out = {}
    for name, alg, opts in (
        ("avg", "fedavg", {}),
        ("skip", "fedgkd", {}),
        ("kd", "fedgkd", {"skip_first_round": False}),
    ):
        cfg = fedfast.SimConfig(
            algorithm=alg,
            options=opts,
            clients_per_round=4,
            rounds=1,
            local_epochs=2,
            batch_size=16,
            lr=0.1,
            max_grad_norm=0.0,
        )
        sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
        sim.run()
        out[name] = sim.global_flat
    assert torch.equal(out["avg"], out["skip"]) and not torch.allclose(out["avg"], out["kd"], atol=1e-6)


def test_vote_hold_out_split():
    train, _, _, _ = setup_data()
    m = fedfast.methods.FedGKDVote(val_fraction=0.25)
    tr, splits = m.hold_out(train)
    assert len(tr) == 300 and len(splits["val"]) == 100 and torch.equal(splits["val"].y, train.y[300:])
    with pytest.raises(ValueError, match="fedgkd_vote.val_fraction"):
        fedfast.methods.FedGKDVote(val_fraction=1.5)
    assert isinstance(splits["val"], data.ArrayDataset)


class GKDPlusLoop(PlainLoop):
    """FedGKD+ (Yao et al. §5.1) on the model with the projection head: CE + gamma/2 tau^2 KL(softmax(z_t/tau) ||
    softmax(z/tau)), the teacher the parameter average of the last M global models, no KD in round 1."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.history = []  # the global models after each round

    def round_start(self, sampled):
        self.teacher = copy.deepcopy(self.glob).eval()
        if self.history:
            avg = torch.stack(self.history[-self.o["buffer"] :]).mean(0)
            off = 0
            with torch.no_grad():
                for p in self.teacher.parameters():
                    p.copy_(avg[off : off + p.numel()].view_as(p))
                    off += p.numel()

    def loss(self, local, x, y, k):
        o, z = self.o, local(x)
        loss = torch.nn.functional.cross_entropy(z, y)
        if self.rnd == 0 and o["skip_first_round"]:
            return loss
        with torch.no_grad():
            p = torch.softmax(self.teacher(x) / o["tau"], 1)
        kl = (p * (torch.log(p) - torch.log_softmax(z / o["tau"], 1))).sum(1).mean()
        return loss + o["gamma"] / 2 * (o["tau"] ** 2 if o["tau_squared"] else 1) * kl

    def server(self, avg, sampled):
        self.history.append(avg.clone())
        return avg


@pytest.mark.parametrize("executor", ["auto", "vmap"])
@pytest.mark.parametrize("options,extra", [({}, {}), (dict(buffer=2, projection_dim=8, tau=2.0), dict(client_chunk=3))])
def test_fedgkd_plus_matches_literal_loop(options, extra, executor):
    err, sim, _ = engine_vs(
        GKDPlusLoop, "fedgkd_plus", options, rounds=3, executor=executor, lr_decay=0.99, max_grad_norm=None, **extra
    )
    assert err <= 1e-4, err
    from fedfast.flat import classifier_of

    assert classifier_of(sim.model).in_features == sim.method.opts.projection_dim


def test_fedgkd_plus_defaults():
    """FedGKD+ is FedGKD (same defaults, clipping at 10) with the projection layer of the code (output 256)."""
    cfg = fedfast.SimConfig(algorithm="fedgkd_plus")
    o = cfg.method().opts
    assert (o.projection_dim, o.gamma, o.buffer, o.skip_first_round, cfg.max_grad_norm) == (256, 0.2, 5, True, 10.0)
    with pytest.raises(ValueError, match="fedgkd_plus.projection_dim"):
        fedfast.SimConfig(algorithm="fedgkd_plus", options={"projection_dim": 0})


@pytest.mark.parametrize(
    "algorithm,options,rounds",
    [("fedgkd", dict(buffer=3, skip_first_round=False), 4), ("fedgkd_vote", dict(buffer=2), 3)],
)
def test_batchnorm_teachers_carry_their_running_statistics(algorithm, options, rounds):
    """A model whose BatchNorm keeps running statistics (issue 46): FedGKD's teacher is the average of the buffered
    globals' whole state_dicts (parameters and statistics, as the code averages them) and VOTE's teachers are the
    buffered globals with their own statistics; equal to the loop, every buffer too."""
    err, sim, _ = engine_vs_loop(algorithm, options, model="bn", rounds=rounds, lr_decay=0.99)
    assert sim.runtime.num_buffers and err <= 1e-4, err
    bufs = sim.method.buf_buffers
    assert bufs.shape == (options["buffer"], sim.runtime.num_buffers) and not torch.equal(bufs[0], bufs[1])
