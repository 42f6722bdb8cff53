"""The plain sequential reference every method is tested against: per-client ``nn.Module`` + ``torch.optim.SGD``,
the teacher's forward on every step, ``state_dict`` averaging, and each method's formulas and state written out
plainly (independently of fedfast's method classes: options are read from the resolved config only).

``sequential(cfg, model, train, part, rounds, val)`` -> the global model after ``rounds`` rounds (flat [P]);
``engine_vs_loop(algorithm, options)`` runs the engine and this loop on the same data, sampling and batch order.
"""

import collections
import copy
import dataclasses
import math
import os
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

import fedfast
from fedfast import data, models, nn as ffnn
from fedfast.ops import distill_reference
from fedfast.sampling import client_order, sample_clients


def setup_data(model: str = "mlp"):
    """The shared synthetic data (1x6x6 images, 5 classes, 8 clients of unequal sizes: partial batches) and a model:
    ``"mlp"``, or ``"bn"``, a CNN with BatchNorm layers that keep running statistics (2-d after a convolution, 1-d
    after a Linear), whose buffers the engine keeps per client and averages."""
    train, test = data.synthetic(5, 400, 100, (1, 6, 6), separation=0.7, seed=0)
    part = data.dirichlet_lda(train.y, 8, alpha=0.5, seed=1, min_size=5)  # unequal sizes: exercises masking
    torch.manual_seed(0)
    if model == "bn":
        nn = torch.nn
        return (
            train,
            test,
            part,
            nn.Sequential(
                nn.Conv2d(1, 4, 3),
                nn.BatchNorm2d(4),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(64, 16),
                nn.BatchNorm1d(16),
                nn.ReLU(),
                nn.Linear(16, 5),
            ),
        )
    model = models.MLP(36, (16,), 5)
    return train, test, part, model


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _feature_hook(model):
    """The input of the model's last nn.Linear (MOON's representation), captured on every forward."""
    lin = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    got = []
    lin.register_forward_pre_hook(lambda _m, inp: got.append(inp[0]))
    return got


def _add_(model, vec, scale=1.0):
    """model.parameters += scale * vec (flat)."""
    off = 0
    with torch.no_grad():
        for p in model.parameters():
            p += scale * vec[off : off + p.numel()].view_as(p)
            off += p.numel()


def _load_(model, vec):
    off = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(vec[off : off + p.numel()].view_as(p))
            off += p.numel()


def _s(o):
    """The tau^2 factor of a KD term."""
    return o["tau"] ** 2 if o["tau_squared"] else 1.0


def _options(cfg):
    """(base method name, its option dict, the ASD option dict or None), resolved as the engine resolves them."""
    m = cfg.method()
    opts = m.options()
    if cfg.algorithm.endswith("+asd"):
        base = cfg.algorithm[:-4]
        own = {**vars(m.opts)}
        return base, own, opts["asd"]
    return cfg.algorithm, {**vars(m.opts)}, None


