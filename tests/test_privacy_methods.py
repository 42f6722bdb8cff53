"""Every method of the tables private (issue 58): the methods that upload more than their update clip it jointly
with the update (one L2 norm over the concatenation, DP-SCAFFOLD's joint clipping) and read noised sums, each against
a literal per-client loop that writes the private round out; the two whose uploads cannot be bounded are refused
with the reason.

The loop (:class:`PrivateLoop`): the round's clients (Poisson-sampled from the run's secret) trained one after
another as plain ``nn.Module`` copies with ``torch.optim.SGD``; each client's update ``w_k - g`` (times the method's
factor) and its uploads concatenated, their norm taken, everything scaled by ``min(1, C / norm)``; the update sum
plus ``z C`` times the round's noise over E is the average, each upload's sum plus ``z C`` times its own noise (times
the method's scale) what the server rule reads."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sequential_loop import PlainLoop, fisher_diagonal, flat, setup_data

import fedfast
from fedfast.privacy.ftrl import TREE
from fedfast.privacy.secret import NOISE
from fedfast.sampling import sample_clients, sample_clients_poisson

pytest.importorskip("dp_accounting")

KW = dict(
    clients_per_round=4,
    rounds=3,
    local_epochs=1,
    batch_size=16,
    lr=0.05,
    seed=3,
    momentum=0.0,
    weight_decay=0.0,
    max_grad_norm=0.0,
    client_sampling="poisson",
    dp_clip=0.3,
    dp_noise_multiplier=0.7,
)


class PrivateLoop(PlainLoop):
    """The private round written out (module docstring); subclasses add the method: ``uploads`` (name -> vector of
    a trained client), ``factor`` (on its update), ``scales`` and ``private_server``."""

    scales: dict = {}

    def __init__(self, cfg, model, train, part, secret, tree=None):
        super().__init__(cfg, model, train, part)
        self.secret, self.tree = secret, tree
        self.C, self.z, self.E = cfg.dp_clip, cfg.dp_noise_multiplier, float(cfg.clients_per_round)

    def sample(self, rnd):
        K, m = self.K, self.cfg.clients_per_round
        if self.cfg.client_sampling == "poisson":
            return sample_clients_poisson(self.secret.cohort_seed(), rnd, K, m / K)
        return sample_clients(self.cfg.seed, rnd, K, m)  # DP-FTRL: public cohorts, from the run seed

    def uploads(self, k, local, nsteps) -> dict:
        return {}

    def factor(self, k, nsteps) -> float:
        return 1.0

    def private_server(self, avg, released, sampled):
        return avg

    def noise(self, rnd, stream, n):
        """Round ``rnd``'s unit noise of ``stream`` (0: the update): DP-FedAvg's fresh draw, or DP-FTRL's tree
        increment (the new node's noise minus the dropped ones')."""
        if self.tree is None:
            ids = (NOISE, rnd) + ((stream,) if stream else ())
            return torch.randn(n, generator=self.secret.generator("cpu", *ids))
        t = rnd + 1
        v = (t & -t).bit_length() - 1
        nodes = [(v, t - (1 << v), 1.0)] + [(lev, t - (1 << (lev + 1)), -1.0) for lev in range(v)]
        out = torch.zeros(n)
        for lev, start, sign in nodes:
            ids = (TREE, 0, lev, start) + ((stream,) if stream else ())
            out += sign * torch.randn(n, generator=self.secret.generator("cpu", *ids))
        return out

    def round(self, rnd):
        c = self.cfg
        self.rnd, self.lr = rnd, c.lr * c.lr_decay**rnd
        sampled = np.asarray(self.sample(rnd))
        g = self.gflat = flat(self.glob)
        self.round_start(sampled)
        parts = []
        for k in sampled:
            local = copy.deepcopy(self.glob)
            opt = self.optimizer(local, int(k))
            nsteps = 0
            for b in self.batches(rnd, k, 0):
                self.step(local, opt, *self.train.batch(b), int(k))
                nsteps += 1
            self.client_end(int(k), local, nsteps)
            parts.append((self.factor(int(k), nsteps) * (flat(local) - g), self.uploads(int(k), local, nsteps)))
        names = sorted(self.scales)
        total = torch.zeros_like(g)
        sums = {n: 0.0 for n in names}
        for d, up in parts:  # one norm over the update and every upload; everything scaled by min(1, C / norm)
            norm = float(torch.cat([d] + [up[n].reshape(-1) for n in names]).norm())
            s = min(1.0, self.C / norm)
            total = total + s * d
            for n in names:
                sums[n] = sums[n] + s * up[n]
        avg = g + (total + self.z * self.C * self.noise(rnd, 0, g.numel())) / self.E
        released = {}
        for j, n in enumerate(names, 1):
            v = torch.as_tensor(sums[n], dtype=torch.float32).reshape(-1) if parts else torch.zeros(self.cols[n])
            released[n] = self.scales[n] * (v + self.z * self.C * self.noise(rnd, j, v.numel()))
        new = self.private_server(avg, released, sampled)
        torch.nn.utils.vector_to_parameters(new, self.glob.parameters())


class ScaffoldLoop(PrivateLoop):
    """SCAFFOLD option II with momentum 0: local gradients g + c - c_k; c_k' - c_k = -c + (g - w_k) / (K lr),
    uploaded; c += noised sum / N; the client keeps c_k' unclipped."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        P = self.w0.numel()
        self.c, self.ck = torch.zeros(P), {}
        self.scales, self.cols = {"increment": 1.0 / self.K}, {"increment": P}

    def step(self, local, opt, x, y, k):
        opt.zero_grad()
        F.cross_entropy(local(x), y).backward()
        corr, off = self.c - self.ck.get(k, torch.zeros_like(self.c)), 0
        for p in local.parameters():
            p.grad += corr[off : off + p.numel()].view_as(p)
            off += p.numel()
        opt.step()

    def client_end(self, k, local, nsteps):
        self.dc = -self.c + (self.gflat - flat(local)) / (nsteps * self.lr)
        self.ck[k] = self.ck.get(k, torch.zeros_like(self.c)) + self.dc

    def uploads(self, k, local, nsteps):
        return {"increment": self.dc}

    def private_server(self, avg, released, sampled):
        self.c = self.c + released["increment"]
        return avg


