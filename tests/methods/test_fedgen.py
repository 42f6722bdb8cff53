"""FedGen against a literal per-client loop written as FedGen's official code runs it (userpFedGen.train and
serverpFedGen.train_generator: its own generator module, KLDivLoss, NLLLoss, the diversity loss, torch.optim.Adam),
on the batched executor and on vmap; the random draws come from fedgen.client_draws / server_draws (keyed by round,
epoch, step, client position); checkpoints keep the generator."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sequential_loop import PlainLoop, engine_vs, setup_data
from torch import nn

import fedfast
from fedfast.methods.fedgen import client_draws, server_draws


class Gen(nn.Module):
    """FedGen's Generator: fc (noise + C -> hidden), BatchNorm1d, ReLU, representation layer (hidden -> F)."""

    def __init__(self, noise, C, hidden, feat):
        super().__init__()
        self.fc, self.bn, self.rep = nn.Linear(noise + C, hidden), nn.BatchNorm1d(hidden), nn.Linear(hidden, feat)
        self.C = C

    def forward(self, eps, y):
        onehot = torch.zeros(len(y), self.C)
        onehot.scatter_(1, y.view(-1, 1), 1)
        return self.rep(torch.relu(self.bn(self.fc(torch.cat([eps, onehot], 1)))))


class GenLoop(PlainLoop):
    def __init__(self, cfg, model, train, part):
        super().__init__(cfg, model, train, part)
        o, C = self.o, train.num_classes
        self.head_of = lambda m: [x for x in m.modules() if isinstance(x, nn.Linear)][-1]
        feat = self.head_of(model).in_features
        self.noise, self.hidden = o["noise"] or feat, o["hidden"] or max(512, feat)
        with torch.random.fork_rng(devices=[]):  # the engine's seeding of its generator
            torch.manual_seed(cfg.seed + 52807)
            self.gen = Gen(self.noise, C, self.hidden, feat)
        self.opt = torch.optim.Adam(self.gen.parameters(), lr=o["gen_lr"], weight_decay=o["gen_weight_decay"])
        self.sched = torch.optim.lr_scheduler.ExponentialLR(self.opt, gamma=o["gen_lr_decay"])
        self.B, self.gB = cfg.batch_size, o["gen_batch"] or cfg.batch_size

    def round_start(self, sampled):
        steps = np.ceil(self.sizes[sampled] / self.B)
        order = np.argsort(-steps, kind="stable")  # the engine's stack order: most steps first
        self.pos = {int(sampled[j]): p for p, j in enumerate(order)}
        self.m, self.heads, self.counts = len(sampled), {}, {}
        self.gen.eval()

    def batches(self, rnd, k, e):
        self.e, self.s = e, 0
        return super().batches(rnd, k, e)

    def loss(self, local, x, y, k):
        o, s = self.o, self.s
        self.s += 1
        z = local(x)
        loss = F.cross_entropy(z, y)
        if self.rnd == 0:
            return loss
        alpha = max(1e-4, o["alpha"] * o["decay"] ** self.rnd)
        beta = max(1e-4, o["beta"] * o["decay"] ** self.rnd)
        eps1, u, eps2 = (
            d[self.pos[k]]
            for d in client_draws(self.cfg.seed, self.rnd, self.e, s, self.m, self.B, self.gB, self.noise)
        )
        head = self.head_of(local)
        with torch.no_grad():
            target_p = F.softmax(head(self.gen(eps1[: len(y)], y)), 1)
        latent = nn.KLDivLoss(reduction="batchmean")(F.log_softmax(z, 1), target_p)
        labels = [c for c in range(self.train.num_classes) if self.hist[k][c] > 0 or not o["available_labels"]]
        yhat = torch.tensor([labels[int(v * len(labels))] for v in u.tolist()])
        with torch.no_grad():
            g2 = self.gen(eps2, yhat)
        teacher = torch.mean(nn.NLLLoss(reduction="none")(F.log_softmax(head(g2), 1), yhat))
        return loss + self.gB / self.B * alpha * teacher + beta * latent

    def client_end(self, k, local, nsteps):
        head = self.head_of(local)
        self.heads[k] = (head.weight.detach().clone(), head.bias.detach().clone())
        self.counts[k] = 1 + self.cfg.local_epochs * self.hist[k]  # label counts seen in training, from 1

    def server(self, avg, sampled):  # train_generator, then the average
        o = self.o
        ks = [int(k) for k in sampled]
        C = torch.stack([self.counts[k] for k in ks])  # [m, C]
        qualified = [c for c in range(self.train.num_classes) if C[:, c].max() > 1]
        us, noise = server_draws(self.cfg.seed, self.rnd, o["server_steps"], o["server_batch"] or self.B, self.noise)
        self.gen.train()
        for i in range(o["server_steps"]):
            y = torch.tensor([qualified[int(v * len(qualified))] for v in us[i].tolist()])
            z = self.gen(noise[i], y)
            teacher = 0
            for j, k in enumerate(ks):
                w, b = self.heads[k]
                weight = C[j, y] / C[:, y].sum(0)
                teacher = teacher + torch.mean(nn.NLLLoss(reduction="none")(F.log_softmax(z @ w.T + b, 1), y) * weight)
            n = len(y)  # DiversityLoss('l1'): layer distances l1, noise distances l2
            dz = torch.abs(z.expand(n, n, -1) - z.unsqueeze(1)).mean(2)
            de = torch.pow(noise[i].expand(n, n, -1) - noise[i].unsqueeze(1), 2).mean(2)
            loss = teacher + o["eta"] * torch.exp(torch.mean(-de * dz))
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        self.sched.step()
        return avg