def sequential(
    cfg,
    model,
    train,
    part,
    rounds,
    val=None,
    sampled_fn=None,
    order_fn=None,
    client_loss=None,
    out: dict | None = None,
    dp: dict | None = None,
):
    """The literal loop (see the module docstring); returns the global model's flat parameters. ``client_loss(z, t,
    y, label_counts)``: the loss of a method the loop does not know (FedAvg otherwise). ``out``: receives the final
    global model's ``state_dict`` (``out["state"]``). ``dp`` (``clip``, ``z``, ``E``, ``gen``: round -> a CPU
    generator): DP-FedAvg written out: each client's delta clipped to L2 norm ``clip``, summed, ``z * clip *
    randn(P)`` from the round's generator added, divided by ``E``, added to the global model; with ``quantile``
    (adaptive clipping, Andrew et al. Algorithm 1), each client's ``b_k - 1/2`` summed (``b_k = 1`` when its delta
    was not clipped), a ``sigma_b`` normal from the same generator added, over ``E``, plus 1/2, moves the clip. With
    ``tree`` (``restart``, ``node(tree, level, start)``): DP-FTRL written from its definition, each round's model the
    tree's anchor plus the sum of the nodes of the round's binary decomposition (each node: its rounds' clipped
    sums plus z * clip * its noise) over ``E``."""
    alg, o, asd = _options(cfg)
    glob = copy.deepcopy(model)
    w0 = copy.deepcopy(model).eval()
    prev = {}  # MOON: each client's previous local model (initially the initial global model)
    adc_m = None
    vote_hist = []  # VOTE: (model, val loss) of the globals after each round
    P = flat(glob).numel()
    K = part.num_clients
    dev = next(glob.parameters()).device
    server_v, c_glob, hbar = torch.zeros(P, device=dev), torch.zeros(P, device=dev), torch.zeros(P, device=dev)
    c_k = collections.defaultdict(lambda: torch.zeros(P, device=dev))  # per-client state, created when used
    h_k = collections.defaultdict(lambda: torch.zeros(P, device=dev))
    mean_n = float(np.mean([len(i) for i in part.indices]))
    gkd_hist = []
    if alg == "fedcad":  # the same auxiliary draw as the engine (aux_per_class per class, seeded)
        g = torch.Generator().manual_seed(cfg.seed + 7919)
        aux = torch.cat(
            [
                torch.nonzero(train.y == c).flatten()[
                    torch.randperm(int((train.y == c).sum()), generator=g)[: o["aux_per_class"]]
                ]
                for c in range(train.num_classes)
            ]
        )
    for rnd in range(rounds):
        sampled = sampled_fn(rnd) if sampled_fn else sample_clients(cfg.seed, rnd, K, cfg.clients_per_round)
        lr = cfg.lr * cfg.lr_decay**rnd
        states, sizes, flats, new_ck = [], [], [], {}
        teacher = copy.deepcopy(glob).eval()
        gflat = flat(glob)
        if adc_m is None:
            adc_m = torch.zeros_like(gflat)
        if alg == "fedgkd_vote":
            vote_models = [mdl for mdl, _ in vote_hist[-o["buffer"] :]]
            vote_w = (
                torch.softmax(-torch.tensor([v for _, v in vote_hist[-o["buffer"] :]]) / o["beta"], 0)
                if vote_hist
                else None
            )
        if alg == "fedgkd" and o["buffer"] > 1 and gkd_hist:  # the average of the buffered globals' state_dicts
            last = gkd_hist[-o["buffer"] :]  # (parameters, and a BatchNorm model's running statistics: the code's)
            teacher.load_state_dict(
                {k: torch.stack([sd[k].double() for sd in last]).mean(0).to(last[0][k].dtype) for k in last[0]}
            )
        if alg == "fedcad":
            with torch.no_grad():
                xa, ya = train.batch(aux)
                # the global model in eval mode (as the engine predicts)
                py = torch.softmax(teacher(xa) / o["alpha_tau"], 1).gather(1, ya[:, None]).squeeze(1)
                mean_py = torch.stack([py[ya == c].mean() for c in range(train.num_classes)])
                class_alpha = o["beta"] + (o["gamma"] - o["beta"]) * mean_py
        for k in sampled:
            idx = part.indices[k]
            local = copy.deepcopy(glob)
            wd = cfg.weight_decay
            if alg == "feddyn":
                s_k = len(idx) / mean_n if o["alpha_scaling"] == "mean_size" else len(idx) / cfg.batch_size
                alpha_k = o["alpha"] / s_k
                wd = alpha_k + cfg.weight_decay
            if cfg.client_optimizer == "sgd":
                opt = torch.optim.SGD(local.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=wd)
            else:
                opt = (torch.optim.AdamW if cfg.client_optimizer == "adamw" else torch.optim.Adam)(
                    local.parameters(), lr=lr, betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=wd
                )
            nsteps = 0
            H = cfg.local_epochs * -(-len(idx) // cfg.batch_size)
            if alg.startswith("fedadc"):
                d = o["beta"] * adc_m / H  # FedADC drift per step
            hist_k = torch.bincount(train.y[idx], minlength=train.num_classes).float()
            feats = _feature_hook(local) if alg == "moon" else None
            for e in range(cfg.local_epochs):
                perm = (
                    order_fn(rnd, int(k), e, len(idx)) if order_fn else client_order(cfg.seed, rnd, int(k), e, len(idx))
                )
                perm = idx[torch.from_numpy(np.asarray(perm))]
                for b in perm.split(cfg.batch_size):
                    x, y = train.batch(b)
                    if alg.startswith("fedadc") and o["order"] == "nesterov":  # theta - lr mbar first
                        _add_(local, d, -lr)
                    z = local(x)
                    with torch.no_grad():
                        t = teacher(x)
                    if client_loss is not None:
                        loss = client_loss(z, t, y, hist_k)
                    elif asd is not None:  # ASD: the client's label distribution as prior; the KD term replaced
                        prior = hist_k / len(idx)
                        loss = ffnn.ASDLoss(
                            tau=asd["tau"],
                            lam=asd["lam"],
                            not_true=asd["not_true"],
                            entropy_tau=asd["entropy_tau"],
                            tau_squared=asd["tau_squared"],
                            backend="reference",
                        )(z, t, y, prior)
                    elif alg == "fedadc_plus":
                        tt = t if o["teacher"] == "global" else z.detach()
                        loss = ffnn.ADCLoss(
                            tau=o["tau"], lam=o["lam"], tau_squared=o["tau_squared"], backend="reference"
                        )(z, tt, y, hist_k)
                    elif alg == "fedgkd_vote":
                        if vote_models:
                            with torch.no_grad():
                                T = torch.stack([mm(x) for mm in vote_models])
                            loss = ffnn.GKDLoss(
                                tau=o["tau"], gamma=2 * o["lam"], tau_squared=o["tau_squared"], backend="reference"
                            )(z, T, y, teacher_weights=vote_w)
                        else:
                            loss = F.cross_entropy(z, y)
                    elif alg == "fedgkd":
                        if o["skip_first_round"] and rnd == 0:
                            loss = F.cross_entropy(z, y)
                        else:
                            loss = distill_reference(z, t, y, tau=o["tau"], kd_weight=o["gamma"] / 2 * _s(o)).mean()
                    elif alg == "moon":
                        f = feats[-1]
                        with torch.no_grad():
                            glob_feats, prev_feats = _feature_hook(teacher), _feature_hook(prev.get(int(k), w0))
                            teacher(x)
                            prev.get(int(k), w0)(x)
                        cos = F.cosine_similarity
                        lg = torch.stack([cos(f, glob_feats[-1], dim=-1), cos(f, prev_feats[-1], dim=-1)], 1)
                        lcon = F.cross_entropy(lg / o["tau"], torch.zeros(len(y), dtype=torch.long, device=lg.device))
                        loss = F.cross_entropy(z, y) + o["mu"] * lcon
                    elif alg == "fedcad":
                        loss = ffnn.CADLoss(tau=o["tau"], tau_squared=o["tau_squared"], backend="reference")(
                            z, t, y, class_alpha
                        )
                    elif alg == "fedntd":
                        loss = distill_reference(
                            z, t, y, tau=o["tau"], kd_weight=o["beta"] * _s(o), not_true=True
                        ).mean()
                    elif alg == "kd":
                        loss = distill_reference(z, t, y, tau=o["tau"], kd_weight=o["beta"] * _s(o)).mean()
                    else:
                        loss = F.cross_entropy(z, y)
                    fl = torch.cat([p.reshape(-1) for p in local.parameters()])
                    if alg == "fedprox" and o["mu"]:
                        loss = loss + o["mu"] / 2 * (fl - gflat).pow(2).sum()
                    if alg == "feddyn":
                        loss = loss + alpha_k * (fl * (h_k[int(k)] - gflat)).sum()
                    opt.zero_grad()
                    loss.backward()
                    if cfg.max_grad_norm:  # clip the loss gradient, then SGD adds weight decay (as the papers' code)
                        torch.nn.utils.clip_grad_norm_(local.parameters(), cfg.max_grad_norm)
                    if alg == "scaffold":
                        corr = c_glob - c_k[int(k)]
                        off = 0
                        for p in local.parameters():
                            p.grad += corr[off : off + p.numel()].view_as(p)
                            off += p.numel()
                    opt.step()
                    if alg.startswith("fedadc") and o["order"] == "heavy_ball":  # theta -= lr (g + mbar)
                        _add_(local, d, -lr)
                    nsteps += 1
            wk = flat(local)
            if alg == "scaffold":
                rho = cfg.momentum if o["keff_momentum"] else 0.0
                k_eff = (nsteps - rho * (1 - rho**nsteps) / (1 - rho)) / (1 - rho) if rho else nsteps
                new_ck[int(k)] = c_k[int(k)] - c_glob + (gflat - wk) / (k_eff * lr)
            if alg == "feddyn":
                h_k[int(k)] = h_k[int(k)] + (wk - gflat)
            if alg == "moon":
                prev[int(k)] = copy.deepcopy(local).eval()
            states.append(local.state_dict())
            sizes.append(len(idx))
            flats.append(wk)
        if dp is not None and "tree" in dp:  # DP-FTRL: the model is the tree's anchor + the noised prefix sum / E
            total = torch.zeros(P, device=dev)
            for f in flats:
                d = f - gflat
                total = total + d * min(1.0, dp["clip"] / float(d.norm()))
            tr = dp["tree"]  # restart (rounds per tree or None), node(tree, level, start) -> its noise [P]
            t = rnd % tr["restart"] + 1 if tr["restart"] else rnd + 1
            tree = rnd // tr["restart"] if tr["restart"] else 0
            if t == 1:  # a new tree: it starts from the current model
                tr["anchor"], tr["sums"] = gflat.clone(), []
            tr["sums"].append(total)
            prefix, start = torch.zeros(P, device=dev), 0
            for level in reversed(range(t.bit_length())):  # t's binary decomposition, the largest node first
                if t >> level & 1:
                    node = torch.stack(tr["sums"][start : start + (1 << level)]).sum(0)
                    prefix = prefix + node + dp["z"] * dp["clip"] * tr["node"](tree, level, start).to(dev)
                    start += 1 << level
            _load_(glob, tr["anchor"] + prefix / dp["E"])
            gkd_hist.append(copy.deepcopy(glob.state_dict()))
            continue
        if dp is not None:  # DP-FedAvg: clipped deltas, summed, the round's noise, over the expected cohort size
            total, centred = torch.zeros(P, device=dev), 0.0
            for f in flats:
                d = f - gflat
                total = total + d * min(1.0, dp["clip"] / float(d.norm()))
                centred += (1.0 if float(d.norm()) <= dp["clip"] else 0.0) - 0.5
            gen = dp["gen"](rnd) if dp["z"] > 0 else None
            xi = torch.randn(P, generator=gen) if dp["z"] > 0 else torch.zeros(P)
            _load_(glob, gflat + (total + dp.get("z_update", dp["z"]) * dp["clip"] * xi.to(dev)) / dp["E"])
            if "quantile" in dp:  # adaptive clipping: the noised fraction of unclipped updates moves the clip
                b = (centred + float(torch.randn(1, generator=gen)[0]) * dp["sigma_b"]) / dp["E"] + 0.5
                dp["clip"] = dp["clip"] * math.exp(-dp["lr_c"] * (b - dp["quantile"]))
                dp.setdefault("clips", []).append(dp["clip"])
            gkd_hist.append(copy.deepcopy(glob.state_dict()))
            continue
        if cfg.aggregate_weights == "uniform":
            w = torch.full((len(sizes),), 1.0 / len(sizes))
        else:
            w = torch.tensor(sizes, dtype=torch.float32) / sum(sizes)
        avg = {key: sum(w[i] * states[i][key] for i in range(len(states))) for key in states[0]}
        for key in avg:  # integers (BatchNorm's num_batches_tracked): the weighted average, rounded to the nearest
            if not states[0][key].is_floating_point():
                avg[key] = sum(float(w[i]) * states[i][key].double() for i in range(len(states))).round()
        glob.load_state_dict(avg)
        aflat = flat(glob)
        if alg == "fedavgm":
            server_v = o["server_momentum"] * server_v + (gflat - aflat)
            newg = gflat - o["server_lr"] * server_v
        elif alg == "scaffold":
            c_glob = c_glob + sum(new_ck[k] - c_k[k] for k in new_ck) / K
            c_k.update(new_ck)
            newg = aflat
        elif alg == "feddyn":
            hbar = hbar + sum(f - gflat for f in flats) / K
            newg = aflat + hbar  # the cloud model: next round's start (and the teacher)
        elif alg.startswith("fedadc"):  # m' = D/eta + (beta_g - beta_l) m ; theta' = theta - alpha eta m'
            adc_m = (gflat - aflat) / lr + (o["beta_global"] - o["beta"]) * adc_m
            newg = gflat - o["alpha"] * lr * adc_m
        else:
            newg = aflat
        _load_(glob, newg)
        gkd_hist.append(copy.deepcopy(glob.state_dict()))
        if alg == "fedgkd_vote":
            with torch.no_grad():
                xv, yv = val.batch(torch.arange(len(val)))
                vote_hist.append((copy.deepcopy(glob).eval(), float(F.cross_entropy(glob.eval()(xv), yv))))
                glob.train()
    if out is not None:
        out["state"] = copy.deepcopy(glob.state_dict())
    return flat(glob)


def engine_vs_loop(algorithm, options=None, device=None, model="mlp", **cfg_kw):
    """Run ``algorithm`` with the engine (on ``device``) and with the literal loop (CPU) on the same data, seeds and
    batch order; returns (relative error of the global models, the Simulation, its history). ``model``: of
    :func:`setup_data` ("bn": BatchNorm with running statistics; the global models' buffers must then agree too)."""
    train, test, part, model = setup_data(model)
    val = data.ArrayDataset(test.x[:50], test.y[:50], test.num_classes, test.mean, test.std)
    kw = dict(
        algorithm=algorithm,
        clients_per_round=4,
        rounds=2,
        local_epochs=2,
        batch_size=16,
        lr=0.05,
        weight_decay=1e-4,
        seed=3,
        momentum=0.9,
        max_grad_norm=0.0,
        options=options or {},
    )
    kw.update(cfg_kw)
    cfg = fedfast.SimConfig(**kw)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part, val=val, device=device)
    final = {}
    ref = sequential(cfg, copy.deepcopy(sim.model).cpu(), train, part, cfg.rounds, val=val, out=final)  # its head too
    hist = sim.run()
    g = sim.global_flat.cpu()
    on_disk_too(
        sim,
        lambda d, **store: fedfast.Simulation(
            dataclasses.replace(cfg, **store),
            copy.deepcopy(model),
            train,
            test,
            part,
            val=val,
            device=device,
            state_dir=d,
        ),
    )
    err = float((g - ref).abs().max() / ref.abs().max())
    if sim.runtime.num_buffers:  # every buffer of the global model too (running statistics, num_batches_tracked)
        err = max(err, buffers_error(sim.state_dict(), final["state"]))
    return err, sim, hist


