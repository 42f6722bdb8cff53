"""FedGen (Zhu, Hong and Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated Learning", ICML 2021),
as its official code runs it (zhuangdizhu/FedGen @dd5807c, ``FLAlgorithms/servers/serverpFedGen.py``,
``FLAlgorithms/users/userpFedGen.py``, ``FLAlgorithms/trainmodel/generator.py``).

**Generator** ``G(eps, y)``: ``Linear(noise + C, hidden) -> BatchNorm1d -> ReLU -> Linear(hidden, F)``, the input
``eps ~ U[0, 1)^noise`` (the code's ``torch.rand``) with the label's one-hot; its output is a feature vector for
the classifier (the model's last ``nn.Linear``, input F). Sizes as FedGKD states them (§5.1, Yao et al.): hidden
512 / 2048 / 768 for ResNet-8 / ResNet-50 / DistilBERT, i.e. ``hidden = max(512, F)``, and ``noise = F``
(FedGKD's ``GENERATORCONFIGS``).

**Server**, after the round's local training, before averaging: ``server_steps`` Adam steps (FedGen:
``ensemble_epochs`` 50 = 10 epochs x 5 teacher iterations; lr ``gen_lr``, weight decay 1e-2, the lr decayed x0.98
per round) on::

    sum_u mean_i[ CE(h_u(G(eps_i, y_i)), y_i) * w[y_i, u] ]  +  eta * exp(-mean_ij(d_eps(i, j) * d_z(i, j)))

over the participants' classifiers ``h_u`` (eval mode), ``y_i`` drawn uniformly from the labels some participant
holds, ``w[y, u] = c_u[y] / sum_v c_v[y]`` with the label counts seen in training (``c_u[y] = 1 + E n_{u,y}``;
the code's counters start at 1), the diversity term with ``d_z`` the mean absolute and ``d_eps`` the mean squared
difference of rows (``DiversityLoss('l1')``). The generator trains in train mode (batch statistics).

**Client** k from round 2 on (``glob_iter > 0``), per minibatch (z its logits on the real data)::

    CE(z, y) + beta_t KL(softmax(h_k(G(eps, y))) || softmax(z))                         (latent matching)
             + (gen_batch / B) alpha_t mean_j CE(h_k(G(eps_j, yhat_j)), yhat_j)          (teacher loss)

``alpha_t = max(1e-4, alpha 0.98^t)`` (likewise ``beta_t``; t the 0-based round), the generator in eval mode
(running statistics), the first target detached, ``yhat`` drawn from the labels the client holds
(``available_labels``). Defaults from the code's MNIST configuration (``utils/model_config.py``: ``generative_alpha
= generative_beta = 10``, ``ensemble_lr 3e-4``) and ``main.py`` (``gen_batch_size = batch_size``). FedGKD's
code (CGCL-codes/FedGKD @72e7bac), whose Tables 3-4 report FedGen, keeps only the teacher loss (``beta = 0``),
draws ``yhat`` over all classes, uses ``gen_lr = 1e-4`` and per-dataset ``alpha`` (CIFAR-10 0.1, CIFAR-100 1,
Tiny-ImageNet 0.1, text 1); its presets set these. FedGKD's worker never updates its label counts (every client
weighs 1 in the generator's loss); fedfast uses the counts, as FedGen.

Random draws (the generator's noise and labels) are keyed by (seed, round, epoch, step) and drawn for the whole
round's cohort, each client taking its row (:func:`client_draws`, :func:`server_draws`): the same for any
chunking or number of processes. The official code's "early stop" (no generator terms after 20 local "epochs",
which are single minibatch steps there) never triggers at its defaults (20 epochs) and is not reproduced.
State: the generator, its Adam moments and step count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .base import STATE_FORMAT
from .fedavg import FedAvg
from .hooks import cross_entropy
from .options import opt
from .registry import register
from .round import Collected

_CODE = "zhuangdizhu/FedGen @dd5807c"


class Generator(nn.Module):
    """FedGen's generator: ``Linear(noise + C, hidden) -> BatchNorm1d -> ReLU -> Linear(hidden, F)``."""

    def __init__(self, noise: int, classes: int, hidden: int, features: int):
        super().__init__()
        self.noise, self.classes = noise, classes
        self.fc = nn.Linear(noise + classes, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.out = nn.Linear(hidden, features)

    def forward(self, eps: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.bn(self.fc(torch.cat([eps, F.one_hot(y, self.classes).to(eps.dtype)], 1)))))