@pytest.mark.parametrize("executor", ["auto", "vmap"])
@pytest.mark.parametrize(
    "options,extra",
    [
        (dict(alpha=1.0, beta=1.0, hidden=24, noise=8), {}),
        (
            dict(alpha=0.5, beta=0.0, available_labels=False, gen_batch=8, server_steps=7, server_batch=12),
            dict(client_chunk=3, max_grad_norm=1.0),
        ),
    ],
)
def test_matches_literal_loop(options, extra, executor):
    err, sim, loop = engine_vs(GenLoop, "fedgen", options, rounds=3, executor=executor, lr_decay=0.99, **extra)
    assert err <= 1e-4, err
    g = dict(sim.method.generator.named_parameters())
    for name, p in loop.gen.named_parameters():  # the generators trained alike
        q = g[{"rep.weight": "out.weight", "rep.bias": "out.bias"}.get(name, name)].detach().cpu()
        assert float((p.detach() - q).abs().max() / q.abs().max()) <= 1e-3, name


def test_generator_changes_training_and_checkpoints():
    """The regulariser changes the model; a checkpoint restores the generator and its Adam state, so a resumed run
    continues bit for bit."""
    _, gen, _ = engine_vs(GenLoop, "fedgen", dict(alpha=1.0, beta=1.0, hidden=24, noise=8), rounds=3)
    _, avg, _ = engine_vs(PlainLoop, "fedavg", {}, rounds=3)
    assert float((gen.global_flat - avg.global_flat).abs().max() / avg.global_flat.abs().max()) > 1e-3
    train, test, part, model = setup_data()
    cfg = fedfast.SimConfig(
        algorithm="fedgen", clients_per_round=4, rounds=3, batch_size=16, lr=0.05, seed=2, options=dict(hidden=16)
    )
    full = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    full.run()
    half = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    half.round(), half.round()
    resumed = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    resumed.restore(half.checkpoint())
    resumed.run()
    assert torch.equal(resumed.global_flat, full.global_flat)
    bad = half.checkpoint()
    bad["method"]["attrs"]["generator"]["__module__"].pop("fc.weight")
    with pytest.raises(ValueError, match="generator"):
        fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part).restore(bad)


def test_defaults_and_sizes():
    """FedGen's code (zhuangdizhu/FedGen @dd5807c): utils/model_config.py mnist generative_alpha = beta = 10,
    ensemble_lr 3e-4, weight_decay 1e-2, ensemble_epochs 50, ensemble_eta 1; exp_lr_scheduler 0.98; generator
    sizes as FedGKD states them (hidden max(512, F): 512 for ResNet-8's 64 features, noise F)."""
    o = fedfast.SimConfig(algorithm="fedgen").method().opts
    assert (
        o.alpha,
        o.beta,
        o.decay,
        o.gen_lr,
        o.gen_weight_decay,
        o.gen_lr_decay,
        o.server_steps,
        o.eta,
        o.available_labels,
        o.gen_batch,
        o.hidden,
        o.noise,
    ) == (10.0, 10.0, 0.98, 3e-4, 1e-2, 0.98, 50, 1.0, True, None, None, None)
    train, test, part, _ = setup_data()
    from fedfast import data, models

    tr, te = data.synthetic(5, 40, 10, (3, 32, 32), seed=0)
    sim = fedfast.Simulation(
        fedfast.SimConfig(algorithm="fedgen", clients_per_round=2, batch_size=8),
        models.build("resnet8_gn", 5),
        tr,
        te,
        data.iid(tr.y, 4, seed=0),
    )
    assert (sim.method.hidden, sim.method.noise_dim, sim.method.features) == (512, 64, 64)
    for key, bad in (("decay", 1.0), ("gen_lr", 0.0), ("server_steps", 0), ("gen_batch", 0)):
        with pytest.raises(ValueError, match=f"fedgen.{key}"):
            fedfast.SimConfig(algorithm="fedgen", options={key: bad})