def buffers_error(got: dict, want: dict) -> float:
    """The largest relative error over the floating-point buffers of two ``state_dict``s of a model; integer buffers
    (num_batches_tracked) must be equal (inf otherwise)."""
    err = 0.0
    for name, b in want.items():
        if not name.endswith(("running_mean", "running_var", "num_batches_tracked")):
            continue
        a = got[name]
        if not b.is_floating_point():
            if not torch.equal(a.cpu(), b.cpu()):
                return float("inf")
            continue
        err = max(err, float((a.cpu().double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)))
    return err


def on_disk_too(sim, make) -> None:
    """A method with per-client state: the same run with the store forced to a file (``make(state_store="disk")``
    builds it in directory ``d``) ends with the same global model and client state, bit for bit, so the literal-loop
    comparison holds for the disk store too (issue 38)."""
    if sim.method.client_state is None:
        return
    with tempfile.TemporaryDirectory() as d:
        disk = make(d, state_store="disk", state_memory_gb=None)
        disk.run()
        st = disk.method.client_state
        assert st.on_disk and os.path.exists(st.file_paths()[0])
        assert torch.equal(disk.global_flat, sim.global_flat), f"{sim.cfg.algorithm}: the disk store changed the run"
        assert torch.equal(st.dense(), sim.method.client_state.dense().to(st.dense().device))


