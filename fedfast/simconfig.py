"""The engine's settings (:class:`SimConfig`): what a :class:`fedfast.Simulation` runs and how, validated when made,
with the method and its option tables. Kept apart from the engine so that configuration, tools and tests read the
settings without the engine's machinery."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from . import methods as _methods, privacy
from .data.augment import PIPELINES

SAMPLING = ("uniform", "bernoulli", "round_seeded", "poisson", "shuffled")
CONV_IMPLS = ("grouped", "gemm", "triton", "hybrid")


def check_device(dev: str, key: str = "device") -> None:
    """A device this torch can use; ValueError naming ``key`` otherwise (no traceback from deep in torch)."""
    try:
        d = torch.device(dev)
    except (RuntimeError, TypeError):
        raise ValueError(f"{key}: {dev!r} is not a device (cpu, cuda, cuda:N)") from None
    if d.type == "cpu":
        return
    if d.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch is a CPU-only build"
                if torch.version.cuda is None
                else "torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES)"
            )
            raise ValueError(f'{key}: {dev!r}, but {why} (torch {torch.__version__}); use {key} = "cpu"')
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"{key}: {dev!r}, but torch sees {torch.cuda.device_count()} CUDA device(s)")
        return
    if d.type == "mps" and torch.backends.mps.is_available():
        return
    raise ValueError(f"{key}: {dev!r} is not available here (fedfast runs on cpu and cuda)")


SEED_LIMIT = 2**31  # seeds feed numpy's RandomState (< 2**32) after small offsets


@dataclass
class SimConfig:
    """The engine's settings. Plain defaults: SGD without momentum or weight decay, no clipping unless the method
    defines it (``max_grad_norm`` / ``aggregate_weights`` left ``None`` take the method's own defaults, e.g.
    FedGKD's and ASD's clipping at 10 from their authors' code, FedDyn's uniform averaging). ``options``: the
    method's option tables, ``{"fedntd": {"beta": 1.0}}`` (or the running method's own keys, ``{"beta": 1.0}``)."""

    algorithm: str = "fedavg"
    options: dict = field(default_factory=dict)
    clients_per_round: int = 10
    rounds: int = 1
    local_epochs: int = 1
    local_steps: int | None = None  # instead of local_epochs: this many minibatch steps per client and round, through
    #   successive passes over its data (each in the seeded data order, its last partial batch a step of its own)
    drop_last: bool = False  # each pass over a client's data takes full batches only (a DataLoader's drop_last)
    batch_size: int = 50
    lr: float = 0.01
    lr_decay: float = 1.0  # lr of round t (0-based): lr * lr_decay**t
    momentum: float = 0.0  # local SGD momentum (fresh buffers every round)
    weight_decay: float = 0.0  # SGD and Adam: coupled (L2 in the gradient); AdamW: decoupled
    client_optimizer: str = "sgd"  # "sgd", "adam" or "adamw" (torch.optim's; fresh state every round)
    adam_betas: tuple = (0.9, 0.999)  # Adam/AdamW betas (torch.optim defaults)
    adam_eps: float = 1e-8  # Adam/AdamW eps
    max_grad_norm: float | None = None  # per-client gradient clipping (0: off); None: the method's default
    aggregate_weights: str | None = None  # "size" or "uniform"; None: the method's default
    seed: int = 0
    client_sampling: str = "uniform"  # "uniform": exactly clients_per_round of K, seeded by (seed, round);
    #   "bernoulli": each client independently with p = clients_per_round / K (ASD's code; redrawn when empty);
    #   "round_seeded": clients_per_round of K from numpy's RandomState(round), the same for every seed (FedNTD's code);
    #   "poisson": each client independently with q = clients_per_round / K, seeded by (seed, round); a round may
    #   have no client (then the global model stays, or under DP takes the noise alone); "shuffled": each client once
    #   per epoch of K // clients_per_round rounds, a seeded permutation cut into cohorts (DP-FTRL's participation)
    augment: str = "none"  # a pipeline of fedfast.data.augment.PIPELINES, applied to every local batch
    teacher: str | None = None  # "cache" (once per round) or "online" (per step); None: online iff augment
    teacher_cache_dtype: str = "float32"  # or "bfloat16"
    client_chunk: int | None = None  # clients trained together; None: fits memory_budget_gb (CPU: <= 128 MiB params)
    memory_budget_gb: float | None = None  # None: 80% of free device memory (CPU: 60% of MemAvailable)
    eval_batch: int | None = None  # teacher-cache / evaluation batch; None: 1024 on CPU, 4096 on GPU
    eval_every: int = 1  # evaluate every this many rounds, and always after the last (``rounds``)
    state_dtype: str = "float32"  # per-client state (SCAFFOLD c_k, FedDyn h_k, MOON models): or "bfloat16"
    state_on_host: bool = False  # keep per-client state in pinned host memory (rows copied per round)
    state_store: str = "auto"  # per-client state rows: "memory"; "disk" (a memory-mapped file in the run directory);
    # "auto": memory up to state_memory_gb, then the file
    state_memory_gb: float | None = None  # "auto"'s limit; None: a quarter of the store's device memory at set-up
    # "auto": fedfast.batched where the model allows (checked), else vmap; "vmap": always vmap
    executor: str = "auto"
    bn_stats: str = "global"  # BatchNorm running statistics: "global" (averaged like the weights; every client starts
    #   from the global model's), or "local" (each client keeps its own between rounds, as FedBN; the global model's
    #   average is still made, for evaluation)
    bn_params: str = "global"  # BatchNorm's affine weights and biases: "global" (aggregated like every parameter), or
    #   "local" (each client starts from its own, as FedBN: with bn_stats = "local" this is FedBN in full; the global
    #   model's are the server rule's result, e.g. FedAvg's participants' average, for its evaluation)
    features_layer: str | None = None  # the model's classifier by name ("fc2"; a module holding it: its last Linear
    #   to run): Step.features is its input. None: the model's features_layer attribute, else the last nn.Linear to
    #   run in a forward, refused when ambiguous (fedfast.flat.find_classifier)
    conv: str = "auto"  # per-client convolutions (fedfast.ops.client_conv): "grouped" (one grouped conv2d),
    #   "gemm" (im2col + batched GEMMs), "triton" (implicit GEMMs, CUDA) or "hybrid" (the implicit-GEMM forward,
    #   cuDNN's grouped gradients; CUDA); "auto": by device (fedfast.sim.runtime.CONV_AUTO)
    profile: bool = False  # split the local-step time (data, forward, teacher, loss, backward, step); syncs
    cuda_graphs: bool = False  # CUDA: each chunk's local step captured once as a CUDA graph and replayed (the host
    #   queues one graph per step, not its kernels: fedfast.sim.step_graph); methods whose loss and step_terms are
    #   marked fedfast.methods.graph_safe; not with profile, SAM, a loss_fn or a teacher run on every step
    tune_cpu_allocator: bool = False  # CPU: keep freed memory for reuse (fedfast.cpu_alloc; process-wide)
    backend: str | None = None
    # user-level differential privacy (fedfast.privacy, docs/privacy.md): each sampled client's update clipped to L2
    # norm dp_clip (0: off), summed, Gaussian noise of std dp_noise_multiplier * dp_clip added, divided by the
    # expected cohort size clients_per_round; uniform weights. dp_epsilon instead of dp_noise_multiplier: the noise
    # that spends it in `rounds` rounds (both: the run is refused when its rounds would spend more)
    dp_mechanism: str = "dp_fedavg"  # "dp_fedavg" (fresh noise each round, secret sampling's amplification) or
    #   "dp_ftrl" (Kairouz et al. 2021: tree-aggregated noise, any data-independent cohorts, no amplification)
    dp_clip: float = 0.0
    dp_noise_multiplier: float | None = None
    dp_epsilon: float | None = None
    dp_delta: float = 1e-5
    dp_accountant: str = "rdp"  # "rdp" or "pld" (dp-accounting's)
    dp_clip_quantile: float | None = None  # adaptive clipping (Andrew et al. 2021): the clip follows this quantile
    #   of the update norms, C <- C exp(-dp_clip_lr (b - dp_clip_quantile)), b the noised fraction of unclipped updates
    dp_clip_lr: float = 0.2  # adaptive clipping's geometric step (the paper's eta_C)
    dp_clip_count_noise: float | None = None  # std of the noise on the unclipped count; None: clients_per_round / 20
    dp_diagnostics: bool = False  # a private run's records also carry what no accountant covers (train loss, cohort
    #   ids and Poisson cohort sizes, round times, a method's own metrics); off: they are null (docs/privacy.md)
    dp_ftrl_restart: int | None = None  # DP-FTRL: rounds per tree (the tree restarts after them); None: one tree

    def __post_init__(self):
        if not isinstance(self.options, dict):
            raise TypeError(f"options: expected a dict of option tables, got {type(self.options).__name__}")
        cls = _methods.get(self.algorithm)  # ValueError naming "algorithm" for unknown names
        self.options = self._tables(cls)
        method = self.method()  # validates every option (messages name table.key); the run builds its own
        self._check_training(cls)
        self._check_dp(cls)
        self._check_choices(cls, method)
        self._check_sizes()

    def _check_training(self, cls) -> None:
        """The counts, the seed and the client optimiser's settings (``max_grad_norm``: the method's default)."""
        for k in ("clients_per_round", "rounds", "local_epochs", "batch_size", "eval_every"):
            if not isinstance(getattr(self, k), (int, np.integer)) or int(getattr(self, k)) < 1:
                raise ValueError(f"{k}: must be an integer >= 1, got {getattr(self, k)!r}")
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, (int, np.integer))
            or not 0 <= self.seed < SEED_LIMIT
        ):
            raise ValueError(f"seed: must be an integer in [0, 2**31), got {self.seed!r}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if not self.lr_decay > 0:
            raise ValueError(f"lr_decay: must be > 0, got {self.lr_decay}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum: must lie in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay: must be >= 0, got {self.weight_decay}")
        if self.client_optimizer not in ("sgd", "adam", "adamw"):
            raise ValueError(f"client_optimizer: one of ('sgd', 'adam', 'adamw'), got {self.client_optimizer!r}")
        betas = tuple(self.adam_betas) if isinstance(self.adam_betas, (tuple, list)) else None
        if betas is None or len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"adam_betas: two numbers in [0, 1), got {self.adam_betas!r}")
        self.adam_betas = tuple(float(b) for b in betas)
        if not self.adam_eps > 0:
            raise ValueError(f"adam_eps: must be > 0, got {self.adam_eps}")
        if self.client_optimizer != "sgd":
            if self.momentum:
                raise ValueError(
                    f"momentum: SGD momentum, not used by client_optimizer={self.client_optimizer!r} "
                    "(its first moment is adam_betas[0]); set momentum = 0"
                )
            if cls.sgd_only:
                raise ValueError(f"client_optimizer: {self.algorithm} runs SGD client steps only: {cls.sgd_only}")
        if self.max_grad_norm is None:
            self.max_grad_norm = float(cls.max_grad_norm)
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm: must be >= 0 (0 = no clipping), got {self.max_grad_norm}")

    def _check_cuda_graphs(self, cls) -> None:
        """``cuda_graphs``: a bool; refused with the options a graph cannot replay (fedfast.sim.step_graph)."""
        if not isinstance(self.cuda_graphs, (bool, np.bool_)):
            raise TypeError(f"cuda_graphs: True or False, got {self.cuda_graphs!r}")
        if not self.cuda_graphs:
            return
        if self.profile:
            raise ValueError("cuda_graphs: profile=True times each part of a step with host syncs; a graph has none")
        unsafe = _methods.hooks.graph_unsafe_hooks(cls)
        if unsafe:
            raise ValueError(
                f"cuda_graphs: {self.algorithm}'s {' and '.join(unsafe)} not marked fedfast.methods.graph_safe (a "
                f"replayed step would keep the values its first capture read); run it with cuda_graphs=False"
            )
        if cls.sam:
            raise ValueError(f"cuda_graphs: {self.algorithm} takes SAM steps (two passes), not captured as a graph")

    def _check_choices(self, cls, method) -> None:
        """The keys that name one of several choices (``aggregate_weights`` and ``teacher``: their defaults), and
        the combinations a method or a private run refuses."""
        if self.aggregate_weights is None:
            self.aggregate_weights = "uniform" if self.dp_clip else cls.aggregation
        choices = {
            "aggregate_weights": ("size", "uniform"),
            "teacher_cache_dtype": ("float32", "bfloat16"),
            "state_dtype": ("float32", "bfloat16"),
            "executor": ("auto", "vmap"),
            "state_store": ("auto", "memory", "disk"),
            "bn_stats": ("global", "local"),
            "bn_params": ("global", "local"),
            "client_sampling": SAMPLING,
            "conv": ("auto",) + CONV_IMPLS,
        }
        for k, ok in choices.items():
            if getattr(self, k) not in ok:
                raise ValueError(f"{k}: one of {ok}, got {getattr(self, k)!r}")
        if self.bn_params == "local" and self.dp_clip:
            raise ValueError(
                "bn_params: 'local' keeps each client's BatchNorm weights, which a private run would release through "
                "the clipped sum at those positions (each client's own weights against the global model's, not a "
                "local update): not supported with dp_clip > 0"
            )
        if cls.aggregation_fixed and self.aggregate_weights != cls.aggregation:
            raise ValueError(
                f"aggregate_weights: {self.algorithm} averages its participants {cls.aggregation}-weighted"
            )
        if self.augment not in PIPELINES:
            raise ValueError(f"augment: one of {sorted(PIPELINES)}, got {self.augment!r}")
        self._check_cuda_graphs(cls)
        if self.teacher is None:
            self.teacher = "online" if self.augment != "none" else "cache"
        if self.teacher not in ("cache", "online"):
            raise ValueError(f"teacher: 'cache' or 'online', got {self.teacher!r}")
        if self.teacher == "cache" and self.augment != "none" and method.uses_teacher():
            raise ValueError("teacher: cached teacher logits would ignore the augmentation; use teacher='online'")

    def _check_sizes(self) -> None:
        """``local_steps``, the chunk, the classifier's name and the memory limits."""
        if self.local_steps is not None:
            if (
                isinstance(self.local_steps, bool)
                or not isinstance(self.local_steps, (int, np.integer))
                or self.local_steps < 1
            ):
                raise ValueError(f"local_steps: an integer >= 1 (or None: local_epochs), got {self.local_steps!r}")
            if self.local_epochs != 1:
                raise ValueError(
                    f"local_steps: {self.local_steps} steps per round replace local_epochs = "
                    f"{self.local_epochs}; give one of them"
                )
        if self.client_chunk is not None and int(self.client_chunk) < 1:
            raise ValueError(f"client_chunk: must be >= 1, got {self.client_chunk}")
        if self.features_layer is not None and not (isinstance(self.features_layer, str) and self.features_layer):
            raise ValueError(
                f"features_layer: the name of the model's classifier layer (e.g. 'fc2'), or None, got "
                f"{self.features_layer!r}"
            )
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise ValueError(f"memory_budget_gb: must be > 0, got {self.memory_budget_gb}")
        if self.state_memory_gb is not None and not self.state_memory_gb > 0:
            raise ValueError(
                f"state_memory_gb: must be > 0 (None: a quarter of the memory), got {self.state_memory_gb}"
            )
        if self.state_memory_gb is not None and self.state_store != "auto":
            raise ValueError(
                f"state_memory_gb: the limit of state_store = 'auto', not used by state_store = {self.state_store!r}"
            )

    def _check_dp(self, cls) -> None:
        """The private-run keys: each used only with dp_clip, and a run whose uploads, sampling or weights DP-FedAvg's
        analysis does not cover refused by name."""
        given = self._dp_keys_given()
        if not (
            isinstance(self.dp_clip, (int, float))
            and not isinstance(self.dp_clip, bool)
            and 0 <= self.dp_clip < math.inf
        ):
            raise ValueError(f"dp_clip: the clipping norm, a finite number >= 0 (0: not private), got {self.dp_clip!r}")
        if not self.dp_clip:
            if given:
                raise ValueError(f"{given[0]}: a private-run key, given without dp_clip (the clipping norm)")
            return
        self._check_adaptive_clip()
        self._check_dp_noise()
        self._check_dp_sampling()
        self._check_dp_method(cls)

    def _dp_keys_given(self) -> list:
        """The private-run keys set away from their defaults."""
        out = [
            k
            for k in ("dp_noise_multiplier", "dp_epsilon", "dp_clip_quantile", "dp_clip_count_noise")
            if getattr(self, k) is not None
        ]
        out += [
            k
            for k, v in (
                ("dp_clip_lr", self.dp_clip_lr != 0.2),
                ("dp_diagnostics", self.dp_diagnostics is not False),
                ("dp_mechanism", self.dp_mechanism != "dp_fedavg"),
                ("dp_ftrl_restart", self.dp_ftrl_restart is not None),
            )
            if v
        ]
        return out

    def _check_adaptive_clip(self) -> None:
        """Adaptive clipping's keys (dp_clip_quantile, dp_clip_lr, dp_clip_count_noise): in range, and only with it."""
        if self.dp_clip_quantile is not None:
            if not (isinstance(self.dp_clip_quantile, (int, float)) and 0 < self.dp_clip_quantile < 1):
                raise ValueError(
                    f"dp_clip_quantile: the target fraction of unclipped updates, in (0, 1), got "
                    f"{self.dp_clip_quantile!r}"
                )
            if not (isinstance(self.dp_clip_lr, (int, float)) and 0 < self.dp_clip_lr < math.inf):
                raise ValueError(f"dp_clip_lr: adaptive clipping's step, a finite number > 0, got {self.dp_clip_lr!r}")
            v = self.dp_clip_count_noise
            if v is not None and not (isinstance(v, (int, float)) and 0 < v < math.inf):
                raise ValueError(f"dp_clip_count_noise: the count's noise std, a finite number > 0, got {v!r}")
            if v is not None and self.dp_noise_multiplier == 0:
                raise ValueError("dp_clip_count_noise: with dp_noise_multiplier = 0 nothing is noised")
        else:
            for k in ("dp_clip_count_noise",) + (("dp_clip_lr",) if self.dp_clip_lr != 0.2 else ()):
                if getattr(self, k) is not None:
                    raise ValueError(f"{k}: an adaptive-clipping key, given without dp_clip_quantile")

    def _check_dp_noise(self) -> None:
        """The noise: a multiplier or an epsilon to calibrate it to, each a finite number; dp_diagnostics a bool."""
        if self.dp_noise_multiplier is None and self.dp_epsilon is None:
            raise ValueError(
                "dp_clip: a private run needs dp_noise_multiplier (0: clipping only, epsilon infinite) or "
                "dp_epsilon (the budget to spend in `rounds` rounds)"
            )
        for k in ("dp_noise_multiplier", "dp_epsilon"):
            v = getattr(self, k)
            ok = isinstance(v, (int, float)) and 0 <= v < math.inf and (k != "dp_epsilon" or v > 0)
            if v is not None and not ok:
                raise ValueError(f"{k}: a finite number {'> 0' if k == 'dp_epsilon' else '>= 0'}, got {v!r}")
        if not isinstance(self.dp_diagnostics, bool):
            raise ValueError(f"dp_diagnostics: true or false, got {self.dp_diagnostics!r}")

    def _check_dp_sampling(self) -> None:
        """The sampling and the mechanism: ones the accounting covers."""
        if self.client_sampling not in SAMPLING:
            raise ValueError(f"client_sampling: one of {SAMPLING}, got {self.client_sampling!r}")
        if self.dp_mechanism not in privacy.MECHANISMS:
            raise ValueError(f"dp_mechanism: one of {privacy.MECHANISMS}, got {self.dp_mechanism!r}")
        if self.dp_mechanism == "dp_ftrl":
            self._check_ftrl()
        elif self.dp_ftrl_restart is not None:
            raise ValueError('dp_ftrl_restart: a DP-FTRL key, given with dp_mechanism = "dp_fedavg"')
        if self.dp_mechanism == "dp_fedavg" and self.client_sampling not in ("uniform", "poisson"):
            why = {
                "bernoulli": "redraws an empty cohort, which the Poisson analysis does not cover",
                "round_seeded": "draws the cohorts from the round index alone: they are public, and the analysis "
                "assumes secret sampling",
                "shuffled": "takes each client once per epoch, which no sampling analysis of DP-FedAvg covers "
                '(dp_mechanism = "dp_ftrl" accounts it as it is)',
            }[self.client_sampling]
            raise ValueError(
                f"client_sampling: {self.client_sampling!r} {why}; a private run samples 'uniform' "
                f"(fixed size) or 'poisson'"
            )
        if self.dp_mechanism == "dp_fedavg":
            privacy.check_accounting(
                self.dp_delta, "poisson" if self.client_sampling == "poisson" else "fixed", self.dp_accountant
            )

    def _check_dp_method(self, cls) -> None:
        """The method: one whose uploads and weights the mechanism covers."""
        if cls.private_refusal:
            raise ValueError(f"dp_clip: {self.algorithm} is refused in a private run: {cls.private_refusal}")
        if cls.uploads and cls.upload_spec is _methods.Method.upload_spec:
            raise ValueError(
                f"dp_clip: {self.algorithm} uploads {cls.uploads} beside the model update and declares no private "
                f"form of it (Method.upload_spec), so the mechanism's clipping and noise would not cover it: "
                f"{self.algorithm} is refused in a private run"
            )
        if self.aggregate_weights not in (None, "uniform") or (cls.aggregation_fixed and cls.aggregation != "uniform"):
            raise ValueError(
                "aggregate_weights: a private run sums the clipped updates with equal weight and divides "
                "by the expected cohort size; size-weighted averaging is refused under dp_clip"
            )

    def _check_ftrl(self) -> None:
        """DP-FTRL's keys: its restart period, and what it does not take (adaptive clipping's count would need a
        tree of its own)."""
        r = self.dp_ftrl_restart
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 1):
            raise ValueError(f"dp_ftrl_restart: rounds per tree, an integer >= 1 (None: one tree), got {r!r}")
        if self.dp_clip_quantile is not None:
            raise ValueError(
                "dp_clip_quantile: adaptive clipping is DP-FedAvg's (its count is released with fresh noise each "
                'round); dp_mechanism = "dp_ftrl" takes a fixed dp_clip'
            )
        privacy.check_delta(self.dp_delta)
        if self.dp_accountant not in privacy.ACCOUNTANTS:
            raise ValueError(f"dp_accountant: must be one of {privacy.ACCOUNTANTS}, got {self.dp_accountant!r}")

    def _tables(self, cls) -> dict:
        """``options`` as ``{table: {key: value}}``: the running method's own keys may be given flat."""
        own = cls.table_name()
        known = cls.option_tables()
        out: dict = {}
        for k, v in self.options.items():
            if k in known or isinstance(v, dict):
                out.setdefault(k, {}).update(v if isinstance(v, dict) else dataclasses.asdict(v))
            else:
                out.setdefault(own, {})[k] = v
        return out

    def method(self):
        """A fresh instance of the configured method with its resolved options."""
        return _methods.build(self.algorithm, self.options)

    def method_options(self) -> dict:
        """The method's resolved option tables (``{table: {key: value}}``, of a fresh instance)."""
        return self.method().options()
