"""Batched-client simulation engine: every sampled client trains at once on one device.

One round (``Simulation.round``), following ../shared/spec/architecture.md:

1. sample ``clients_per_round`` clients (seeded by ``(seed, round)``) and sort them by local step count, so
   the clients still training at any step are a prefix of the stack; split them into chunks that fit the
   memory budget (usually one chunk);
2. build the teacher once: logits of the global model (FedGKD: the average of the last M globals; VOTE: the
   weighted mixture of M buffered globals) for the union of the sampled clients' data, in large batches
   (``teacher="cache"``); with augmentation the teacher runs on every step's augmented rows instead
   (``teacher="online"``, one batched forward for all clients);
3. per chunk: broadcast the global model into the stack rows; for each local step gather every active
   client's minibatch (``[n_active, B]`` index table, the last partial batch padded and masked with
   ``ignore_index``), one batched forward/backward over the stacked parameters (``fedfast.batched`` for
   Sequential models, else ``vmap``), the fused loss with per-client segments (each client's gradient is that
   of its own minibatch mean), the fused client step; then the chunk's rows go through the fused server
   update (per-client state; the weighted average);
4. the server rule on the chunks' average; test accuracy, per-class accuracy and FedNTD's forgetting measure.

The method-specific parts (loss, client-step terms, server rule, state) live in :mod:`fedfast.algorithms`
(one class per method; the engine calls its hooks and never branches on the method's name).
Methods (``algorithm``): fedavg, fedprox (``mu``), kd, fedntd (``beta``), fedgkd (``gamma``, buffer
``gkd_buffer``), fedgkd_vote (``vote_lambda``, ``vote_beta``; needs the server-held ``val`` split), fedcad
(``cad_beta``, ``cad_gamma``), fedavgm (``server_lr``, ``server_momentum``), scaffold, feddyn (``dyn_alpha``),
fedadc and fedadc_plus (``adc_beta``, ``adc_order`` nesterov|heavy_ball, ``adc_lam``), moon (``moon_mu``,
``moon_tau``), and the ASD add-on (``asd=True``, ``lam``) on fedavg, fedprox, fedntd, scaffold and feddyn.
Per-method defaults (``tau``, ``momentum``, buffer size, aggregation weights, ``mu``, ``max_grad_norm``) are
the papers' (spec), filled in where the option is left ``None``. Models that normalise with batch statistics
get a warning when padded partial batches would enter them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .algorithms import METHODS, Round
from .data.datasets import ArrayDataset
from .data.partition import Partition
from .flat import ClientStack, ClientState, functional_forward, host_to_device

ASD_BASES = ("fedavg", "fedprox", "fedntd", "scaffold", "feddyn")
# the papers' defaults where a method differs from the common ones (spec: FedCAD/ASD tau = 2, FedADC+ tau = 4
# (CS-KD), FedADC without local momentum, VOTE buffer 5, FedADC/FedDyn uniform averaging)
_TAU = {"fedcad": 2.0, "fedadc_plus": 4.0}
_MOMENTUM = {"fedadc": 0.0, "fedadc_plus": 0.0}
_UNIFORM = ("fedadc", "fedadc_plus", "feddyn")


@dataclass
class SimConfig:
    algorithm: str = "fedavg"
    clients_per_round: int = 10
    rounds: int = 1
    local_epochs: int = 1
    batch_size: int = 50
    lr: float = 0.01
    lr_decay: float = 1.0
    momentum: float | None = None  # None: 0.9, FedADC 0
    weight_decay: float = 1e-5
    seed: int = 0
    tau: float | None = None   # None: 1.0; FedCAD and ASD 2.0; FedADC+ 4.0
    beta: float = 1.0          # FedNTD
    kd_weight: float = 1.0     # plain KD
    gamma: float = 0.2         # FedGKD: coefficient gamma/2 on the KL
    mu: float | None = None    # FedProx proximal coefficient; None: 0.1 for fedprox (FedNTD Table 5), else 0
    max_grad_norm: float | None = None  # per-client gradient clipping; None: 10 for fedntd and ASD (their code), else off
    server_lr: float = 1.0     # FedAvgM: theta <- theta - server_lr * v
    server_momentum: float = 0.9  # FedAvgM: v <- server_momentum * v + (theta - avg)
    dyn_alpha: float = 0.01    # FedDyn alpha (per client alpha_k = dyn_alpha / (n_k / mean n))
    gkd_buffer: int | None = None  # FedGKD: M (parameter average of the last M globals); VOTE: M teachers (5)
    vote_lambda: float = 0.1   # VOTE: sum of the teacher weights g_m (= gamma/2)
    vote_beta: float | None = None  # VOTE: g = lambda * softmax(-val_loss / vote_beta); None: 1/M
    cad_beta: float = 0.3      # FedCAD: alpha_y = beta + (gamma - beta) * mean_{aux, y} p_y(global)
    cad_gamma: float = 0.7
    cad_aux_per_class: int = 32
    cad_tau_squared: bool = False  # FedCAD: no tau^2 by default (spec C2)
    cad_alpha_tau: float = 1.0  # FedCAD: temperature of p^g in the alpha estimate (spec C3: 1 by default)
    adc_beta: float = 0.9      # FedADC beta_local (and beta_global unless adc_beta_global is set)
    adc_beta_global: float | None = None
    adc_alpha: float = 1.0     # FedADC server step theta -= alpha * eta * m
    adc_order: str = "nesterov"  # "nesterov" (red, Alg. 3 lines 7-9) or "heavy_ball" (blue, lines 10-11)
    adc_lam: float = 0.35      # FedADC+ lambda
    adc_teacher: str = "global"  # FedADC+ ptilde: "global" model (spec B1) or the student's own "local" prediction
    moon_mu: float = 1.0
    moon_tau: float = 0.5
    asd: bool = False          # ASD add-on (Yashwanth et al.): + lam * sum_i alpha_i KL_i
    lam: float = 10.0          # ASD lambda (official-code scaling: CE_mean + lam * sum_i alpha_i KL_i)
    asd_not_true: bool | None = None  # ASD's KL over the not-true classes; default: True for fedntd
    asd_entropy_tau: float | None = None
    tau_squared: bool = True
    aggregate_weights: str | None = None  # "size" or "uniform"; None: uniform for FedADC/FedDyn, size otherwise
    augment: str = "none"      # a pipeline of fedfast.data.augment.PIPELINES, applied to every local batch
    teacher: str | None = None  # "cache" (once per round) or "online" (per step); None: online iff augment
    teacher_cache_dtype: str = "float32"  # or "bfloat16"
    client_chunk: int | None = None  # clients trained together; None: fits memory_budget_gb (CPU: <= 128 MiB params)
    memory_budget_gb: float | None = None  # None: 80% of free device memory (CPU: of MemAvailable)
    eval_batch: int | None = None  # teacher-cache / evaluation batch; None: 1024 on CPU, 4096 on GPU
    state_dtype: str = "float32"  # per-client state (SCAFFOLD c_k, FedDyn h_k, MOON models): or "bfloat16"
    state_on_host: bool = False  # keep per-client state in pinned host memory (rows copied per round)
    profile: bool = False      # split the local-step time (data, forward, teacher, loss, backward, step); syncs
    tune_cpu_allocator: bool = False  # CPU: keep freed memory for reuse (fedfast.cpu_alloc; process-wide)
    backend: str | None = None

    def __post_init__(self):
        a = self.algorithm
        if a not in METHODS:
            raise ValueError(f"algorithm: one of {sorted(METHODS)}, got {a!r}")
        if self.asd and a not in ASD_BASES:
            raise ValueError(f"asd: the ASD add-on composes with {', '.join(ASD_BASES)}, not {a!r}")
        for k in ("clients_per_round", "rounds", "local_epochs", "batch_size"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"{k}: must be >= 1, got {getattr(self, k)}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.tau is None:
            self.tau = 2.0 if self.asd else _TAU.get(a, 1.0)
        if not self.tau > 0:
            raise ValueError(f"tau: must be > 0, got {self.tau}")
        if self.momentum is None:
            self.momentum = _MOMENTUM.get(a, 0.9)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum: must lie in [0, 1), got {self.momentum}")
        if self.gkd_buffer is None:
            self.gkd_buffer = 5 if a == "fedgkd_vote" else 1
        if int(self.gkd_buffer) < 1:
            raise ValueError(f"gkd_buffer: must be >= 1, got {self.gkd_buffer}")
        if self.vote_beta is None:
            self.vote_beta = 1.0 / self.gkd_buffer
        if not self.vote_beta > 0:
            raise ValueError(f"vote_beta: must be > 0, got {self.vote_beta}")
        if self.mu is None:
            self.mu = 0.1 if a == "fedprox" else 0.0
        if self.mu < 0:
            raise ValueError(f"mu: must be >= 0, got {self.mu}")
        if self.max_grad_norm is None:
            self.max_grad_norm = 10.0 if (a == "fedntd" or self.asd) else 0.0
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm: must be >= 0 (0 = no clipping), got {self.max_grad_norm}")
        if self.adc_beta_global is None:
            self.adc_beta_global = self.adc_beta
        if self.aggregate_weights is None:
            self.aggregate_weights = "uniform" if a in _UNIFORM else "size"
        choices = {"aggregate_weights": ("size", "uniform"), "adc_order": ("nesterov", "heavy_ball"),
                   "adc_teacher": ("global", "local"), "teacher_cache_dtype": ("float32", "bfloat16"),
                   "state_dtype": ("float32", "bfloat16")}
        for k, ok in choices.items():
            if getattr(self, k) not in ok:
                raise ValueError(f"{k}: one of {ok}, got {getattr(self, k)!r}")
        if a == "feddyn" and self.aggregate_weights != "uniform":
            raise ValueError("aggregate_weights: FedDyn averages its participants uniformly")
        from .data.augment import PIPELINES
        if self.augment not in PIPELINES:
            raise ValueError(f"augment: one of {sorted(PIPELINES)}, got {self.augment!r}")
        if self.teacher is None:
            self.teacher = "online" if self.augment != "none" else "cache"
        if self.teacher not in ("cache", "online"):
            raise ValueError(f"teacher: 'cache' or 'online', got {self.teacher!r}")
        if self.teacher == "cache" and self.augment != "none" and self.needs_teacher:
            raise ValueError("teacher: cached teacher logits would ignore the augmentation; use teacher='online'")
        if self.client_chunk is not None and int(self.client_chunk) < 1:
            raise ValueError(f"client_chunk: must be >= 1, got {self.client_chunk}")
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise ValueError(f"memory_budget_gb: must be > 0, got {self.memory_budget_gb}")
        if not self.cad_alpha_tau > 0:
            raise ValueError(f"cad_alpha_tau: must be > 0, got {self.cad_alpha_tau}")
        if not 0.0 <= self.adc_lam <= 1.0:
            raise ValueError(f"adc_lam: must lie in [0, 1], got {self.adc_lam}")

    @property
    def needs_teacher(self) -> bool:
        return METHODS[self.algorithm].teacher_for(self) is not None or self.asd


def client_order(seed: int, rnd: int, client: int, epoch: int, n: int) -> np.ndarray:
    """The seeded shuffle of a client's local indices for one epoch (shared with reference loops)."""
    return np.random.default_rng([seed, rnd, client, epoch]).permutation(n)


