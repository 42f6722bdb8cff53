"""Batched-client simulation engine (first slice): every sampled client trains at once on one device.

One round (``Simulation.round``), following ../shared/spec/architecture.md:

1. sample ``clients_per_round`` clients (seeded by ``(seed, round)``) and sort them by local step count, so
   the clients still training at any step are a prefix of the stack;
2. broadcast the global model into the first rows of a :class:`~fedfast.flat.ClientStack`;
3. teacher logits of the global model for the union of the sampled clients' data, once per round, in large
   batches (KD-family losses; no augmentation in this slice, so caching is exact);
4. for each local step: gather every active client's minibatch (``[n_active, B]`` index table, the last
   partial batch padded and masked with ``ignore_index``), one ``vmap`` forward/backward over the stacked
   parameters, the fused loss with per-client segments (each client's gradient is that of its own minibatch
   mean), the fused client step on the active prefix;
5. fused aggregation (size-weighted FedAvg) into the new global model; test accuracy.

Methods in this slice: ``fedavg``, ``fedprox`` (``mu``), ``kd`` (Hinton KD to the global model),
``fedntd`` (``beta``, ``tau``), ``fedgkd`` with M=1 (``gamma``), ``fedavgm`` (``server_lr``,
``server_momentum``), ``scaffold`` (FedNTD code: K_eff counts local momentum), ``feddyn`` (ASD/Acar cloud form,
``dyn_alpha``; evaluates the participants' average), and the ASD add-on (``asd=True``, ``lam``; with fedavg,
fedprox or fedntd; set ``tau=2.0`` for ASD's paper setting), ``fedgkd`` with a buffer of M > 1 global models
(``gkd_buffer``), ``fedcad`` (``cad_beta``, ``cad_gamma``; 32 auxiliary samples per class drawn once from the
training set; set ``tau=2.0`` for the paper). Not wired yet: VOTE, ADC, FedADC, MOON.
Models must not use BatchNorm batch statistics (padding rows would enter them).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from . import nn as fnn
from . import ops
from .data.datasets import ArrayDataset
from .data.partition import Partition
from .flat import ClientStack

_LOSSES = {
    # algorithm: (kind, uses a teacher)
    "fedavg": ("full", False), "fedprox": ("full", False), "kd": ("full", True), "fedntd": ("not_true", True),
    "fedgkd": ("full", True), "fedcad": ("full", True), "fedavgm": ("full", False), "scaffold": ("full", False), "feddyn": ("full", False),
}


@dataclass
class SimConfig:
    algorithm: str = "fedavg"
    clients_per_round: int = 10
    rounds: int = 1
    local_epochs: int = 1
    batch_size: int = 50
    lr: float = 0.01
    lr_decay: float = 1.0
    momentum: float = 0.9
    weight_decay: float = 1e-5
    seed: int = 0
    tau: float = 1.0
    beta: float = 1.0          # FedNTD
    kd_weight: float = 1.0     # plain KD
    gamma: float = 0.2         # FedGKD: coefficient gamma/2 on the KL
    mu: float = 0.0            # FedProx
    server_lr: float = 1.0     # FedAvgM: theta <- theta - server_lr * v
    server_momentum: float = 0.9  # FedAvgM: v <- server_momentum * v + (theta - avg)
    dyn_alpha: float = 0.01    # FedDyn alpha (per client alpha_k = dyn_alpha / (n_k / mean n))
    gkd_buffer: int = 1        # FedGKD: M, the teacher is the parameter average of the last M global models
    cad_beta: float = 0.3      # FedCAD: alpha_y = beta + (gamma - beta) * mean_{aux, y} p_y(global)
    cad_gamma: float = 0.7
    cad_aux_per_class: int = 32
    cad_tau_squared: bool = False  # FedCAD: no tau^2 by default (spec C2)
    asd: bool = False          # ASD add-on (Yashwanth et al.): + lam * sum_i alpha_i KL_i, on any algorithm
    lam: float = 10.0          # ASD lambda (official-code scaling: CE_mean + lam * sum_i alpha_i KL_i)
    asd_not_true: bool | None = None  # ASD's KL over the not-true classes; default: True for fedntd
    asd_entropy_tau: float | None = None
    tau_squared: bool = True
    eval_batch: int | None = None  # teacher-cache / evaluation batch; None: 256 on CPU, 4096 on GPU
    backend: str | None = None

    def __post_init__(self):
        if self.algorithm not in _LOSSES:
            raise ValueError(f"algorithm: one of {sorted(_LOSSES)} in this engine slice, got {self.algorithm!r}")
        if self.asd and self.algorithm not in ("fedavg", "fedprox", "fedntd"):
            raise ValueError(f"asd: the ASD add-on composes with fedavg, fedprox and fedntd, not {self.algorithm!r}")
        for k in ("clients_per_round", "rounds", "local_epochs", "batch_size"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"{k}: must be >= 1, got {getattr(self, k)}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")


def client_order(seed: int, rnd: int, client: int, epoch: int, n: int) -> np.ndarray:
    """The seeded shuffle of a client's local indices for one epoch (shared with reference loops)."""
    return np.random.default_rng([seed, rnd, client, epoch]).permutation(n)