def asd_term(z, t, y, prior, a):
    """ASD (Yashwanth et al., the official code's scaling) written out: lam * sum_i alpha_i KL(q_g,i || q_i), alpha_i
    = exp(-H_i) / p(y_i) normalised over the minibatch, H the teacher's entropy at entropy_tau; ``a`` the [asd]
    options; not-true classes are not handled (the bases using this have none)."""
    tau, et = a["tau"], a["entropy_tau"]
    kl = (torch.softmax(t / tau, 1) * (torch.log_softmax(t / tau, 1) - torch.log_softmax(z / tau, 1))).sum(1)
    H = -(torch.softmax(t / et, 1) * torch.log_softmax(t / et, 1)).sum(1)
    alpha = torch.exp(-H) / prior[y]
    return a["lam"] * (alpha / alpha.sum() * kl).sum() * (tau**2 if a["tau_squared"] else 1.0)


def fisher_diagonal(local, train, batches, samples: int) -> torch.Tensor:
    """FedCurv's upload_local_fisher (Lee-Gihun/FedNTD): the mean over minibatches of the squared minibatch-mean
    gradients, in ``batches``' order, stopping after the first that brings the sample count above ``samples``."""
    squares, seen = [], 0
    for b in batches:
        x, y = train.batch(b)
        g = torch.autograd.grad(F.cross_entropy(local(x), y), list(local.parameters()))
        squares.append(torch.cat([t.reshape(-1) for t in g]) ** 2)
        seen += len(y)
        if seen > samples:
            break
    return torch.stack(squares).mean(0)