def sample_clients(seed: int, rnd: int, K: int, m: int) -> np.ndarray:
    return np.sort(np.random.default_rng([seed, rnd, 10**6]).choice(K, size=m, replace=False))


CPU_CHUNK_PARAM_BYTES = 128 * 2**20  # auto chunking on a CPU: at most this much of the chunk's parameters


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


class Simulation:
    """``Simulation(config, model, train, test, partition).run()`` -> per-round metrics; ``round()`` steps.

    ``val``: the server-held validation split (FedGKD-VOTE weights its teachers by their loss on it).
    ``aux``: FedCAD's server-held auxiliary data (default: ``cad_aux_per_class`` per class of the training set).
    ``loss_fn(student [R, C], teacher [R, C] or None, target [R], segments [R], num_segments) -> scalar``
    replaces the method's client loss (client step, server rule and state stay the method's). It must return
    the sum over the segments (clients) of each client's mean loss over its valid rows; padded rows carry
    ``target == -100`` (``fedfast.ops.distill`` with ``segments=..., reduction="mean"`` does exactly this).
    ``loss_needs_teacher=True`` passes the cached (or online) global-model logits as ``teacher``.
    ``process_group``: a ``torch.distributed`` group (or ``"default"``): each rank trains every world-th of the
    round's clients (same seeds, same data on every rank); sums and updated client state rows are exchanged
    with all_reduce / all_gather, so every rank holds the same global model and state after each round."""

    def __init__(self, config: SimConfig, model: nn.Module, train: ArrayDataset, test: ArrayDataset,
                 partition: Partition, device=None, val: ArrayDataset | None = None, process_group=None,
                 loss_fn=None, loss_needs_teacher: bool = False, aux: ArrayDataset | None = None):
        c = self.cfg = config
        if not isinstance(config, SimConfig):
            raise TypeError(f"config: expected a fedfast.SimConfig, got {type(config).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
        for name, ds in (("train", train), ("test", test), ("val", val), ("aux", aux)):
            if ds is not None and not isinstance(ds, ArrayDataset):
                raise TypeError(f"{name}: expected a fedfast.data.ArrayDataset, got {type(ds).__name__}")
            if ds is not None and ds.num_classes != train.num_classes:
                raise ValueError(f"{name}: has {ds.num_classes} classes, the training set {train.num_classes}")
        if not isinstance(partition, Partition):
            raise TypeError(f"partition: expected a fedfast.data.Partition, got {type(partition).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError("loss_fn: expected a callable (student, teacher, target, segments, num_segments) -> loss")
        self.loss_fn = loss_fn
        self._needs_teacher = bool(loss_needs_teacher) if loss_fn is not None else config.needs_teacher
        if self._needs_teacher and config.teacher == "cache" and config.augment != "none":
            raise ValueError("teacher: cached teacher logits would ignore the augmentation; use teacher='online'")
        self.group, self.rank, self.world = process_group, 0, 1
        if process_group is not None:  # torch.distributed: the sampled clients are split between the ranks
            import torch.distributed as dist
            if not dist.is_initialized():
                raise ValueError("process_group: torch.distributed is not initialised")
            self._dist = dist
            self.group = None if process_group == "default" else process_group
            self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if c.tune_cpu_allocator and self.device.type == "cpu":
            from .cpu_alloc import tune_cpu_allocator
            tune_cpu_allocator()
        self.model = model.to(self.device)
        self.train = train.to(self.device)
        self.test = test.to(self.device)
        self.val = val.to(self.device) if val is not None else None
        self.partition = partition
        self._idx_host = [np.asarray(i.cpu(), dtype=np.int64) for i in partition.indices]  # per-epoch batch tables
        self.K = partition.num_clients
        if len(partition.indices) and int(max(int(i.max()) for i in partition.indices if len(i))) >= len(train):
            raise ValueError("partition: holds sample indices beyond the training set")
        if c.clients_per_round > self.K:
            raise ValueError(f"clients_per_round: {c.clients_per_round} > {self.K} clients")
        self.eval_batch = c.eval_batch or (1024 if self.device.type == "cpu" else 4096)
        self._hist = partition.histogram.float().to(self.device)  # [K, C] client label histograms
        self._probe_model()
        P = sum(p.numel() for p in self.model.parameters())
        per_rank = -(-c.clients_per_round // self.world)
        self.chunk = max(1, min(per_rank, c.client_chunk or self._auto_chunk(P)))
        self.stack = ClientStack(self.model, self.chunk, device=self.device)
        self.global_flat = self.stack.layout.flatten_params(self.model).to(self.device)
        self.buf = torch.zeros_like(self.stack.params) if c.momentum else None
        self.gradbuf = torch.empty_like(self.stack.params)  # flat [n, P] gradients, reused every step
        self.average_flat = self.global_flat  # the evaluated model (FedDyn: average; global is the cloud model)
        self.teacher_flat = self.global_flat  # FedGKD: average of the buffered globals (w_0 is never buffered)
        self.aux = aux.to(self.device) if aux is not None else None
        self.algo = METHODS[c.algorithm](self)  # the method: loss, client-step terms, server rule, state
        self.algo.setup()
        self._aug_gen = torch.Generator(device=self.device).manual_seed(c.seed + 104729)
        self._batch_stats = any(isinstance(mod, nn.modules.batchnorm._NormBase) and not isinstance(mod, nn.GroupNorm)
                                for mod in self.model.modules())
        sizes_all = np.array([len(i) for i in partition.indices])
        if self._batch_stats and (sizes_all % c.batch_size).any():
            import warnings
            warnings.warn("model: it normalises with batch statistics (BatchNorm/InstanceNorm) and some clients' last "
                          "minibatch is partial; the engine pads those batches to batch_size, so the padding rows "
                          "enter that batch's statistics (a per-client loop would not). Use GroupNorm, or client "
                          "sizes divisible by batch_size, for results equal to the sequential loop.", stacklevel=2)
        self._fwd = functional_forward(self.model)
        self.rnd = 0
        self.history: list[dict] = []
        self._class_acc: list[torch.Tensor] = []

    @torch.no_grad()
    def _probe_model(self):
        """One training sample through the model: it must run on the images and output num_classes logits."""
        x, _ = self.train.batch(torch.arange(min(2, len(self.train)), device=self.device))  # 2: BatchNorm1d
        try:
            out = self.model(x)
        except RuntimeError as e:
            raise ValueError(f"model: cannot run on the training images (shape {tuple(x.shape[1:])}): {e}") from None
        C = self.train.num_classes
        if not (torch.is_tensor(out) and out.dim() == 2 and out.shape[1] == C):
            shape = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
            raise ValueError(f"model: must return logits [batch, {C}] for the {C} classes, got {shape}")

    def _client_state(self, P: int) -> ClientState:
        c = self.cfg
        return ClientState(self.K, P, device=self.device, pin_memory=c.state_on_host,
                           dtype=torch.bfloat16 if c.state_dtype == "bfloat16" else torch.float32)

    # -- memory ---------------------------------------------------------------------------------------
    def _auto_chunk(self, P: int) -> int:
        """Clients per chunk: parameter-sized rows (4 B per parameter each) plus activations (measured on one
        probe samples, x3 for backward) must fit the budget (default 80 % of free GPU memory, 60 % of the CPU's
        MemAvailable). On a CPU also at most ``CPU_CHUNK_PARAM_BYTES`` of the chunk's parameters: per client-sample
        larger chunks are slower there (2-core VM, FedAvg CNN, 200 clients x 50, batch 10, bench_engine
        ``test_cpu_chunk_size``: chunks of 10-25 clients 965-1021 samples/s, of 100-200 clients 488-644), while
        a GPU needs them."""
        c = self.cfg
        frac = 0.8 if self.device.type == "cuda" else 0.6
        budget = (c.memory_budget_gb * 2**30) if c.memory_budget_gb else frac * _free_bytes(self.device)
        # parameters, the flat gradient buffer, autograd's per-parameter gradients (transient), momentum,
        # per-client state rows and FedDyn's linear term
        rows = 3 + (1 if (c.momentum or 0) else 0) + (2 if METHODS[c.algorithm].state_rows else 0)
        acts = []
        hooks = [m.register_forward_hook(lambda _m, _i, o: acts.append(o.numel() if torch.is_tensor(o) else 0))
                 for m in self.model.modules() if not list(m.children())]
        try:
            with torch.no_grad():
                self.model(self.train.batch(torch.arange(2, device=self.device) % len(self.train))[0])
        finally:
            for h in hooks:
                h.remove()
        per_client = 4 * P * rows + 3 * 4 * sum(acts) // 2 * c.batch_size  # acts: of the 2 probe samples
        n = max(1, int(budget // max(per_client, 1)))
        if self.device.type == "cpu":
            n = min(n, max(1, CPU_CHUNK_PARAM_BYTES // (4 * P)))
        return n

    # -- teacher ------------------------------------------------------------------------------------
    def _flat_forward(self, flat: torch.Tensor, x: torch.Tensor, features: nn.Module | None = None):
        """One model (flat parameters [P]) on a batch: the stack's executor with one client, else functional_call.
        With ``features``: ``(input of features, logits)``."""
        if self.stack.plan is not None:
            from .batched import batched_forward
            pv = {k: v[None] for k, v in self.stack.layout.param_views(flat).items()}
            out = batched_forward(self.stack.plan, pv, x[None], self.model.training, features)
            return (out[0][0], out[1][0]) if features is not None else out[0]
        fwd = self._fwd if features is None else functional_forward(self.model, features)
        return fwd(self.stack.layout.param_views(flat), self.stack.layout.buffer_views(self.stack.buffers[0]), x)

    @torch.no_grad()
    def _logits(self, flat: torch.Tensor, idx: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """Logits of the model ``flat`` for training rows ``idx`` in large batches."""
        out = torch.empty(len(idx), self.train.num_classes, device=self.device, dtype=dtype)
        self.model.eval()
        for s in range(0, len(idx), self.eval_batch):
            x, _ = self.train.batch(idx[s:s + self.eval_batch])
            out[s:s + self.eval_batch] = self._flat_forward(flat, x).to(dtype)
        self.model.train()
        return out

    def _vote_weights(self) -> torch.Tensor:
        """VOTE: softmax(-val_loss / vote_beta) over the buffered globals (the KD weight is vote_lambda)."""
        return torch.softmax(-self.val_loss[:self.gkd_count] / self.cfg.vote_beta, 0)

    def _build_teacher(self, idx: torch.Tensor):
        """Once per round: the teacher table for training rows ``idx`` (cache mode): logits [N, C] or, for
        VOTE, the mixture ``(P [N, C], negent [N])`` (weights normalised; ``vote_lambda`` is the KD weight)."""
        c = self.cfg
        N, C = len(self.train), self.train.num_classes
        if self.algo.teacher == "vote":
            if self.gkd_count == 0:
                return None  # round 1: no buffered global yet, no KD (spec II.5)
            T = torch.stack([self._logits(self.gkd_buffer[i], idx) for i in range(self.gkd_count)])
            w = self._vote_weights()
            Pm, neg = ops.teacher_mixture(T, w, self.train.y[idx], tau=c.tau, backend=c.backend)
            P_all = torch.zeros(N, C, device=self.device)
            neg_all = torch.zeros(N, device=self.device)
            P_all[idx], neg_all[idx] = Pm.float(), neg.float()
            return P_all, neg_all
        dt = torch.bfloat16 if c.teacher_cache_dtype == "bfloat16" else torch.float32
        cache = torch.zeros(N, C, device=self.device, dtype=dt)
        cache[idx] = self._logits(self.teacher_flat, idx, dt)
        return cache

    @torch.no_grad()
    def _online_teacher(self, x: torch.Tensor):
        """Per step (augmented rows): one batched teacher forward over all active clients' rows."""
        self.model.eval()
        try:
            if self.algo.teacher == "vote":
                if self.gkd_count == 0:
                    return None
                T = torch.stack([self._flat_forward(self.gkd_buffer[i], x).float() for i in range(self.gkd_count)])
                return T
            return self._flat_forward(self.teacher_flat, x).float()
        finally:
            self.model.train()

    @torch.no_grad()
    def _cad_alpha(self) -> torch.Tensor:
        """FedCAD Eq. 6 (simplified, spec 3.2): alpha_y = beta + (gamma - beta) * mean_{x in aux_y} softmax(global(x))_y."""
        self.model.eval()
        x, y = self.cad_aux_ds.batch(self.cad_aux)
        z = self._flat_forward(self.global_flat, x).float() / self.cfg.cad_alpha_tau
        p = torch.softmax(z, 1).gather(1, y[:, None]).squeeze(1)
        self.model.train()
        C = self.train.num_classes
        mean_py = torch.zeros(C, device=self.device).index_add_(0, y, p) / torch.bincount(y, minlength=C).clamp_min(1)
        return self.cfg.cad_beta + (self.cfg.cad_gamma - self.cfg.cad_beta) * mean_py

    # -- loss ---------------------------------------------------------------------------------------
    def _loss(self, z, t, y, seg, n_act, hist):
        """The client loss over all active clients' rows (sum of per-client minibatch means)."""
        if self.loss_fn is not None:
            return self.loss_fn(z, t, y, seg, n_act)
        return self.algo.loss(z, t, y, seg, n_act, hist)

    # -- one round ------------------------------------------------------------------------------------
    def round(self) -> dict:
        c, t0 = self.cfg, time.perf_counter()
        timers = {}
        m, B = c.clients_per_round, c.batch_size
        sampled = sample_clients(c.seed, self.rnd, self.K, m)
        sizes = np.array([len(self.partition.indices[k]) for k in sampled])
        steps = np.ceil(sizes / B).astype(int)
        order = np.argsort(-steps, kind="stable")  # most steps first: active clients are a prefix
        sampled, sizes, steps = sampled[order], sizes[order], steps[order]
        total_w = float(sizes.sum()) if c.aggregate_weights == "size" else float(m)
        total_steps = int(steps.sum()) * c.local_epochs
        if self.world > 1:  # this rank's clients: every world-th of the sorted list (balanced, still sorted)
            sampled, sizes, steps = sampled[self.rank::self.world], sizes[self.rank::self.world], \
                steps[self.rank::self.world]
            m = len(sampled)
        lr = c.lr * c.lr_decay ** self.rnd
        sampled_t = torch.from_numpy(sampled).to(self.device)
        hist = self._hist[sampled_t]  # [m, C] label histograms in stack order (ASD prior, FedADC+ confidence)
        ctx = Round(sampled, sizes, steps, lr, sampled_t, hist)
        t1 = time.perf_counter()
        teacher = None
        self.algo.round_start(ctx)
        if self._needs_teacher and c.teacher == "cache" and m:
            idx = host_to_device(np.concatenate([self._idx_host[k] for k in sampled]), self.device)
            teacher = self._build_teacher(idx)
        self._sync()
        timers["teacher"] = time.perf_counter() - t1
        if self.algo.state_rows:
            ctx.rows = self.client_state.gather(sampled_t)  # c_k / h_k / previous local models
            ctx.new_rows = torch.empty(m, self.stack.P, device=self.device)
        weights = torch.tensor(sizes if c.aggregate_weights == "size" else np.ones(m), dtype=torch.float32,
                               device=self.device)
        self._sync()
        t_local = t_agg = 0.0
        avg_sum = torch.zeros_like(self.global_flat)
        ctx.incr = torch.zeros_like(self.global_flat)  # SCAFFOLD sum of (c_k' - c_k)/K; FedDyn sum of (X_k - g)/K
        loss_sum = torch.zeros((), device=self.device)
        self._prof = {}
        for lo in range(0, m, self.chunk):  # usually a single chunk (an empty rank: none)
            hi = min(m, lo + self.chunk)
            t1 = self._last = time.perf_counter()
            self._train_chunk(ctx, lo, hi, teacher, loss_sum)
            self._sync()
            t_local += time.perf_counter() - t1
            t1 = time.perf_counter()
            n = hi - lo
            agg = dict(weights=weights[lo:hi], rows=n, backend=c.backend, **self.algo.chunk_aggregate(ctx, lo, hi))
            out = ops.aggregate(self.stack.params, self.global_flat, **agg)
            avg_sum += weights[lo:hi].sum() * out["average"]
            self.algo.collect(ctx, out, lo, hi)
            t_agg += time.perf_counter() - t1
        t1 = time.perf_counter()
        if self.world > 1:  # sums over all ranks' clients; every rank learns every updated client's state row
            for t in (avg_sum, ctx.incr, loss_sum):
                self._dist.all_reduce(t, group=self.group)
            if ctx.new_rows is not None:
                sampled_t, ctx.new_rows = self._all_gather_rows(sampled_t, ctx.new_rows)
        if ctx.new_rows is not None:
            self.client_state.scatter_(sampled_t, ctx.new_rows)
        self.algo.server(ctx, avg_sum / total_w)
        timers["local"], timers["aggregate"] = t_local, t_agg + time.perf_counter() - t1
        timers.update({f"local.{k}": v for k, v in self._prof.items()})
        if self.device.type != "cpu":  # the ops' deferred (no-sync) input checks of this round: one read
            ops.raise_if_invalid(self.device)
        t1 = time.perf_counter()
        acc, test_loss, class_acc = self.evaluate()
        timers["eval"] = time.perf_counter() - t1
        self.rnd += 1
        self._class_acc.append(class_acc)
        client_steps = total_steps
        rec = {"round": self.rnd, "test_accuracy": acc, "test_loss": test_loss,
               "train_loss": float(loss_sum) / max(client_steps, 1), "seconds": time.perf_counter() - t0,
               "best_test_accuracy": max([acc] + [h["test_accuracy"] for h in self.history]),
               "forgetting": self.forgetting(), "class_accuracy": [round(v, 6) for v in class_acc.tolist()],
               "clients": sampled.tolist(), "timers": timers, "client_chunk": self.chunk}
        self.history.append(rec)
        return rec

    def _train_chunk(self, ctx: Round, lo: int, hi: int, teacher, loss_sum):
        """Local training of the round's clients ``lo:hi`` (stack order) in stack rows ``0:hi-lo``."""
        c, algo = self.cfg, self.algo
        sampled, sizes, steps = ctx.sampled, ctx.sizes, ctx.steps
        n, B, S = hi - lo, c.batch_size, int(steps[lo])
        theta_all = self.stack.params
        self.stack.broadcast_(self.global_flat, rows=slice(0, n))
        if self.buf is not None:
            self.buf[:n].zero_()
        step_kw = dict(lr=ctx.lr, momentum=c.momentum, weight_decay=c.weight_decay, prox_mu=c.mu,
                       anchor=self.global_flat if c.mu else None, max_norm=c.max_grad_norm or None,
                       backend=c.backend)
        ctx.chunk = {}
        algo.chunk_start(ctx, lo, hi)
        hist_c = ctx.hist[lo:hi]
        features = self.classifier if algo.needs_features else None
        for e in range(c.local_epochs):
            table = np.full((n, S * B), -1, dtype=np.int64)
            for j in range(n):  # host index math (numpy, once per epoch): each client's own seeded order
                k = sampled[lo + j]
                table[j, : sizes[lo + j]] = self._idx_host[k][client_order(c.seed, self.rnd, int(k), e, sizes[lo + j])]
            table = host_to_device(table, self.device)
            for s in range(S):
                n_act = int((steps[lo:hi] > s).sum())
                rows = table[:n_act, s * B:(s + 1) * B]
                valid = rows >= 0
                ridx = rows.clamp_min(0)
                if c.augment != "none":
                    from .data.augment import augmented_batch
                    x, y = augmented_batch(self.train, ridx, self._aug_gen, pipeline=c.augment)
                else:
                    x, y = self.train.batch(ridx)
                y = torch.where(valid, y, torch.full_like(y, -100))
                self._tick("data")
                pv = self.stack.leaf_views(slice(0, n_act))  # autograd leaves sharing the stack's storage
                out = self.stack.vmap_forward(x, rows=slice(0, n_act), params=pv, features=features)
                feat, z = out if features is not None else (None, out)
                self._tick("forward")
                C = z.shape[-1]
                zf = z.reshape(-1, C)
                flat_idx = ridx.reshape(-1)
                if teacher is None and self._needs_teacher and c.teacher == "online":
                    t = self._online_teacher(x.reshape(-1, *x.shape[2:]))
                elif isinstance(teacher, tuple):
                    t = (teacher[0][flat_idx], teacher[1][flat_idx])
                else:
                    t = teacher[flat_idx].float() if teacher is not None else None
                self._tick("teacher")
                seg = torch.arange(n_act, device=self.device).repeat_interleave(B)
                loss = self._loss(zf, t, y.reshape(-1), seg, n_act, hist_c[:n_act])
                extra = algo.extra_loss(ctx, feat, x, valid, n_act)
                if extra is not None:
                    loss = loss + extra
                self._tick("loss")
                grad = self.stack.flat_grad(loss, pv, self.gradbuf[:n_act])
                self._tick("backward")
                ops.client_step(theta_all[:n_act], grad,
                                momentum_buf=self.buf[:n_act] if self.buf is not None else None,
                                **{**step_kw, **algo.step_terms(ctx, n_act)})
                loss_sum += loss.detach()  # sum of the active clients' minibatch means (no host sync)
                self._tick("step")
        algo.chunk_end(ctx, lo, hi)

    @torch.no_grad()
    def _val_loss(self, flat) -> torch.Tensor:
        self.model.eval()
        tot = torch.zeros((), device=self.device)
        for chunk in torch.arange(len(self.val), device=self.device).split(self.eval_batch):
            x, y = self.val.batch(chunk)
            tot += F.cross_entropy(self._flat_forward(flat, x).float(), y, reduction="sum")
        self.model.train()
        return tot / len(self.val)

    def _all_gather_rows(self, ids: torch.Tensor, rows: torch.Tensor):
        """All ranks' (client id, state row) pairs (blocks padded to equal length for all_gather)."""
        m_max = -(-self.cfg.clients_per_round // self.world)
        pad_ids = torch.full((m_max,), -1, dtype=torch.long, device=self.device)
        pad_ids[:len(ids)] = ids
        pad_rows = torch.zeros(m_max, rows.shape[1], device=self.device)
        pad_rows[:len(ids)] = rows
        all_ids = [torch.empty_like(pad_ids) for _ in range(self.world)]
        all_rows = [torch.empty_like(pad_rows) for _ in range(self.world)]
        self._dist.all_gather(all_ids, pad_ids, group=self.group)
        self._dist.all_gather(all_rows, pad_rows, group=self.group)
        ids, rows = torch.cat(all_ids), torch.cat(all_rows)
        keep = ids >= 0
        return ids[keep], rows[keep]

    def _tick(self, phase: str):
        """``profile=True``: synchronise and charge the time since the last tick to ``phase`` (local steps)."""
        if not self.cfg.profile:
            return
        self._sync()
        now = time.perf_counter()
        self._prof[phase] = self._prof.get(phase, 0.0) + now - self._last
        self._last = now

    def _sync(self):
        """Phase boundaries only (a few per round): makes the per-phase timers true on GPUs."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- evaluation ---------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> tuple[float, float, torch.Tensor]:
        """Test accuracy, mean test loss and per-class accuracy [C] of the evaluated model (FedDyn: the
        participants' average, not the cloud model)."""
        self.model.eval()
        C = self.test.num_classes
        correct = torch.zeros(C, device=self.device)
        count = torch.zeros(C, device=self.device)
        loss = torch.zeros((), device=self.device, dtype=torch.float64)
        for chunk in torch.arange(len(self.test), device=self.device).split(self.eval_batch):
            x, y = self.test.batch(chunk)
            z = self._flat_forward(self.average_flat, x).float()
            loss += F.cross_entropy(z, y, reduction="sum").double()
            correct.index_add_(0, y, (z.argmax(1) == y).float())
            count.index_add_(0, y, torch.ones_like(y, dtype=torch.float32))
        self.model.train()
        n = len(self.test)
        class_acc = (correct / count.clamp_min(1)).cpu()
        return float(correct.sum()) / n, float(loss) / n, class_acc

    def forgetting(self) -> float | None:
        """FedNTD's forgetting (Eq. 5): F = (1/C) sum_c max_{t < T} (A_c^t - A_c^T) over the rounds so far."""
        if len(self._class_acc) < 2:
            return None
        A = torch.stack(self._class_acc)
        return float((A[:-1] - A[-1]).max(0).values.mean())

    def run(self) -> list[dict]:
        for _ in range(self.cfg.rounds - self.rnd):
            self.round()
        return self.history


__all__ = ["SimConfig", "Simulation", "client_order", "sample_clients", "ASD_BASES"]