def diversity(eps: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """FedGen's ``DiversityLoss('l1')``: exp(-mean over pairs of (mean squared noise distance * mean absolute output
    distance))."""
    dz = (z[None, :, :] - z[:, None, :]).abs().mean(2)
    de = (eps[None, :, :] - eps[:, None, :]).pow(2).mean(2)
    return torch.exp(-(de * dz).mean())


def _generator(seed: int, *key: int, device) -> torch.Generator:
    s = int(np.random.SeedSequence([seed, *key]).generate_state(1, np.uint64)[0]) & (2**63 - 1)
    return torch.Generator(device=device).manual_seed(s)


def client_draws(
    seed: int, rnd: int, epoch: int, step: int, num_total: int, batch: int, gen_batch: int, noise: int, device="cpu"
):
    """The step's draws for every client of the round, by position: latent-matching noise [T, batch, noise],
    uniforms [T, gen_batch] that pick the teacher labels, teacher noise [T, gen_batch, noise]."""
    g = _generator(seed, 52807, rnd, epoch, step, device=device)
    return (
        torch.rand(num_total, batch, noise, generator=g, device=device),
        torch.rand(num_total, gen_batch, generator=g, device=device),
        torch.rand(num_total, gen_batch, noise, generator=g, device=device),
    )


def server_draws(seed: int, rnd: int, steps: int, batch: int, noise: int, device="cpu"):
    """The server's draws of a round: uniforms [steps, batch] that pick the labels, noise [steps, batch, noise]."""
    g = _generator(seed, 52807, rnd, 10**6, device=device)
    return (
        torch.rand(steps, batch, generator=g, device=device),
        torch.rand(steps, batch, noise, generator=g, device=device),
    )


def pick(u: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Labels drawn uniformly from the allowed ones: ``u`` [n, b] uniforms in [0, 1), ``allowed`` [n, C] bool -> [n, b]
    (the floor(u * count)-th allowed label of each row)."""
    cum = allowed.long().cumsum(1)
    j = (u * cum[:, -1:]).long().clamp_max(cum[:, -1:] - 1)
    return torch.searchsorted(cum, j + 1)


@register("fedgen")
class FedGen(FedAvg):
    """FedGen (Zhu et al. 2021): a server-trained label-conditioned feature generator; clients add
    beta_t KL(h(G(y)) || z) + alpha_t CE(h(G(yhat)), yhat) with their own classifier h."""

    uploads = "its classifier head and label counts (the generator's training data)"
    private_refusal = (
        "its server trains the generator on each client's own classifier head and label counts, one by one: a "
        "per-client input, not a sum, so Gaussian noise on a clipped sum cannot bound one client's influence on the "
        "generator (that would take differentially private training of the generator itself)"
    )
    needs_classifier = True
    paper = "Zhu, Hong and Zhou, Data-Free Knowledge Distillation for Heterogeneous Federated Learning, ICML 2021"
    accepts_asd = False
    caveats = (
        "Its default weights alpha = beta = 10 are FedGen's MNIST setting for plain SGD. With SGD momentum "
        "rho the generator terms take steps about 1 / (1 - rho) times larger, and training collapses. Under "
        "FedNTD's MNIST protocol with the MLP and momentum 0.9 (examples/study/fedgen-momentum.toml, 30 "
        "rounds, 2 seeds) FedGen ended at 30.2 % against FedAvg's 77.6 %. With alpha = beta = 1 there it "
        "ended at 78.8 %, level with FedAvg. With plain SGD and the defaults it ended at 86.9 % against "
        "FedAvg's 74.9 %. With momentum, either keep max(alpha, beta) / (1 - momentum) at most 10 (fedgen.alpha "
        "= fedgen.beta = 1 at momentum 0.9), or train as FedGen does with momentum = 0."
    )

    @dataclass
    class Options:
        alpha: float = opt(
            10.0,
            f"teacher-loss weight alpha ({_CODE}, model_config.py mnist: generative_alpha 10; FedGKD's code: 0.1-1)",
            check=">=0",
        )
        beta: float = opt(
            10.0, f"latent-matching weight beta ({_CODE}: generative_beta 10; FedGKD's code: none)", check=">=0"
        )
        decay: float = opt(0.98, f"alpha_t = max(1e-4, alpha decay^t) ({_CODE}: exp_lr_scheduler 0.98)", check="(0,1)")
        gen_batch: int | None = opt(
            None,
            f"teacher labels per client step (None: batch_size; {_CODE} main.py: gen_batch_size 32 = batch_size)",
            check=">=1",
        )
        available_labels: bool = opt(
            True, f"draw yhat from the client's own labels ({_CODE}); false: all classes (FedGKD's code)"
        )
        hidden: int | None = opt(
            None, "generator hidden width (None: max(512, F): FedGKD's 512 / 2048 / 768)", check=">=1"
        )
        noise: int | None = opt(None, "noise dimension (None: F, FedGKD's GENERATORCONFIGS)", check=">=1")
        gen_lr: float = opt(
            3e-4, f"generator Adam lr ({_CODE} mnist: ensemble_lr 3e-4; FedGKD's code 1e-4)", check=">0"
        )
        gen_weight_decay: float = opt(1e-2, f"generator weight decay ({_CODE}: 1e-2)", check=">=0")
        gen_lr_decay: float = opt(0.98, f"generator lr decay per round ({_CODE}: ExponentialLR 0.98)", check="(0,1]")
        server_steps: int = opt(50, f"generator steps per round ({_CODE}: ensemble_epochs 50)", check=">=1")
        server_batch: int | None = opt(None, f"labels per generator step (None: batch_size; {_CODE})", check=">=1")
        eta: float = opt(1.0, f"diversity-loss weight ({_CODE}: ensemble_eta 1)", check=">=0")

    def setup(self):
        e, o = self.engine, self.opts
        W, _ = e.head_params(e.global_flat[None])
        C, Fdim = W.shape[1], W.shape[2]
        self.features = Fdim
        self.hidden = o.hidden or max(512, Fdim)
        self.noise_dim = o.noise or Fdim
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(e.seed + 52807)
            self.generator = Generator(self.noise_dim, C, self.hidden, Fdim).to(e.device)
        self.gen_opt = torch.optim.Adam(self.generator.parameters(), lr=o.gen_lr, weight_decay=o.gen_weight_decay)
        self.gen_rounds = 0  # generator trainings so far (its lr is gen_lr * gen_lr_decay ** gen_rounds)
        B = e.batch_size
        self.gen_batch = o.gen_batch or B
        self.server_batch = o.server_batch or B

    def check_settings(self, config, model):
        """Momentum multiplies the generator terms' steps by about 1 / (1 - momentum) (its caveats)."""
        rho = config.momentum if config.client_optimizer == "sgd" else 0.0
        eff = max(self.opts.alpha, self.opts.beta) / (1.0 - rho)
        if rho and eff > 10.0 * (1 + 1e-9):
            return [
                f"alpha = {self.opts.alpha:g}, beta = {self.opts.beta:g} with SGD momentum {rho:g} weigh the "
                f"generator terms like {eff:g} under plain SGD (FedGen's MNIST setting: 10), and FedGen collapsed "
                f"in fedfast's check (30 % against FedAvg's 78 % on MNIST shards). Set fedgen.alpha and "
                f"fedgen.beta to {10.0 * (1.0 - rho):g}, or momentum = 0 as FedGen trains (fedfast methods fedgen)"
            ]
        return []

    def weights_at(self, t: int) -> tuple[float, float]:
        """(alpha_t, beta_t) of round t (0-based)."""
        o = self.opts
        return max(1e-4, o.alpha * o.decay**t), max(1e-4, o.beta * o.decay**t)

    # -- clients ---------------------------------------------------------------------------------------------
    def round_start(self, ctx):
        e, C = self.engine, self.engine.num_classes
        self.generator.eval()
        return {
            "w": torch.zeros(ctx.num_total, C, self.features, device=e.device),  # the participants' heads
            "b": torch.zeros(ctx.num_total, C, device=e.device),
            "counts": torch.zeros(ctx.num_total, C, device=e.device),
        }

    def chunk_start(self, ctx, lo, hi):
        return lo  # the chunk's first round position: each client's draws are keyed by its position

    def loss(self, ctx, b):
        e = self.engine
        n, B = b.num_clients, b.valid.shape[1]
        loss = cross_entropy(b, e.backend)
        if ctx.index == 0:
            return loss
        v = b.valid.float()
        per = v / v.sum(1, keepdim=True).clamp_min(1)  # each client's minibatch mean
        alpha, beta = self.weights_at(ctx.index)
        pos = ctx.positions[ctx.chunk : ctx.chunk + n]
        eps1, u, eps2 = (
            d[pos]
            for d in client_draws(
                e.seed, ctx.index, b.epoch, b.step, ctx.num_total, B, self.gen_batch, self.noise_dim, e.device
            )
        )
        with torch.no_grad():  # latent matching: the client's own classifier on generated features of the labels
            z1 = self.generator(eps1.reshape(n * B, -1), b.target.clamp_min(0)).reshape(n, B, -1)
            target = torch.softmax(e.head(b.params, z1), 2)
        logq = torch.log_softmax(b.logits.reshape(n, B, -1), 2)
        kl = (target * (torch.log(target.clamp_min(1e-30)) - logq)).sum(2)
        allowed = b.hist > 0 if self.opts.available_labels else torch.ones_like(b.hist, dtype=torch.bool)
        yhat = pick(u, allowed)  # [n, gen_batch]
        with torch.no_grad():
            z2 = self.generator(eps2.reshape(-1, self.noise_dim), yhat.reshape(-1)).reshape(n, self.gen_batch, -1)
        teach = F.cross_entropy(e.head(b.params, z2).reshape(-1, e.num_classes), yhat.reshape(-1), reduction="none")
        ratio = self.gen_batch / B
        return loss + beta * (kl * per).sum() + ratio * alpha * teach.reshape(n, -1).mean(1).sum()

    def collect(self, ctx, out, lo, hi):
        e = self.engine
        w, b = e.head_params(e.client_params(hi - lo))
        pos = ctx.positions[lo:hi]

        def at_positions(name, rows):  # the chunk's clients' rows of the round's table (zeros elsewhere)
            return torch.zeros_like(ctx.sums[name]).index_copy_(0, pos, rows.detach().contiguous())

        sums = {"w": at_positions("w", w), "counts": at_positions("counts", 1.0 + ctx.seen_hist[lo:hi])}  # labels
        if b is not None:
            sums["b"] = at_positions("b", b)
        return Collected(sums=sums)

    # -- server ----------------------------------------------------------------------------------------------
    def server(self, ctx, avg):
        self.train_generator(ctx)
        return super().server(ctx, avg)

    @torch.enable_grad()
    def train_generator(self, ctx):
        """The server's generator steps against the round's participants' classifiers (FedGen's train_generator)."""
        e, o = self.engine, self.opts
        W, bias, counts = ctx.sums["w"], ctx.sums["b"], ctx.sums["counts"]
        weights = counts / counts.sum(0, keepdim=True)  # [m, C]: w[y, u] transposed
        qualified = (counts.amax(0) > 1)[None]  # labels some participant holds
        lr = o.gen_lr * o.gen_lr_decay**self.gen_rounds
        for group in self.gen_opt.param_groups:
            group["lr"] = lr
        us, noise = server_draws(e.seed, ctx.index, o.server_steps, self.server_batch, self.noise_dim, e.device)
        self.generator.train()
        for i in range(o.server_steps):
            y = pick(us[i][None], qualified)[0]
            z = self.generator(noise[i], y)
            logits = torch.bmm(z.expand(W.shape[0], -1, -1), W.transpose(1, 2)) + bias[:, None, :]  # [m, b, C]
            ce = F.cross_entropy(logits.reshape(-1, e.num_classes), y.repeat(W.shape[0]), reduction="none")
            teacher = (ce.reshape(W.shape[0], -1) * weights[:, y]).mean(1).sum()
            loss = teacher + o.eta * diversity(noise[i], z)
            self.gen_opt.zero_grad(set_to_none=True)
            loss.backward()
            self.gen_opt.step()
        self.generator.eval()
        self.gen_rounds += 1

    # -- state ----------------------------------------------------------------------------------------------
    # the generator, its Adam optimizer and gen_rounds are checkpointed as attributes (Method.state_dict); the
    # override below reads checkpoints written before that
    def load_state_dict(self, state):
        if STATE_FORMAT in state:
            return super().load_state_dict(state)
        state = dict(state)
        gen = {k[len("generator.") :]: state.pop(k) for k in list(state) if k.startswith("generator.")}
        adam = {k: state.pop(k) for k in list(state) if k.startswith("generator_adam.")}
        rounds = state.pop("generator_rounds", None)
        super().load_state_dict(state)
        if rounds is None or set(gen) != set(self.generator.state_dict()):
            raise ValueError("state: the checkpoint has no FedGen generator of this model's shape")
        self.generator.load_state_dict({k: v.to(self.engine.device) for k, v in gen.items()})
        self.gen_rounds = int(rounds)
        for i, p in enumerate(self.generator.parameters()):
            if f"generator_adam.{i}.step" in adam:
                self.gen_opt.state[p] = {
                    k: adam[f"generator_adam.{i}.{k}"].to(self.engine.device if k != "step" else "cpu")
                    for k in ("exp_avg", "exp_avg_sq", "step")
                }