class PlainLoop:
    """The literal loop a researcher writes, as a skeleton for the method tests: the round's clients one after
    another, each a ``copy.deepcopy`` of the global ``nn.Module`` trained with ``torch.optim.SGD`` on its own
    minibatches (the engine's data order), then a ``state_dict`` average. Each method's test file subclasses it
    and writes the method's formulas in the hooks, in plain PyTorch, without fedfast's method classes (options
    come from the resolved config: ``self.o``)."""

    def __init__(self, cfg, model, train, part):
        self.cfg, self.train, self.part = cfg, train, part
        self.o = {**vars(cfg.method().opts)}
        self.glob = copy.deepcopy(model)
        self.w0 = flat(model)
        self.K = part.num_clients
        self.sizes = np.array([len(i) for i in part.indices])
        self.hist = torch.stack([torch.bincount(train.y[i], minlength=train.num_classes) for i in part.indices]).float()

    # -- hooks ----------------------------------------------------------------------------------------------
    def sample(self, rnd):
        return sample_clients(self.cfg.seed, rnd, self.K, self.cfg.clients_per_round)

    def round_start(self, sampled):
        """Server values for the round (``self.gflat``: the model the clients start from)."""

    def optimizer(self, local, k):
        c = self.cfg
        if c.client_optimizer != "sgd":
            adam = torch.optim.AdamW if c.client_optimizer == "adamw" else torch.optim.Adam
            return adam(local.parameters(), lr=self.lr, betas=c.adam_betas, eps=c.adam_eps, weight_decay=c.weight_decay)
        return torch.optim.SGD(local.parameters(), lr=self.lr, momentum=c.momentum, weight_decay=c.weight_decay)

    def loss(self, local, x, y, k):
        return F.cross_entropy(local(x), y)

    def step(self, local, opt, x, y, k):
        """One local step: loss, backward, clipping, the optimizer."""
        opt.zero_grad()
        self.loss(local, x, y, k).backward()
        self.clip(local)
        opt.step()

    def clip(self, local):
        if self.cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(local.parameters(), self.cfg.max_grad_norm)

    def client_end(self, k, local, nsteps):
        """After client ``k``'s local training (``nsteps`` steps)."""

    def weights(self, sampled):
        n = torch.tensor(self.sizes[sampled], dtype=torch.float64)
        w = n if self.cfg.aggregate_weights == "size" else torch.ones_like(n)
        return w / w.sum()

    def server(self, avg, sampled):
        """The new global model (flat) from the participants' weighted average ``avg`` (flat)."""
        return avg

    # -- the loop ---------------------------------------------------------------------------------------------
    def batches(self, rnd, k, e):
        idx = self.part.indices[k]
        return idx[torch.from_numpy(client_order(self.cfg.seed, rnd, int(k), e, len(idx)))].split(self.cfg.batch_size)

    def round(self, rnd):
        """Round ``rnd`` (0-based) of the loop."""
        c = self.cfg
        self.rnd, self.lr = rnd, c.lr * c.lr_decay**rnd
        sampled = np.asarray(self.sample(rnd))
        self.gflat = flat(self.glob)
        self.round_start(sampled)
        states = []
        for k in sampled:
            local = copy.deepcopy(self.glob)
            opt = self.optimizer(local, int(k))
            nsteps = 0
            for e in range(c.local_epochs):
                for b in self.batches(rnd, k, e):
                    x, y = self.train.batch(b)
                    self.step(local, opt, x, y, int(k))
                    nsteps += 1
            self.client_end(int(k), local, nsteps)
            states.append(local.state_dict())
        w = self.weights(sampled)
        avg = {key: sum(float(w[i]) * states[i][key] for i in range(len(states))) for key in states[0]}
        for key in avg:  # integers (BatchNorm's num_batches_tracked): the weighted average, rounded to the nearest
            if not states[0][key].is_floating_point():
                avg[key] = sum(float(w[i]) * states[i][key].double() for i in range(len(states))).round()
        self.glob.load_state_dict(avg)
        _load_(self.glob, self.server(flat(self.glob), sampled))

    def run(self, rounds):
        for rnd in range(rounds):
            self.round(rnd)
        return flat(self.glob)