def sample_clients(seed: int, rnd: int, K: int, m: int) -> np.ndarray:
    return np.sort(np.random.default_rng([seed, rnd, 10**6]).choice(K, size=m, replace=False))


class Simulation:
    """``Simulation(config, model, train, test, partition).run()`` -> per-round metrics; ``round()`` steps."""

    def __init__(self, config: SimConfig, model: nn.Module, train: ArrayDataset, test: ArrayDataset,
                 partition: Partition, device=None):
        self.cfg = config
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device)
        self.train = train.to(self.device)
        self.test = test.to(self.device)
        self.partition = partition
        self.K = partition.num_clients
        if config.clients_per_round > self.K:
            raise ValueError(f"clients_per_round: {config.clients_per_round} > {self.K} clients")
        self.client_idx = [i.to(self.device) for i in partition.indices]
        self.eval_batch = config.eval_batch or (256 if self.device.type == "cpu" else 4096)
        self._hist = partition.histogram.float().to(self.device)  # [K, C] client label histograms
        self.stack = ClientStack(self.model, config.clients_per_round, device=self.device)
        self.global_flat = self.stack.layout.flatten_params(self.model).to(self.device)
        self.buf = torch.zeros_like(self.stack.params)
        P = self.stack.P
        self.server_m = torch.zeros(P, device=self.device) if config.algorithm == "fedavgm" else None
        if config.algorithm in ("scaffold", "feddyn"):
            from .flat import ClientState
            self.client_state = ClientState(self.K, P, device=self.device)  # SCAFFOLD c_k / FedDyn h_k
            self.server_state = torch.zeros(P, device=self.device)          # SCAFFOLD c / FedDyn mean h
        self.average_flat = self.global_flat  # the evaluated model (FedDyn: average; global is the cloud model)
        self.teacher_flat = self.global_flat  # FedGKD: average of the buffered globals (w_0 is never buffered)
        if config.algorithm == "fedgkd" and config.gkd_buffer > 1:
            self.gkd_buffer = torch.zeros(config.gkd_buffer, P, device=self.device)
            self.gkd_count = 0
        if config.algorithm == "fedcad":  # server-held auxiliary data: cad_aux_per_class per class, drawn once
            g = torch.Generator().manual_seed(config.seed + 7919)
            y = self.train.y.cpu()
            picks = [torch.nonzero(y == cl).flatten() for cl in range(self.train.num_classes)]
            self.cad_aux = torch.cat([p[torch.randperm(len(p), generator=g)[:config.cad_aux_per_class]]
                                      for p in picks]).to(self.device)
        self.rnd = 0
        self.history: list[dict] = []

    # ------------------------------------------------------------------------------------------------
    def _loss(self, z, t, y, seg, n_act):
        c = self.cfg
        if c.algorithm == "fedcad":  # per row (1 - a_y) CE + a_y soft-CE at temperature tau (He et al., Eq. 5)
            return ops.distill(z, t, y, kind="full", tau=c.tau, soft_ce=True, class_alpha=self._class_alpha,
                               kd_weight=c.tau ** 2 if c.cad_tau_squared else 1.0, segments=seg,
                               num_segments=n_act, reduction="mean", backend=c.backend)
        if c.asd:  # ASD replaces the method's KD term: CE_mean + lam * sum_i alpha_i KL_i (FedNTD+ASD: not-true KL)
            nt = c.asd_not_true if c.asd_not_true is not None else c.algorithm == "fedntd"
            loss = fnn.ASDLoss(tau=c.tau, lam=c.lam, not_true=nt, entropy_tau=c.asd_entropy_tau, backend=c.backend)
            return loss(z, t, y, self._prior[:n_act], segments=seg, num_segments=n_act)
        kind, _ = _LOSSES[c.algorithm]
        s = c.tau ** 2 if c.tau_squared else 1.0
        kd = {"kd": c.kd_weight * s, "fedntd": c.beta * s, "fedgkd": c.gamma / 2 * s}.get(c.algorithm, 0.0)
        return ops.distill(z, t, y, kind=kind, tau=c.tau, kd_weight=kd, segments=seg, num_segments=n_act,
                           reduction="mean", backend=c.backend)

    @torch.no_grad()
    def _teacher_cache(self, sampled_rows: list[torch.Tensor]) -> torch.Tensor:
        """Global-model logits for the union of the sampled clients' samples (one pass, large batches)."""
        idx = torch.cat(sampled_rows)
        cache = torch.zeros(len(self.train), self.train.num_classes, device=self.device)
        self._load_global(self.teacher_flat)
        self.model.eval()
        for chunk in idx.split(self.eval_batch):
            x, _ = self.train.batch(chunk)
            cache[chunk] = self.model(x).float()
        return cache

    @torch.no_grad()
    def _cad_alpha(self) -> torch.Tensor:
        """FedCAD Eq. 6 (simplified, spec 3.2): alpha_y = beta + (gamma - beta) * mean_{x in aux_y} softmax(global(x))_y."""
        self._load_global()
        self.model.eval()
        x, y = self.train.batch(self.cad_aux)
        p = torch.softmax(self.model(x).float(), 1).gather(1, y[:, None]).squeeze(1)
        C = self.train.num_classes
        mean_py = torch.zeros(C, device=self.device).index_add_(0, y, p) / torch.bincount(y, minlength=C).clamp_min(1)
        self.model.train()
        return self.cfg.cad_beta + (self.cfg.cad_gamma - self.cfg.cad_beta) * mean_py

    def _load_global(self, flat=None):
        with torch.no_grad():
            src = self.global_flat if flat is None else flat
            for p, v in zip(self.model.parameters(), self.stack.layout.param_views(src).values()):
                p.copy_(v)

    def round(self) -> dict:
        c, t0 = self.cfg, time.perf_counter()
        timers = {}
        m, B = c.clients_per_round, c.batch_size
        sampled = sample_clients(c.seed, self.rnd, self.K, m)
        sizes = np.array([len(self.client_idx[k]) for k in sampled])
        steps = np.ceil(sizes / B).astype(int)
        order = np.argsort(-steps, kind="stable")  # most steps first: active clients are a prefix
        sampled, sizes, steps = sampled[order], sizes[order], steps[order]
        lr = c.lr * c.lr_decay ** self.rnd
        self.stack.broadcast_(self.global_flat, rows=slice(0, m))
        self.buf.zero_()
        teacher = None
        if c.asd:  # each sampled client's label distribution, in stack order: ASD's per-segment prior
            hist = self._hist[torch.from_numpy(sampled).to(self.device)]
            self._prior = hist / hist.sum(1, keepdim=True)
        if c.algorithm == "fedcad":
            self._class_alpha = self._cad_alpha()
        if _LOSSES[c.algorithm][1] or c.asd:
            t1 = time.perf_counter()
            teacher = self._teacher_cache([self.client_idx[k] for k in sampled])
            timers["teacher"] = time.perf_counter() - t1
        step_kw = dict(lr=lr, momentum=c.momentum, weight_decay=c.weight_decay, prox_mu=c.mu,
                       anchor=self.global_flat if c.mu else None, backend=c.backend)
        sampled_t = torch.from_numpy(sampled).to(self.device)
        if c.algorithm == "scaffold":
            state_rows = self.client_state.gather(sampled_t)  # c_k of the sampled clients, stack order
        elif c.algorithm == "feddyn":
            state_rows = self.client_state.gather(sampled_t)  # h_k
            mean_n = float(self._hist.sum(1).mean())
            alpha_k = c.dyn_alpha / (torch.tensor(sizes, dtype=torch.float32, device=self.device) / mean_n)
            dyn_lin = alpha_k[:, None] * (state_rows - self.global_flat)  # gradient of alpha_k <w, h_k - w_cld>
        t1 = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        client_steps = 0
        S = int(steps.max())
        for e in range(c.local_epochs):
            table = torch.full((m, S * B), -1, dtype=torch.long)
            for j, k in enumerate(sampled):  # index math only (host, once per epoch), no per-step client loop
                ids = self.partition.indices[k][torch.from_numpy(client_order(c.seed, self.rnd, int(k), e, sizes[j]))]
                table[j, : sizes[j]] = ids
            table = table.to(self.device)
            for s in range(S):
                n_act = int((steps > s).sum())
                rows = table[:n_act, s * B:(s + 1) * B]
                valid = rows >= 0
                x, y = self.train.batch(rows.clamp_min(0))
                y = torch.where(valid, y, torch.full_like(y, -100))
                theta = self.stack.params[:n_act].detach().requires_grad_(True)
                z = self.stack.vmap_forward(x, rows=slice(0, n_act), params=self.stack.layout.param_views(theta))
                C = z.shape[-1]
                zf = z.reshape(-1, C)
                t = teacher[rows.clamp_min(0).reshape(-1)] if teacher is not None else torch.zeros_like(zf.detach())
                seg = torch.arange(n_act, device=self.device).repeat_interleave(B)
                loss = self._loss(zf, t, y.reshape(-1), seg, n_act)
                loss.backward()
                kw = dict(step_kw)
                if c.algorithm == "scaffold":
                    kw.update(scaffold_c=self.server_state, scaffold_ck=state_rows[:n_act])
                elif c.algorithm == "feddyn":
                    kw.update(dyn_linear=dyn_lin[:n_act], weight_decay=alpha_k[:n_act] + c.weight_decay)
                ops.client_step(self.stack.params[:n_act], theta.grad, momentum_buf=self.buf[:n_act], **kw)
                loss_sum += loss.detach()  # sum of the active clients' minibatch means (no host sync)
                client_steps += n_act
        timers["local"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        agg = dict(weights=torch.tensor(sizes, dtype=torch.float32, device=self.device), rows=m, backend=c.backend)
        if c.algorithm == "fedavgm":
            agg.update(beta=c.server_momentum, lr=c.server_lr, momentum=self.server_m)
        elif c.algorithm == "scaffold":  # FedNTD code: K_eff counts momentum, rho = local momentum
            Kst = torch.tensor(steps * c.local_epochs, dtype=torch.float64)
            rho = c.momentum
            k_eff = (Kst - rho * (1 - rho ** Kst) / (1 - rho)) / (1 - rho) if rho > 0 else Kst
            agg.update(scaffold_c=self.server_state, scaffold_ck=state_rows,
                       scaffold_coef=(1.0 / (k_eff * lr)).float().to(self.device), scaffold_num_clients=self.K)
        elif c.algorithm == "feddyn":
            agg.update(weights=None, dyn_h=state_rows, dyn_hbar=self.server_state, dyn_num_clients=self.K)
        elif c.algorithm == "fedgkd" and c.gkd_buffer > 1:  # push the new global; teacher = mean of the buffer
            self.gkd_count = min(self.gkd_count + 1, c.gkd_buffer)
            agg.update(teacher_buffer=self.gkd_buffer, teacher_slot=self.rnd % c.gkd_buffer,
                       teacher_count=self.gkd_count)
        out = ops.aggregate(self.stack.params, self.global_flat, **agg)
        self.global_flat = out["global"]
        self.average_flat = out["average"] if c.algorithm == "feddyn" else out["global"]
        self.teacher_flat = self.global_flat
        if "teacher_buffer" in out:
            self.gkd_buffer, self.teacher_flat = out["teacher_buffer"], out["teacher"]
        if c.algorithm == "fedavgm":
            self.server_m = out["momentum"]
        elif c.algorithm == "scaffold":
            self.server_state = out["scaffold_c"]
            self.client_state.scatter_(sampled_t, out["scaffold_ck"])
        elif c.algorithm == "feddyn":
            self.server_state = out["dyn_hbar"]
            self.client_state.scatter_(sampled_t, out["dyn_h"])
        timers["aggregate"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        acc, test_loss = self.evaluate()
        timers["eval"] = time.perf_counter() - t1
        self.rnd += 1
        rec = {"round": self.rnd, "test_accuracy": acc, "test_loss": test_loss,
               "train_loss": float(loss_sum) / max(client_steps, 1), "seconds": time.perf_counter() - t0,
               "clients": sampled.tolist(), "timers": timers}
        self.history.append(rec)
        return rec

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        self._load_global(self.average_flat)  # FedDyn evaluates the average of the participants, not the cloud
        self.model.eval()
        correct, total, loss = 0, 0, 0.0
        for chunk in torch.arange(len(self.test), device=self.device).split(self.eval_batch):
            x, y = self.test.batch(chunk)
            z = self.model(x)
            loss += float(nn.functional.cross_entropy(z.float(), y, reduction="sum"))
            correct += int((z.argmax(1) == y).sum())
            total += len(chunk)
        self.model.train()
        return correct / total, loss / total

    def run(self) -> list[dict]:
        for _ in range(self.cfg.rounds - self.rnd):
            self.round()
        return self.history