class DynLoop(PrivateLoop):
    """FedDyn (alpha_scaling 'minibatches'): loss + alpha_k <w, h_k - g>, weight decay alpha_k; h_k += w_k - g (the
    client's own); hbar += E (avg - g) / N, the average's noised sum; the cloud model avg + hbar."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.h, self.hbar = {}, torch.zeros_like(self.w0)

    def alpha(self, k):
        return self.o["alpha"] / (self.sizes[k] / self.cfg.batch_size)

    def optimizer(self, local, k):
        return torch.optim.SGD(local.parameters(), lr=self.lr, weight_decay=self.alpha(k))

    def loss(self, local, x, y, k):
        w = torch.cat([p.reshape(-1) for p in local.parameters()])
        h = self.h.get(k, torch.zeros_like(w))
        return F.cross_entropy(local(x), y) + self.alpha(k) * (w * (h - self.gflat)).sum()

    def client_end(self, k, local, nsteps):
        self.h[k] = self.h.get(k, torch.zeros_like(self.w0)) + (flat(local) - self.gflat)

    def private_server(self, avg, released, sampled):
        self.hbar = self.hbar + self.E * (avg - self.gflat) / self.K
        self.avg = avg
        return avg + self.hbar


class CurvLoop(PrivateLoop):
    """FedCurv: loss + lam (P w^2 - 2 Q w), P = U - u_k, Q = V - v_k with U, V the server's noised sums and (u_k,
    v_k) the client's own; after training u_k' (squared minibatch gradients of a fresh pass), v_k' = u_k' w_k;
    uploads u_k' - u_k, v_k' - v_k."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        P = self.w0.numel()
        self.U, self.V, self.u, self.v = torch.zeros(P), torch.zeros(P), {}, {}
        self.scales, self.cols = {"U": 1.0, "V": 1.0}, {"U": P, "V": P}

    def loss(self, local, x, y, k):
        loss = F.cross_entropy(local(x), y)
        if self.rnd:
            w = torch.cat([p.reshape(-1) for p in local.parameters()])
            Pt, Qt = self.U - self.u.get(k, 0.0), self.V - self.v.get(k, 0.0)
            loss = loss + self.o["lam"] * torch.inner(Pt, w * w) - 2.0 * self.o["lam"] * torch.inner(Qt, w)
        return loss

    def client_end(self, k, local, nsteps):
        u = fisher_diagonal(local, self.train, self.batches(self.rnd, k, self.cfg.local_epochs), self.o["samples"])
        v = u * flat(local)
        zero = torch.zeros_like(u)
        self.up = {"U": u - self.u.get(k, zero), "V": v - self.v.get(k, zero)}
        self.u[k], self.v[k] = u, v

    def uploads(self, k, local, nsteps):
        return self.up

    def private_server(self, avg, released, sampled):
        self.U, self.V = self.U + released["U"], self.V + released["V"]
        return avg