def engine_vs(loop_cls, algorithm, options=None, *, rounds=2, model=None, executor="auto", device=None, **cfg_kw):
    """The engine and ``loop_cls`` (a :class:`PlainLoop`) on the same data, seeds and batch order: (relative error
    of the global models after ``rounds`` rounds, the Simulation, the loop)."""
    train, test, part, base = setup_data()
    model = base if model is None else model
    kw = dict(
        algorithm=algorithm,
        clients_per_round=4,
        rounds=rounds,
        local_epochs=2,
        batch_size=16,
        lr=0.05,
        weight_decay=1e-4,
        seed=3,
        momentum=0.9,
        max_grad_norm=0.0,
        options=options or {},
        executor=executor,
    )
    kw.update(cfg_kw)
    cfg = fedfast.SimConfig(**kw)
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part, device=device)
    loop = loop_cls(cfg, copy.deepcopy(sim.model).cpu(), train, part)  # the model the engine trains (its head too)
    ref = loop.run(rounds)
    sim.run()
    g = sim.global_flat.cpu()
    on_disk_too(
        sim,
        lambda d, **store: fedfast.Simulation(
            dataclasses.replace(cfg, **store), copy.deepcopy(model), train, test, part, device=device, state_dir=d
        ),
    )
    err = float((g - ref).abs().max() / ref.abs().max())
    if sim.runtime.num_buffers:  # every buffer of the global model too
        err = max(err, buffers_error(sim.state_dict(), loop.glob.state_dict()))
    return err, sim, loop


def plugin_fixture(path, name):
    """A module-scoped, autouse fixture: the plug-in file ``path`` loaded for the module's tests, its method
    ``name`` unregistered afterwards (assign it to a module-level name in the test file)."""
    import pytest

    from fedfast import methods

    @pytest.fixture(scope="module", autouse=True)
    def _loaded():
        methods.load_plugin(path)
        yield
        methods.unregister(name)

    return _loaded
