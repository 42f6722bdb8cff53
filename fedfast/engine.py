"""Batched-client simulation engine: every sampled client of a round trains at once on one device.

A round is six phases, each a short method of :class:`Simulation`:

1. **sample** (``_sample``): the round's clients (seeded by ``(seed, round)``, or the user's ``schedule``), sorted by
   local step count so the clients still training at any step are a prefix of the stack;
2. **teacher** (``_teacher``): the method's :class:`~fedfast.methods.TeacherSpec` becomes a per-round table of
   teacher logits for the union of the sampled clients' rows, in large batches (``teacher="cache"``; M teachers:
   their mixture), or a per-step batched forward over the augmented rows (``teacher="online"``);
3. **local training** (``_train_chunk``), per chunk of clients that fits the memory budget (usually one):
   broadcast the global model into the stack rows; per local step gather every active client's minibatch
   (``[n_active, B]`` index table, the last partial batch padded and masked with ``ignore_index``), one batched
   forward/backward over the stacked parameters (``fedfast.batched`` for Sequential models, else ``vmap``), the
   method's fused loss with per-client segments (each client's gradient is that of its own minibatch mean), the
   fused client step with the method's terms;
4. **aggregation** (``_aggregate_chunk``): the chunk's rows through the fused server update (weighted sum,
   per-client state);
5. **server** (``_server``): the method's server rule on the participants' average;
6. **evaluation** (``_evaluate_round``): test accuracy, per-class accuracy, FedNTD's forgetting.

The method (:mod:`fedfast.methods`: loss, client-step terms, server rule, state, teacher) is an object the engine
calls through its hooks; the engine never branches on a method's name and reads none of its attributes beyond
the contract of :class:`fedfast.methods.Method`. The engine's own settings are :class:`SimConfig`; a method's
options are its own table (``SimConfig(algorithm="fedntd", options={"fedntd": {"beta": 1.0}})``).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from . import methods as _methods, ops
from .data.datasets import ArrayDataset
from .data.partition import Partition
from ._io import host_to_device
from .flat import ClientStack, FlatLayout, find_classifier, functional_forward
from .methods.base import Round, TeacherSpec
from .methods.hooks import HookError, check_hook_return, hook_site
from .collectives import collectives
from .teachers import CachedMixture, CachedTeacher, OnlineTeacher
from .local_step import client_optimizer
from .sim import plan
from .sim.evaluation import Evaluation
from .sim.memory import OutOfMemory, _free_bytes, _gib
from .sim.services import EngineServices, _probe_batch
from .sim.sizing import Sizing
from .sim.training import LocalTraining
from .sim.snapshots import Snapshots
from .simconfig import SimConfig, check_device



class Diverged(ArithmeticError):
    """The run diverged: a non-finite training loss, client update, global model or test loss at round
    ``round``. ``record``: that round's metrics (None when a client update was refused before evaluation)."""

    def __init__(self, rnd: int, method: str, what: str, cfg: "SimConfig", record: dict | None = None):
        self.round, self.method, self.what, self.record = rnd, method, what, record
        steps = f"lr={cfg.lr:g}" + (f", momentum={cfg.momentum:g}" if cfg.momentum else "") + (
            f", {cfg.client_optimizer}" if cfg.client_optimizer != "sgd" else "") + (
            f", max_grad_norm={cfg.max_grad_norm:g}" if cfg.max_grad_norm else ", no gradient clipping")
        hint = ["a lower lr"] + (["lower momentum"] if cfg.momentum else []) + (
            ["clipping (max_grad_norm = 10)"] if not cfg.max_grad_norm else [])
        super().__init__(f"round {rnd}: {method} diverged ({what} is NaN or inf). Likely cause: local steps too "
                         f"large for this model and data ({steps}); try {', '.join(hint[:-1])}"
                         f"{' or ' if len(hint) > 1 else ''}{hint[-1]}")