class DistillLoop(PrivateLoop):
    """FedDistill+: per-label logit sums of the round's training (counts from 1), A_k' = S / N; the target
    G_k = (T - A_k) / (K - 1), T the server's noised running sum, A_k the client's own; upload A_k' - A_k."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        C = self.train.num_classes
        self.T, self.A = torch.zeros(C * C), {}
        self.scales, self.cols = {"A": 1.0}, {"A": C * C}

    def loss(self, local, x, y, k):
        o, z, C = self.o, local(x), self.train.num_classes
        S, N = self.track
        with torch.no_grad():
            for i in range(len(y)):
                S[y[i]] += z[i]
                N[y[i]] += 1
        loss = F.cross_entropy(z, y)
        if self.rnd == 0 and o["skip_first_round"]:
            return loss
        G = ((self.T - self.A.get(k, torch.zeros(C * C))) / (self.K - 1)).reshape(C, C)
        p = torch.softmax(G[y] / o["tau"], 1)
        kl = (p * (torch.log(p) - torch.log_softmax(z / o["tau"], 1))).sum(1).mean()
        return loss + o["coef"] * (o["tau"] ** 2 if o["tau_squared"] else 1) * kl

    def optimizer(self, local, k):
        C = self.train.num_classes
        self.track = (torch.zeros(C, C), torch.ones(C))
        return super().optimizer(local, k)

    def client_end(self, k, local, nsteps):
        S, N = self.track
        new = (S / N[:, None]).reshape(-1)
        self.up = {"A": new - self.A.get(k, torch.zeros_like(new))}
        self.A[k] = new

    def uploads(self, k, local, nsteps):
        return self.up

    def private_server(self, avg, released, sampled):
        self.T = self.T + released["A"]
        return avg


class NovaLoop(PrivateLoop):
    """FedNova (momentum 0, ccvr: gradient - d_k, d_k the client's own last normalised update): the update's
    factor 1 / a_k, a_k = ceil(n_k / B) local steps; upload gamma a_k (released over gamma); w' = g + (T / E) (avg -
    g), T the noised sum of the a_k."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.d, self.gamma = {}, self.o["dp_tau_scale"]
        self.scales, self.cols = {"tau": 1.0 / self.gamma}, {"tau": 1}

    def step(self, local, opt, x, y, k):
        opt.zero_grad()
        F.cross_entropy(local(x), y).backward()
        if self.o["ccvr"] and k in self.d:
            corr, off = -self.d[k], 0
            for p in local.parameters():
                p.grad += corr[off : off + p.numel()].view_as(p)
                off += p.numel()
        opt.step()

    def client_end(self, k, local, nsteps):
        self.d[k] = (self.gflat - flat(local)) / (self.lr * nsteps)

    def factor(self, k, nsteps):
        return 1.0 / nsteps

    def uploads(self, k, local, nsteps):
        return {"tau": torch.tensor([self.gamma * nsteps], dtype=torch.float32)}

    def private_server(self, avg, released, sampled):
        return self.gflat + float(released["tau"][0]) / self.E * (avg - self.gflat)


CASES = [
    ("scaffold", {}, ScaffoldLoop),
    ("feddyn", dict(alpha=0.1, alpha_scaling="minibatches"), DynLoop),
    ("fedcurv", dict(samples=20), CurvLoop),
    ("feddistill_plus", dict(coef=1.0, tau=2.0, skip_first_round=False), DistillLoop),
    ("fednova", dict(dp_tau_scale=0.05), NovaLoop),
]


