"""FedSAM and FedSpeed (and their +ASD) against literal per-client loops: the SAM step written out as the
reference codes do it (ESAM: loss, backward, w += rho g/||g||, loss, backward, w -= e, clip, SGD), FedSpeed's
prox-correction and server as FL-Simulator's; on the batched executor and on vmap."""

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from sequential_loop import PlainLoop, asd_term, engine_vs, flat

import fedfast


class SAMLoop(PlainLoop):
    """FedSAM: FedAvg with SAM steps (FL-Simulator client/fedsam.py with optimizer/ESAM.py)."""

    rho_key = "rho"

    def __init__(self, cfg, *a, **kw):
        super().__init__(cfg, *a, **kw)
        m = cfg.method()
        self.asd = m.asd.__dict__ if cfg.algorithm.endswith("+asd") else None

    def round_start(self, sampled):
        self.teacher = copy.deepcopy(self.glob).eval()

    def loss(self, local, x, y, k):
        z = local(x)
        loss = F.cross_entropy(z, y)
        if self.asd is not None:
            with torch.no_grad():
                t = self.teacher(x)
            loss = loss + asd_term(z, t, y, self.hist[k] / self.hist[k].sum(), self.asd)
        return loss

    def extra_grad(self, local, k):
        """Terms added to the gradient after the SAM passes, before clipping (FedSpeed's correction)."""

    def step(self, local, opt, x, y, k):
        params = list(local.parameters())
        opt.zero_grad()
        self.loss(local, x, y, k).backward()
        rho = self.o[self.rho_key]
        if rho:
            norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
            eps = [rho * p.grad / (norm + 1e-12) for p in params]
            with torch.no_grad():
                for p, e in zip(params, eps, strict=True):
                    p.add_(e)  # climb to w + e
            opt.zero_grad()
            self.loss(local, x, y, k).backward()
            with torch.no_grad():
                for p, e in zip(params, eps, strict=True):
                    p.sub_(e)  # back to w
        self.extra_grad(local, k)
        self.clip(local)
        opt.step()


class SpeedLoop(SAMLoop):
    """FedSpeed as FL-Simulator (client/fedspeed.py, server/FedSpeed.py): SAM gradient + lam_k (h_k - w_t), clip,
    SGD with weight decay wd + lam_k; h_k += w_k - w_t; w' = mean(selected w_k) + mean_all(h)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        P = self.w0.numel()
        self.h = collections.defaultdict(lambda: torch.zeros(P))
        self.latest = {k: self.w0.clone() for k in range(self.K)}  # ASD's code: every client's latest model

    def lam(self, k):
        o, n = self.o, float(self.sizes[k])
        s = {"none": 1.0, "minibatches": n / self.cfg.batch_size, "mean_size": n / self.sizes.mean()}
        return o["lam"] / s[o["alpha_scaling"]]

    def optimizer(self, local, k):
        c = self.cfg
        return torch.optim.SGD(
            local.parameters(), lr=self.lr, momentum=c.momentum, weight_decay=c.weight_decay + self.lam(k)
        )

    def extra_grad(self, local, k):
        corr, off = self.lam(k) * (self.h[k] - self.gflat), 0
        for p in local.parameters():
            p.grad += corr[off : off + p.numel()].view_as(p)
            off += p.numel()

    def client_end(self, k, local, nsteps):
        self.h[k] = self.h[k] + flat(local) - self.gflat
        self.latest[k] = flat(local)

    def server(self, avg, sampled):
        cloud = avg + sum(self.h.values()) / self.K
        ev = self.o["evaluated"]
        self.evaluated = {
            "cloud": cloud,
            "average": avg,
            "all_clients": torch.stack(list(self.latest.values())).mean(0),
        }[ev]
        return cloud


def _check(loop_cls, algorithm, options, executor, **extra):
    err, sim, loop = engine_vs(loop_cls, algorithm, options, executor=executor, lr_decay=0.99, **extra)
    assert err <= 1e-4, err
    if hasattr(loop, "evaluated"):
        ev = sim.eval_flat.cpu()
        assert float((ev - loop.evaluated).abs().max() / loop.evaluated.abs().max()) <= 1e-4
    return sim


@pytest.mark.parametrize("executor", ["auto", "vmap"])
@pytest.mark.parametrize(
    "algorithm,options,extra",
    [
        ("fedsam", {}, dict(max_grad_norm=None)),
        ("fedsam", dict(rho=0.5), dict(client_chunk=3)),
        ("fedsam+asd", dict(asd=dict(lam=2.0)), dict(momentum=0.0)),
        ("fedspeed", {}, {}),
        (
            "fedspeed",
            dict(lam=0.05, rho=0.0, alpha_scaling="minibatches", evaluated="all_clients"),
            dict(max_grad_norm=None),
        ),
        ("fedspeed", dict(alpha_scaling="mean_size", evaluated="average", rho=0.3), dict(client_chunk=2)),
        ("fedspeed+asd", dict(asd=dict(lam=3.0)), dict(momentum=0.0)),
    ],
)
def test_matches_literal_loop(algorithm, options, extra, executor):
    loop = SpeedLoop if algorithm.startswith("fedspeed") else SAMLoop
    sim = _check(loop, algorithm, options, executor, **extra)
    if sim.method.sam_rho(None):
        assert sim.trainer.sam is not None


def test_sam_changes_training_and_rho_zero_is_the_plain_step():
    """rho = 0 takes the plain step (FedSAM is then FedAvg bit for bit); rho > 0 changes the model."""
    _, sam0, _ = engine_vs(SAMLoop, "fedsam", dict(rho=0.0), max_grad_norm=10.0)
    _, avg, _ = engine_vs(PlainLoop, "fedavg", {}, max_grad_norm=10.0)
    assert torch.equal(sam0.global_flat, avg.global_flat) and sam0.trainer.sam is None
    _, sam, _ = engine_vs(SAMLoop, "fedsam", dict(rho=0.5), max_grad_norm=10.0)
    assert float((sam.global_flat - avg.global_flat).abs().max() / avg.global_flat.abs().max()) > 1e-3


def test_defaults():
    """FL-Simulator @617ee01 (the FedSpeed authors' codebase): train.py --rho 0.1, --lamb 0.1; client/client.py
    max_norm = 10; server/FedSpeed.py evaluates w_{t+1} = mean(selected) + mean(h), lam not scaled per client.
    FedSpeed+ASD's entropy at temperature 1 (ASD's compute_distill_loss); FedSAM+ASD at tau (no released path)."""
    cfg = fedfast.SimConfig(algorithm="fedsam")
    assert (cfg.method().opts.rho, cfg.max_grad_norm) == (0.1, 10.0)
    cfg = fedfast.SimConfig(algorithm="fedspeed")
    o = cfg.method().opts
    assert (o.lam, o.rho, o.alpha_scaling, o.evaluated, cfg.max_grad_norm, cfg.aggregate_weights) == (
        0.1,
        0.1,
        "none",
        "cloud",
        10.0,
        "uniform",
    )
    assert fedfast.SimConfig(algorithm="fedspeed+asd").method().asd.entropy_tau == 1.0
    assert fedfast.SimConfig(algorithm="fedsam+asd").method().asd.entropy_tau == 2.0
    for alg, key, bad in (
        ("fedsam", "rho", -0.1),
        ("fedspeed", "lam", -1.0),
        ("fedspeed", "evaluated", "best"),
        ("fedspeed", "alpha_scaling", "sizes"),
    ):
        with pytest.raises(ValueError, match=f"{alg}.{key}"):
            fedfast.SimConfig(algorithm=alg, options={key: bad})
    with pytest.raises(ValueError, match="client_optimizer"):
        fedfast.SimConfig(algorithm="fedspeed", client_optimizer="adamw")


@pytest.mark.parametrize("opt", ["adam", "adamw"])
def test_sam_with_adam_and_a_bad_radius(opt):
    """SAM composes with Adam client steps (the perturbed gradient feeds torch.optim.Adam / AdamW, as in the
    loop); a negative radius from a method's hook is refused by name."""

    class NegSAM(fedfast.methods.FedAvg):
        name = "negsam"

        def sam_rho(self, ctx):
            return -1.0

    err, sim, _ = engine_vs(SAMLoop, "fedsam", dict(rho=0.2), client_optimizer=opt, momentum=0.0, lr=0.01)
    assert err <= 1e-4, err
    sim.method.__class__ = NegSAM
    with pytest.raises(ValueError, match="negsam.sam_rho"):
        sim.round()