# conv = "auto" by device type. CPU: oneDNN's grouped convolution (benchmarks/bench_conv.py on the 2-core VM, NHWC:
# 1.35-7.9x faster than im2col + GEMM on layers of 16+ input channels; im2col on the thin first layers alone gave
# no faster rounds; docs/benchmarks.md). CUDA: "hybrid" (the implicit-GEMM forward, cuDNN's grouped gradients;
# bench_rounds.py on an H100, one run, benchmarks/results/nvidia-h100-80gb-hbm3-rounds-hybrid*.json: 347 ms per
# round at 1000 clients of simple_cnn against 411 ms for "triton" and 1245 ms for "grouped"; FedNTD's MNIST 324 ms
# against 377 and 425; pfl-research at 50 clients 34.7 ms, all three within 3 %). Without triton it is "grouped".
CONV_AUTO = {"cpu": "grouped", "cuda": "hybrid"}


def conv_impl(setting: str, device: torch.device) -> str:
    """The convolution implementation a run uses: ``setting`` unless "auto"; ValueError where it cannot run."""
    impl = CONV_AUTO.get(device.type, "grouped") if setting == "auto" else setting
    if setting == "auto" and impl in ("triton", "hybrid"):
        from .ops import _backend
        if not _backend.available("triton", device.type):
            impl = "grouped"  # the automatic choice needs no optional package
    if impl in ("triton", "hybrid"):
        from .ops import _backend
        if not _backend.available("triton", device.type):
            why = _backend.interpreter_problem()
            raise ValueError(f"conv: {impl!r} runs on CUDA devices (with triton installed), not {device.type}"
                             + (f" ({why})" if why else "") + "; use conv = 'grouped' or 'gemm'")
    return impl