def _engine_and_loop(algorithm, options, loop_cls, **kw):
    train, test, part, model = setup_data("mlp")
    cfg = fedfast.SimConfig(algorithm=algorithm, options=options, **{**KW, **kw})
    sim = fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
    tree = kw.get("dp_mechanism") == "dp_ftrl"
    loop = loop_cls(cfg, copy.deepcopy(sim.model).cpu(), train, part, sim.privacy.secret, tree=tree or None)
    ref = loop.run(cfg.rounds)
    sim.run()
    return sim, loop, ref


@pytest.mark.parametrize("algorithm,options,loop_cls", CASES, ids=[c[0] for c in CASES])
def test_private_uploads_equal_the_literal_loop(algorithm, options, loop_cls):
    """Clip 0.3 with z = 0.7 over 3 rounds: the engine's global model (and FedDyn's evaluated average) equals the
    loop's, which clips the update and the uploads with one norm and noises every sum; clipping acted on some
    client (else the test would not see a wrong norm)."""
    sim, loop, ref = _engine_and_loop(algorithm, options, loop_cls)
    err = float((sim.global_flat.cpu() - ref).abs().max() / ref.abs().max())
    assert err <= 2e-5, err
    if algorithm == "feddyn":
        assert float((sim.eval_flat.cpu() - loop.avg).abs().max() / loop.avg.abs().max()) <= 2e-5
    assert sim.history[-1]["dp_epsilon"] > 0


def test_the_loop_sees_an_upload_left_out_of_the_norm(monkeypatch):
    """A broken joint clip (the uploads left out of the norm) makes SCAFFOLD's round differ from the loop's."""
    from fedfast.privacy import DPFedAvg

    real = DPFedAvg.bound

    def update_only(self, extra, weights, norms, uploads=None, clients=None, g=None):
        out = real(self, extra, weights, norms, uploads, clients, g)
        if uploads:  # the factors from the update's norm alone
            idx = torch.arange(weights.numel())
            own = fedfast.ops.update_norms(clients, g, idx).float()
            self._s = torch.clamp(self.clip / own, max=1.0)
            out["dp_norms"] = own
        return out

    monkeypatch.setattr(DPFedAvg, "bound", update_only)
    sim, loop, ref = _engine_and_loop("scaffold", {}, ScaffoldLoop)
    assert float((sim.global_flat.cpu() - ref).abs().max() / ref.abs().max()) > 1e-3


def test_scaffold_under_dp_ftrl_equals_the_loop_with_tree_noise():
    """DP-FTRL with an upload: the update and the control variates' sum each take their own tree's increments."""
    sim, _, ref = _engine_and_loop("scaffold", {}, ScaffoldLoop, dp_mechanism="dp_ftrl", client_sampling="uniform")
    err = float((sim.global_flat.cpu() - ref).abs().max() / ref.abs().max())
    assert err <= 2e-5, err


@pytest.mark.parametrize(
    "algorithm,options,match",
    [
        ("fedgen", {}, "fedgen is refused in a private run: its server trains the generator on each client's own"),
        ("feddisco", {}, "feddisco is refused in a private run: its aggregation weights"),
    ],
)
def test_unboundable_uploads_are_refused_with_the_reason(algorithm, options, match):
    with pytest.raises(ValueError, match=match):
        fedfast.SimConfig(algorithm=algorithm, options=options, **KW)


@pytest.mark.parametrize(
    "algorithm,options,match",
    [
        ("feddyn", {}, "feddyn.alpha_scaling: 'mean_size' scales each client's regulariser by the mean data size"),
        ("fedspeed", dict(evaluated="all_clients"), "fedspeed.evaluated: 'all_clients'"),
        ("fednova", dict(ccvr_server=True), "fednova.ccvr_server"),
    ],
)
def test_options_that_unbound_an_upload_are_refused_by_name(algorithm, options, match):
    train, test, part, model = setup_data("mlp")
    cfg = fedfast.SimConfig(algorithm=algorithm, options=options, **KW)
    with pytest.raises(ValueError, match=match):
        fedfast.Simulation(cfg, copy.deepcopy(model), train, test, part)