def test_sam_is_declared_not_detected():
    """SAM is a declared capability (``sam = True``): the built-in SAM methods declare it, and a method whose
    sam_rho returns a radius without declaring it is refused by name (its memory would be sized without SAM's
    rows)."""
    assert fedfast.methods.get("fedsam").sam and fedfast.methods.get("fedspeed").sam
    assert fedfast.methods.get("fedsam+asd").sam and not fedfast.methods.get("fedavg").sam

    class Undeclared(fedfast.methods.FedAvg):
        name = "undeclared"

        def sam_rho(self, ctx):
            return 0.1

    _, sim, _ = engine_vs(SAMLoop, "fedsam", dict(rho=0.2), momentum=0.0)
    sim.method.__class__ = Undeclared
    with pytest.raises(ValueError, match="undeclared.sam_rho: 0.1 > 0, but the method does not declare sam = True"):
        sim.round()


class FrozenStatsSAMLoop(SAMLoop):
    """SAMLoop on a BatchNorm model with running statistics: the second pass (at w + e) leaves the buffers as the
    first pass left them, as SAM's reference code does with ``disable_running_stats`` (the engine's rule)."""

    def step(self, local, opt, x, y, k):
        saved, first = [], self.loss

        def loss(local, x, y, k):
            saved.append([b.detach().clone() for b in local.buffers()])  # before each pass
            return first(local, x, y, k)

        self.loss = loss
        try:
            super().step(local, opt, x, y, k)
        finally:
            del self.loss
        if len(saved) == 2:  # back to the buffers as the first pass left them (after the backward, which reads them)
            with torch.no_grad():
                for b, v in zip(local.buffers(), saved[1], strict=True):
                    b.copy_(v)


@pytest.mark.parametrize("executor", ["auto", "vmap"])
def test_sam_on_a_batchnorm_model_updates_running_statistics_once_per_step(executor):
    """A model with BatchNorm running statistics: the SAM step's first pass updates them, the perturbed pass does not;
    every buffer of the global model equals the loop's (num_batches_tracked counts steps)."""
    from sequential_loop import setup_data

    err, sim, loop = engine_vs(
        FrozenStatsSAMLoop, "fedsam", dict(rho=0.1), model=setup_data("bn")[3], executor=executor, lr_decay=0.99
    )
    assert (sim.trainer.stack.plan is not None) == (executor == "auto")
    assert sim.runtime.num_buffers and err <= 1e-4, err
    nbt = sim.state_dict()["1.num_batches_tracked"]
    assert int(nbt) == int(loop.glob.state_dict()["1.num_batches_tracked"]) > 0