class Simulation(LocalTraining, EngineServices, Sizing, Evaluation, Snapshots):
    """``Simulation(config, model, train, test, partition).run()`` -> per-round metrics; ``round()`` steps one round.

    After every round ``model`` (the module passed in) holds the evaluated global model's weights;
    :meth:`state_dict` returns a copy of them. A method that builds its own model from it (MOON's and FedGKD+'s
    projection head, ``Method.prepare_model``) trains that model instead: ``sim.model`` is it, and the module
    passed in is left as it was.

    ``val`` / ``aux``: server-held splits a method may need (FedGKD-VOTE's validation split, FedCAD's auxiliary
    data; the method's ``hold_out(train)`` makes them). ``schedule``: the round's clients, a sequence with one
    array of client ids per round or a callable ``round -> ids`` (replay another framework's cohorts; default:
    ``clients_per_round`` seeded by round). ``data_order``: each client's local data order, a callable
    ``(round, client, epoch, n) -> permutation of range(n)`` (default: seeded by ``(seed, round, client, epoch)``).
    ``loss_fn(student [R, C], teacher [R, C] or None, target [R], segments [R], num_segments) -> scalar`` replaces
    the method's client loss (client step, server rule and state stay the method's); it must return the sum over
    the segments (clients) of each client's mean loss over its valid rows; padded rows carry ``target == -100``.
    ``loss_needs_teacher=True`` passes the global model's logits as ``teacher``.
    ``validation``: a split held out of the training data for model selection (``fedfast run``'s
    ``val_fraction``): evaluated with the test set, its accuracy and loss go into each evaluated round's record as
    ``val_accuracy`` / ``val_loss`` (absent without it), so grid points can be chosen without the test set.
    ``process_group``: a ``torch.distributed`` group (or ``"default"``): each rank trains every world-th of the
    round's clients (same seeds, same data on every rank); sums and updated client state rows are exchanged with
    all_reduce / all_gather, so every rank holds the same global model and state after each round.
    ``method``: the method instance to run, built from ``config`` (``config.method()``; :func:`fedfast.assemble.build`
    builds one per run, whose ``hold_out`` made the server-held splits); default: a new instance of the config's."""

    def __init__(self, config: SimConfig, model: nn.Module, train: ArrayDataset, test: ArrayDataset,
                 partition: Partition, device=None, val: ArrayDataset | None = None, process_group=None,
                 loss_fn=None, loss_needs_teacher: bool = False, aux: ArrayDataset | None = None,
                 schedule: Sequence | Callable | None = None, data_order: Callable | None = None,
                 validation: ArrayDataset | None = None, method=None):
        c = self.cfg = self.config = config
        if not isinstance(config, SimConfig):
            raise TypeError(f"config: expected a fedfast.SimConfig, got {type(config).__name__}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
        # the method: loss, client-step terms, server rule, state; ``method``: an instance built from this config
        # already (fedfast.assemble builds it once per run), else the config's own
        if method is not None and (type(method) is not _methods.get(c.algorithm) or
                                   method.options() != c.method_options()):
            raise ValueError(f"method: a {type(method).__name__} with other options than config's "
                             f"{c.algorithm!r}; build it with config.method()")
        self.method = method if method is not None else c.method()
        # the classifier (Step.features is its input): found on the user's model before prepare_model (MOON's
        # projection head replaces it), then again on the model the clients train
        eager = self.method.needs_features or self.method.needs_classifier or c.features_layer is not None
        given = model
        if eager and isinstance(train, ArrayDataset) and isinstance(model, nn.Module):
            self.method.classifier_name = find_classifier(model, _probe_batch(model, train), c.features_layer)
        model = self.method.prepare_model(model, c.seed)
        if not isinstance(model, nn.Module):
            raise HookError(f"{hook_site(self.method, 'prepare_model')}: must return an nn.Module, got "
                            f"{type(model).__name__}")
        for msg in self.method.check_settings(c, model):  # settings the method is known to fail under (caveats)
            import warnings
            warnings.warn(f"{c.algorithm}: {msg}", RuntimeWarning, stacklevel=2)
        datasets = (("train", train), ("test", test), ("val", val), ("aux", aux), ("validation", validation))
        self._check_inputs(model, datasets, partition, loss_fn, schedule, data_order)
        self.loss_fn, self.loss_needs_teacher = loss_fn, bool(loss_needs_teacher)
        self.schedule, self.data_order = schedule, data_order
        # one process, or torch.distributed (the sampled clients split between the ranks): the run's collectives
        self.comm = collectives(process_group)
        self.rank, self.world = self.comm.rank, self.comm.world
        if device is not None:
            check_device(str(device))
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if c.tune_cpu_allocator and self.device.type == "cpu":
            from .cpu_alloc import tune_cpu_allocator
            tune_cpu_allocator()
        self.backend, self.seed = c.backend, c.seed
        self.model = model.to(self.device)
        self._place_data(train, test, val, aux, validation, partition, schedule)
        self._probe_model()
        self._classifier_name = None
        found = getattr(self.method, "classifier_name", None)
        if eager:  # on the model prepare_model made (MOON's head: the new classifier); the same model: found above
            self._classifier_name = found if found is not None and model is given else \
                find_classifier(self.model, _probe_batch(self.model, self.train), found)
        self._client_bytes_cache = None  # (parameter-row bytes, activation bytes) per client: _client_bytes
        self._flatten_model()
        self.rnd = 0
        self._head_names = None
        self.method.bind(self)
        self.eval_flat = self._evaluated(self.global_flat)
        self._uses_teacher = self.loss_needs_teacher if loss_fn is not None else self.method.uses_teacher()
        if self._uses_teacher and c.teacher == "cache" and c.augment != "none":
            raise ValueError("teacher: cached teacher logits would ignore the augmentation; use teacher='online'")
        per_rank = -(-(self._max_cohort() if schedule is None else self.K) // self.world)
        self.chunk = max(1, min(per_rank, c.client_chunk or self._auto_chunk(self.num_params)))
        with self._memory(f"allocating the parameter buffers of a chunk of {self.chunk} clients", "client_chunk"):
            self._allocate()
        self._finish_init()

    def _check_inputs(self, model, datasets, partition, loss_fn, schedule, data_order) -> None:
        """The arguments' types and agreement (classes, frozen parameters, augmentation of non-images, a model's
        own data checks): a clear error naming the argument, before anything is allocated."""
        c = self.cfg
        train = datasets[0][1]
        for name, ds in datasets:
            if ds is not None and not isinstance(ds, ArrayDataset):
                raise TypeError(f"{name}: expected a fedfast.data.ArrayDataset, got {type(ds).__name__}")
            if ds is not None and ds.num_classes != train.num_classes:
                raise ValueError(f"{name}: has {ds.num_classes} classes, the training set {train.num_classes}")
        if not isinstance(partition, Partition):
            raise TypeError(f"partition: expected a fedfast.data.Partition, got {type(partition).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError("loss_fn: expected a callable (student, teacher, target, segments, num_segments) -> loss")
        if schedule is not None and not (callable(schedule) or isinstance(schedule, (list, tuple, np.ndarray))):
            raise TypeError("schedule: expected a sequence of client-id arrays (one per round) or a callable round -> ids")
        if schedule is not None and c.client_sampling != "uniform":
            raise ValueError(f"client_sampling: {c.client_sampling!r} draws the cohorts, and so does schedule; give one")
        if data_order is not None and not callable(data_order):
            raise TypeError("data_order: expected a callable (round, client, epoch, n) -> permutation of range(n)")
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        if frozen:
            raise ValueError(f"model: parameters {frozen[:3]}{' ...' if len(frozen) > 3 else ''} are frozen "
                             f"(requires_grad=False); the engine trains every parameter of the model, so train a "
                             f"model without them (e.g. move frozen layers into preprocessing)")
        if c.augment != "none" and not train.is_image:
            raise ValueError(f"augment: {c.augment!r} augments images; the training set holds {train.name or 'tokens'}"
                             f" (use augment = 'none')")
        check = getattr(model, "check_data", None)  # a model may refuse data it was not made for (HFClassifier)
        if callable(check):
            for name, ds in datasets:
                if ds is not None:
                    check(ds, name)

    def _place_data(self, train, test, val, aux, validation, partition, schedule) -> None:
        """The datasets on the device, the partition's index tables and label histograms (checked against the
        training set)."""
        c = self.cfg
        self.train = train.to(self.device)
        self.test = test.to(self.device)
        self.validation = validation.to(self.device) if validation is not None else None
        self._splits = {k: v.to(self.device) for k, v in (("val", val), ("aux", aux)) if v is not None}
        self.partition = partition
        self.K = self.num_clients = partition.num_clients
        self._idx_host = [np.asarray(i.cpu(), dtype=np.int64) for i in partition.indices]  # per-epoch batch tables
        self.client_sizes = np.array([len(i) for i in self._idx_host], dtype=np.int64)
        if any(len(i) and (int(i.max()) >= len(train)) for i in self._idx_host):
            raise ValueError(f"partition: holds sample indices beyond the training set ({len(train)} samples)")
        if partition.num_classes is not None and partition.num_classes != train.num_classes:
            raise ValueError(f"partition: made for {partition.num_classes} classes, the training set has "
                             f"{train.num_classes}")
        if schedule is None and c.clients_per_round > self.K:
            raise ValueError(f"clients_per_round: {c.clients_per_round} > {self.K} clients")
        self.num_classes = train.num_classes
        self.eval_batch = c.eval_batch or (1024 if self.device.type == "cpu" else 4096)
        y_host = self.train.y.cpu()
        self._y_host = y_host.numpy()
        self.label_hist = torch.stack([torch.bincount(y_host[torch.from_numpy(i)], minlength=self.num_classes)
                                       for i in self._idx_host]).float().to(self.device)  # [K, C]

    def _flatten_model(self) -> None:
        """The model as flat parameters: its layout, the batched executor's plan, the functional forward, the
        initial global model."""
        c = self.cfg
        self.layout = FlatLayout(self.model)
        self.num_params = self.layout.P
        self._batch_stats = any(isinstance(mod, nn.modules.batchnorm._NormBase) and not isinstance(mod, nn.GroupNorm)
                                for mod in self.model.modules())  # BatchNorm/InstanceNorm: batch statistics
        self.conv = conv_impl(c.conv, self.device)
        self._plan = self._batched_plan()
        self._buffers0 = self.layout.flatten_buffers(self.model).to(self.device)
        self._fwd = functional_forward(self.model)
        self._classifier = None
        self.global_flat = self.layout.flatten_params(self.model).to(self.device)

    def _allocate(self):
        """The chunk's parameter-sized buffers: the stack, momentum or Adam moments, the flat gradient."""
        c = self.cfg
        rows, _ = self._client_bytes(self.num_params)
        free = _free_bytes(self.device)
        if self.device.type == "cuda" and self.chunk * rows > free:
            raise OutOfMemory(f"client_chunk: {self.chunk} clients' parameter buffers need {_gib(self.chunk * rows)} "
                              f"({self.num_params} parameters x {rows // (4 * self.num_params)} fp32 buffers each), "
                              f"{_gib(free)} is free on {self.device}; set client_chunk = "
                              f"{max(1, int(0.8 * free // max(rows, 1)))} or lower")
        self.stack = ClientStack(self.model, self.chunk, device=self.device, use_executor=False)
        self.stack.plan = self._plan  # the verified program (None: vmap)
        self.optimizer = client_optimizer(c, self.stack.params)  # SGD / Adam / AdamW state, reset every chunk
        # the C++ and Triton client steps read autograd's per-parameter gradients in place; the CUDA backend takes
        # one flat [n, P] gradient, reused every step
        self.gradbuf = None if ops._backend.resolve(c.backend, self.device.type) in ("cpu", "triton") else \
            torch.empty_like(self.stack.params)
        self._sam = None  # SAM steps: the first gradient and the perturbed weights [chunk, P] (made on use)

    def _finish_init(self):
        c = self.cfg
        self._method_metrics: dict = {}
        self._step_rows = None  # local_steps runs: the round's step tables [m, local_steps * B] (host)
        self._aug_gen = torch.Generator(device=self.device).manual_seed(c.seed + 104729)
        self._arange_b = torch.arange(c.batch_size, device=self.device)
        if self._batch_stats and self._uses_teacher and c.teacher == "cache":
            import warnings
            warnings.warn("teacher: the model normalises with batch statistics, so cached teacher logits (computed "
                          "in large evaluation batches) differ from a per-client loop's teacher; teacher='online' "
                          "runs the teacher on each client's own batch.", stacklevel=3)
        if self._batch_stats and (self.client_sizes % c.batch_size).any() and not c.drop_last:
            import warnings
            warnings.warn("model: it normalises with batch statistics (BatchNorm/InstanceNorm) and some clients' last "
                          "minibatch is partial; the engine pads those batches to batch_size, so the padding rows "
                          "enter that batch's statistics (a per-client loop would not). Use GroupNorm, or client "
                          "sizes divisible by batch_size, for results equal to the sequential loop.", stacklevel=3)
        self.history: list[dict] = []
        self._class_acc: list[torch.Tensor] = []

    # -- phase 1: sample -------------------------------------------------------------------------------------
    def _max_cohort(self) -> int:
        c = self.cfg
        return plan.max_cohort(c.clients_per_round, self.K, c.client_sampling)

    def _round_clients(self) -> np.ndarray:
        c = self.cfg
        return plan.round_clients(c.seed, self.rnd, self.K, c.clients_per_round, c.client_sampling, self.schedule)

    def _sample(self) -> tuple[Round, dict]:
        """The round's clients in stack order (this rank's share) and the round totals over all ranks."""
        c = self.cfg
        sampled = self._round_clients()
        sizes = self.client_sizes[sampled]
        batches = (sizes // c.batch_size if c.drop_last else np.ceil(sizes / c.batch_size)).astype(int)  # per pass
        if c.drop_last and (batches == 0).any():
            small = sampled[batches == 0].tolist()
            raise ValueError(f"drop_last: client(s) {small[:5]} hold fewer than batch_size = {c.batch_size} samples, "
                             f"so drop_last leaves them no batch; use a smaller batch_size or drop_last = false")
        order = np.argsort(-batches, kind="stable")  # most steps first: active clients are a prefix
        sampled, sizes, batches = sampled[order], sizes[order], batches[order]
        epochs = 1 if c.local_steps else c.local_epochs
        steps = np.full(len(sampled), c.local_steps, dtype=int) if c.local_steps else batches  # per "epoch"
        weights = self._aggregation_weights(sampled, sizes, steps * epochs)
        totals = dict(weight=float(weights.sum()), steps=int(steps.sum()) * epochs, clients=sampled.tolist())
        everyone = sampled
        positions = np.arange(len(sampled))
        num_total = len(sampled)
        if self.world > 1:  # this rank's clients: every world-th of the sorted list (balanced, still sorted)
            sampled, sizes, steps, batches, weights = (a[self.rank::self.world] for a in (sampled, sizes, steps,
                                                                                          batches, weights))
            positions = positions[self.rank::self.world]
        sampled_t = torch.from_numpy(sampled).to(self.device)
        hist = self.label_hist[sampled_t]
        ctx = Round(index=self.rnd, sampled=sampled, sizes=sizes, steps=steps, epochs=epochs,
                    lr=c.lr * c.lr_decay ** self.rnd, sampled_t=sampled_t, hist=hist,
                    positions=host_to_device(positions, self.device), num_total=num_total, weights=weights,
                    clients=everyone, data_batches=batches)
        self._step_rows = None
        if c.local_steps:  # each client's rows for its local_steps steps
            self._step_rows = self._steps_table(ctx, 0, len(sampled), c.local_steps)
        if c.local_steps or c.drop_last:  # the labels of the rows each client trains on
            tables = [self._step_rows] if c.local_steps else \
                [self._batch_table(ctx, 0, len(sampled), e, int(steps[0]) * c.batch_size) for e in range(epochs)]
            seen = np.zeros((len(sampled), self.num_classes), dtype=np.int64)
            for t in tables:
                for j, r in enumerate(t):
                    seen[j] += np.bincount(self._y_host[r[r >= 0]], minlength=self.num_classes)
            ctx.seen_hist = host_to_device(seen.astype(np.float32), self.device)
        else:
            ctx.seen_hist = hist * epochs
        return ctx, totals

    def _steps_table(self, ctx: Round, lo: int, hi: int, T: int) -> np.ndarray:
        """``local_steps`` mode's rows for the round's clients ``lo:hi`` (:func:`fedfast.sim.plan.steps_table`)."""
        return plan.steps_table(ctx.sampled[lo:hi], ctx.sizes[lo:hi], ctx.data_batches[lo:hi], T,
                                self.cfg.batch_size, self._idx_host, self._order)

    def _order(self, k: int, epoch: int, nk: int) -> np.ndarray:
        """Client ``k``'s data order in local pass ``epoch`` (:func:`fedfast.sim.plan.data_order`)."""
        return plan.data_order(self.cfg.seed, self.rnd, k, epoch, nk, self.data_order)

    def _aggregation_weights(self, ids: np.ndarray, sizes: np.ndarray, local_steps: np.ndarray) -> np.ndarray:
        """The round's participants' weights in the average: the method's (FedDisco, FedNova) or the engine's."""
        w = self.method.aggregation_weights(ids, sizes, local_steps)
        if w is None:
            return sizes.astype(np.float64) if self.cfg.aggregate_weights == "size" else np.ones(len(ids))
        w = np.asarray(w, dtype=np.float64)
        if w.shape != ids.shape or not np.isfinite(w).all() or (w < 0).any() or not w.sum() > 0:
            raise ValueError(f"{hook_site(self.method, 'aggregation_weights')}: expected {len(ids)} finite "
                             f"non-negative weights with a positive sum, got {w.tolist()}")
        return w

    # -- phase 2: teacher ------------------------------------------------------------------------------------
    def _teacher(self, ctx: Round):
        """The round's teacher (None, a cached table, or an online teacher)."""
        if self.loss_fn is not None:
            spec = TeacherSpec.of(self.global_flat) if self.loss_needs_teacher else None
        else:
            spec = self.method.teacher(ctx)
        if spec is None or not len(ctx.sampled):
            return None
        if not isinstance(spec, TeacherSpec):
            raise HookError(f"{hook_site(self.method, 'teacher')}: must return a fedfast.methods.TeacherSpec or None, "
                            f"got {type(spec).__name__}")
        if self.cfg.teacher == "online":
            return OnlineTeacher(spec, self)
        idx = host_to_device(np.concatenate([self._idx_host[k] for k in ctx.sampled]), self.device)
        N, C = len(self.train), self.num_classes
        if spec.weights is not None:  # M teachers: their mixture at the method's temperature, cached once
            T = torch.stack([self.predict(m, self.train, idx) for m in spec.models])
            Pm, neg = ops.teacher_mixture(T, spec.weights, self.train.y[idx], tau=spec.tau, backend=self.backend)
            P_all = torch.zeros(N, C, device=self.device)
            neg_all = torch.zeros(N, device=self.device)
            P_all[idx], neg_all[idx] = Pm.float(), neg.float()
            return CachedMixture(P_all, neg_all)
        dt = torch.bfloat16 if self.cfg.teacher_cache_dtype == "bfloat16" else torch.float32
        cache = torch.zeros(N, C, device=self.device, dtype=dt)
        cache[idx] = self.predict(spec.models[0], self.train, idx, dt)
        return CachedTeacher(cache)

    # -- one round -------------------------------------------------------------------------------------------
    def round(self) -> dict:
        """One round: sample, teacher, local training and aggregation per chunk, server rule, evaluation."""
        t0 = time.perf_counter()
        timers = {}
        ctx, totals = self._sample()
        self.method.round_start(ctx)
        t1 = time.perf_counter()
        with self._memory("the teacher's logits (eval_batch rows at a time)", "eval_batch"):
            teacher = self._teacher(ctx)
            self._sync()
        timers["teacher"] = time.perf_counter() - t1
        with self._memory(f"local training of a chunk of {self.chunk} clients", "client_chunk"):
            avg_sum, loss_sum, t_local, t_agg = self._local(ctx, teacher)
        t1 = time.perf_counter()
        try:
            self._server(ctx, avg_sum, loss_sum, totals["weight"])
        except ops.NonFiniteUpdate:
            raise Diverged(self.rnd + 1, self.method.name, "the server update", self.cfg) from None
        timers["local"], timers["aggregate"] = t_local, t_agg + time.perf_counter() - t1
        timers.update({f"local.{k}": v for k, v in self._prof.items()})
        self._method_metrics = self._round_metrics(ctx)
        t1 = time.perf_counter()
        self.rnd += 1  # the only place the round advances (restore sets it from a checkpoint)
        with self._memory("evaluation (eval_batch rows at a time)", "eval_batch"):
            rec, class_acc = self._evaluate_round(self.rnd, totals, loss_sum, timers, t1)
        if class_acc is not None:
            self._class_acc.append(class_acc)
        self.history.append(rec)
        rec["seconds"] = time.perf_counter() - t0
        self._check_finite(rec)
        return rec

    def _round_metrics(self, ctx) -> dict:
        """The method's own values for this round's record (``Method.round_metrics``): names to numbers (read to
        the host once per round)."""
        got = self.method.round_metrics(ctx)
        if not got:
            return {}
        if not isinstance(got, dict):
            raise HookError(f"{hook_site(self.method, 'round_metrics')}: must return a dict of name -> number, got "
                            f"{type(got).__name__}")
        out = {}
        for k, v in got.items():
            if not isinstance(k, str) or not k:
                raise HookError(f"{hook_site(self.method, 'round_metrics')}: names must be non-empty strings, got "
                                f"{k!r}")
            if torch.is_tensor(v):
                if v.numel() != 1:
                    raise HookError(f"{hook_site(self.method, 'round_metrics')}: {k!r} must be one number, got a "
                                    f"tensor of shape {tuple(v.shape)}")
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise HookError(f"{hook_site(self.method, 'round_metrics')}: {k!r} must be a number, got {v!r}")
            out[k] = float(v)
        return out

    def _check_finite(self, rec: dict) -> None:
        """Divergence ends the run: a non-finite train loss, global (or evaluated) model or test loss raises
        :class:`Diverged` (one host read of two flags per round; every rank sees the same values)."""
        what = []
        if not math.isfinite(rec["train_loss"]):
            what.append("the training loss")
        ok = torch.stack([torch.isfinite(self.global_flat).all(), torch.isfinite(self.eval_flat).all()]).tolist()
        if not ok[0]:
            what.append("the global model")
        elif not ok[1]:
            what.append("the evaluated model")
        if rec["test_loss"] is not None and not math.isfinite(rec["test_loss"]):
            what.append("the test loss")
        if what:
            raise Diverged(rec["round"], self.method.name, " and ".join(what), self.cfg, rec)

    # -- phases 3-4: local training and aggregation, chunk by chunk ------------------------------------------
    def _local(self, ctx: Round, teacher):
        m = len(ctx.sampled)
        if self.method.client_state is not None:
            ctx.rows = self.method.client_state.gather(ctx.sampled_t)  # the method's per-client state rows
            ctx.new_rows = torch.empty(m, self.method.client_state.data.shape[1], device=self.device)
        weights = host_to_device(ctx.weights, self.device, torch.float32)
        self._sync()
        t_local = t_agg = 0.0
        avg_sum = torch.zeros_like(self.global_flat)
        ctx.incr = torch.zeros_like(self.global_flat)  # e.g. SCAFFOLD sum of (c_k' - c_k)/N, FedDyn sum of (w_k - g)/N
        loss_sum = torch.zeros((), device=self.device)
        self._prof = {}
        for lo in range(0, m, self.chunk):  # usually a single chunk (an empty rank: none)
            hi = min(m, lo + self.chunk)
            t1 = self._last = time.perf_counter()
            self._train_chunk(ctx, lo, hi, teacher, loss_sum)
            self._sync()
            t_local += time.perf_counter() - t1
            t1 = time.perf_counter()
            avg_sum += self._aggregate_chunk(ctx, lo, hi, weights)
            t_agg += time.perf_counter() - t1
        return avg_sum, loss_sum, t_local, t_agg

    def _aggregate_chunk(self, ctx: Round, lo: int, hi: int, weights: torch.Tensor) -> torch.Tensor:
        """The chunk's rows through the fused server update: returns their weighted sum [P]."""
        extra = self.method.chunk_aggregate(ctx, lo, hi)
        if not isinstance(extra, dict):
            check_hook_return(self.method, "chunk_aggregate", extra, kind="dict",
                              what="a dict of fedfast.ops.aggregate keyword arguments ({} for none)")
        agg = dict(weights=weights[lo:hi], rows=hi - lo, backend=self.backend, **extra)
        try:
            out = ops.aggregate(self.stack.params, self.global_flat, **agg)
        except ops.NonFiniteUpdate as e:
            who = [int(ctx.sampled[lo + r]) for r in e.rows]
            if self.world == 1:
                raise Diverged(self.rnd + 1, self.method.name, f"the update of client(s) {who}" if who else
                               "the clients' weighted average", self.cfg) from None
            # the other ranks are in this round's all-reduce: poison the sum, so every rank sees a non-finite
            # global model after it and stops at the same round
            return torch.full_like(self.global_flat, float("nan"))
        self.method.collect(ctx, out, lo, hi)
        return weights[lo:hi].sum() * out["average"]

    # -- phase 5: server ---------------------------------------------------------------------------------------
    def _server(self, ctx: Round, avg_sum, loss_sum, total_w: float):
        # sums over all ranks' clients; every rank learns every updated client's state row (one process: as is)
        self.comm.sum_(avg_sum, ctx.incr, loss_sum, *(ctx.reduce[k] for k in sorted(ctx.reduce)))
        if ctx.new_rows is not None:
            ctx.sampled_t, ctx.new_rows = self.comm.gather_rows(ctx.sampled_t, ctx.new_rows)
        if ctx.new_rows is not None:
            self.method.client_state.scatter_(ctx.sampled_t, ctx.new_rows)
        new = self.method.server(ctx, avg_sum / total_w)
        P = tuple(self.global_flat.shape)
        check_hook_return(self.method, "server", new, shape=P, device=self.device,
                          what=f"the new global model, a float tensor [P] = {P} on {self.device}")
        self.global_flat = new
        self.eval_flat = self._evaluated(new)
        if self.device.type != "cpu":  # the ops' deferred (no-sync) input checks of this round: one read
            ops.raise_if_invalid(self.device)

    def _evaluated(self, flat: torch.Tensor) -> torch.Tensor:
        """The model the method has evaluated (``Method.evaluated``), checked: a float tensor [P] on the device."""
        out = self.method.evaluated(flat)
        P = tuple(self.global_flat.shape)
        check_hook_return(self.method, "evaluated", out, shape=P, device=self.device,
                          what=f"the model to evaluate, a float tensor [P] = {P} on {self.device}")
        return out

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

    def run(self) -> list[dict]:
        """The remaining rounds (``config.rounds`` in all); returns the history of per-round metrics."""
        for _ in range(self.cfg.rounds - self.rnd):
            self.round()
        return self.history

__all__ = ["Simulation", "Diverged", "conv_impl", "CONV_AUTO"]
