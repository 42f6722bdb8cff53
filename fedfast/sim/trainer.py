"""A chunk's local training: the clients' parameter stack, the client optimiser, SAM's buffers and the flat gradient
buffer, and every local step of a chunk of clients at once - the minibatch tables of the round plan, the batched
forward and the method's (or a user's) loss, the gradient (plain or SAM's) and the client optimiser's fused step
with the method's terms. It also gives a method the clients' gradients at their trained weights."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time

import numpy as np
import torch

from .. import ops
from .._io import host_to_device
from .._settings import Settings
from ..flat import ClientStack
from ..local_step import OptimizerSettings, PlainGradient, SAMGradient, client_optimizer
from ..methods.base import ClientData, Method, Step
from ..methods.hooks import HookError, check_hook_return, describe_value, hook_site
from ..methods.round import Round
from ..teachers import CachedMixture, CachedTeacher
from .memory import OutOfMemory, _free_bytes, _gib
from .plan import RoundPlan
from .runtime import ModelRuntime
from .step_graph import StepGraph, step_key


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerSettings(Settings):
    """What the local training reads of a run's config: the client optimiser's settings, the batch size, the ops'
    backend, whether the run is private (its update norms come from the last steps) and the step profile."""

    optimizer: OptimizerSettings
    batch_size: int
    backend: str | None
    dp_clip: float
    profile: bool
    cuda_graphs: bool


@dataclasses.dataclass(kw_only=True)
class _ChunkRun:
    """What every local step of one chunk (clients ``lo:hi``) reads, and ``masked``, which a step sets (a method's
    own ``active`` mask in its step terms)."""

    lo: int
    hi: int
    teacher: object
    loss_sum: torch.Tensor
    start: torch.Tensor
    gen: torch.Generator
    step_kw: dict
    hist: torch.Tensor
    features: object
    rule: object
    track: bool
    graph: bool = False  # the chunk's steps go through the trainer's StepGraph (cuda_graphs)
    masked: bool = False


class ChunkTrainer:
    """Owns the buffers of a chunk of ``chunk`` clients (``stack`` [chunk, P], the client optimiser's state,
    ``gradbuf``, SAM's rows made on first use) and trains the round's clients ``lo:hi`` in them
    (:meth:`train_chunk`). ``runtime``: the :class:`~fedfast.sim.runtime.ModelRuntime`; ``plan``: the
    :class:`~fedfast.sim.plan.RoundPlan` (batch tables, minibatches); ``loss_fn``: the user's loss replacing the
    method's (``Simulation(loss_fn=)``); ``row_bytes``: one client's parameter-sized buffers (the budget's)."""

    def __init__(
        self,
        settings: TrainerSettings,
        method: Method,
        runtime: ModelRuntime,
        plan: RoundPlan,
        *,
        chunk: int,
        device: torch.device,
        loss_fn=None,
        row_bytes: int = 0,
    ):
        self.settings = settings = TrainerSettings.given(settings)
        self.method, self.runtime, self.plan, self.device = method, runtime, plan, device
        self.chunk, self.loss_fn = chunk, loss_fn
        P = runtime.num_params
        free = _free_bytes(device)
        if device.type == "cuda" and chunk * row_bytes > free:
            raise OutOfMemory(
                f"client_chunk: {chunk} clients' parameter buffers need {_gib(chunk * row_bytes)} "
                f"({P} parameters x {row_bytes // (4 * P)} fp32 buffers each), {_gib(free)} is free "
                f"on {device}; set client_chunk = {max(1, int(0.8 * free // max(row_bytes, 1)))} or "
                f"lower"
            )
        self.stack = ClientStack(runtime.model, chunk, device=device, use_executor=False)
        self.stack.plan = runtime.plan  # the verified program (None: vmap)
        self.optimizer = client_optimizer(settings.optimizer, self.stack.params)  # SGD/Adam/AdamW, reset per chunk
        # the C++ and Triton client steps read autograd's per-parameter gradients in place; the CUDA backend takes
        # one flat [n, P] gradient, reused every step
        self.gradbuf = (
            None
            if ops._backend.resolve(settings.backend, device.type) in ("cpu", "triton")
            else torch.empty_like(self.stack.params)
        )
        self.sam = None  # SAM steps: the first gradient and the perturbed weights [chunk, P] (made on use)
        # a private run (dp_clip): each client's ||theta_k - start|| from its last step's own pass over the row
        self.delta_norm = torch.zeros(chunk, device=device) if settings.dp_clip else None
        self._delta_version = None  # the stack's version counter after the chunk's last step
        # (lo, hi) while a hook that may read the chunk's models runs (chunk_end, collect): client_data's window
        self.client_window: tuple[int, int] | None = None
        self.prof: dict = {}  # profile=True: seconds per part of the local steps, this round
        self._last = 0.0
        if settings.cuda_graphs and loss_fn is not None:
            raise ValueError(
                "cuda_graphs: a loss_fn's code is not known to be graph-safe; run it with cuda_graphs=False"
            )
        self.graph = StepGraph(device) if settings.cuda_graphs else None  # cuda_graphs: the chunk's captured step

    # -- timers --------------------------------------------------------------------------------------------------
    def sync(self):
        """Phase boundaries only (a few per round): makes the per-phase timers true on GPUs."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def tick(self, phase: str):
        """``profile=True``: synchronise and charge the time since the last tick to ``phase`` (local steps)."""
        if not self.settings.profile:
            return
        self.sync()
        now = time.perf_counter()
        self.prof[phase] = self.prof.get(phase, 0.0) + now - self._last
        self._last = now

    # -- phase 3 -------------------------------------------------------------------------------------------------
    def train_chunk(
        self,
        ctx: Round,
        lo: int,
        hi: int,
        teacher,
        loss_sum: torch.Tensor,
        *,
        start: torch.Tensor,
        start_buffers: torch.Tensor | None = None,
        start_rows: tuple | None = None,
        step_rows: np.ndarray | None,
        gen: torch.Generator,
    ) -> Round:
        """Local training of the round's clients ``lo:hi`` (stack order) in stack rows ``0:hi-lo``, from the global
        model ``start`` (buffers ``start_buffers``: [B] the global model's, or [hi-lo, B] each client's own;
        ``start_rows``: ``(positions [Q], rows [hi-lo, Q])``, each client's own values at those parameter positions,
        FedBN's BatchNorm weights); adds the active clients' minibatch-mean losses to ``loss_sum`` (no host sync).
        ``step_rows``: ``local_steps`` mode's row table; ``gen``: the augmentation generator. The stack's buffer
        rows hold the clients' buffers after it (BatchNorm's running statistics as their local steps left them). A
        private run's update norms come from each client's last step (:meth:`update_norms`). Returns the round's
        record with the chunk's state (what ``chunk_start`` / ``chunk_end`` returned: the chunk's ``ctx.chunk``)."""
        c, method = self.settings, self.method
        self._last = time.perf_counter()
        n, B, S = hi - lo, c.batch_size, int(ctx.steps[lo])
        self._load_start(n, start, start_buffers, start_rows)
        self.optimizer.reset(n)
        ctx = ctx.with_chunk(None)
        got = method.chunk_start(ctx, lo, hi)  # the method's own per-chunk state, the chunk's hooks' ctx.chunk
        ctx = ctx if got is None else ctx.with_chunk(got)
        run = _ChunkRun(
            lo=lo,
            hi=hi,
            teacher=teacher,
            loss_sum=loss_sum,
            start=start,
            gen=gen,
            step_kw=dict(
                lr=ctx.lr,
                weight_decay=c.optimizer.weight_decay,
                max_norm=c.optimizer.max_grad_norm or None,
                backend=c.backend,
            ),
            hist=ctx.hist[lo:hi],
            features=self.runtime.features_module() if method.needs_features else None,
            rule=self._gradient_rule(ctx),
            track=self.delta_norm is not None,
            graph=self._graph_chunk(teacher),
        )
        if run.track:  # a client without a step keeps theta = start
            self.delta_norm[:n].zero_()
        for e in range(ctx.epochs):
            rows = step_rows[lo:hi] if step_rows is not None else self.plan.batch_table(ctx, lo, hi, e, S * B)
            table = host_to_device(rows, self.device)
            for s in range(S):
                self._local_step(ctx, run, rows, table, e, s)
        self._delta_version = self.stack.params._version if run.track and not run.masked else None
        self.client_window = (lo, hi)
        try:
            new = method.chunk_end(ctx, lo, hi)
        finally:
            self.client_window = None
        return ctx if new is None else ctx.with_chunk(new)  # the chunk's state after its last step (collect reads it)

    def _load_start(self, n: int, start, start_buffers, start_rows) -> None:
        """Stack rows ``0:n`` set to the clients' starting model (see :meth:`train_chunk`)."""
        self.stack.broadcast_(start, rows=slice(0, n))
        if start_rows is not None:
            self.stack.params[:n].index_copy_(1, start_rows[0], start_rows[1].to(self.stack.params.dtype))
        if start_buffers is not None and self.runtime.num_buffers:
            self.stack.buffers[:n].copy_(start_buffers.expand(n, -1))

    def _graph_chunk(self, teacher) -> bool:
        """``cuda_graphs``: a new capture for this chunk (True), after the checks a graph needs at run time."""
        if self.graph is None:
            return False
        if teacher is not None and not isinstance(teacher, (CachedTeacher, CachedMixture)):
            raise ValueError(
                f"cuda_graphs: {self.method.name}'s teacher runs on every step's rows ({type(teacher).__name__}), "
                f"not captured as a graph; run it with cuda_graphs=False"
            )
        self.graph.reset()
        return True

    def _gradient_rule(self, ctx: Round):
        """The chunk's gradient: plain, or SAM's at the radius ``method.sam_rho(ctx)`` (checked)."""
        method = self.method
        rho = float(method.sam_rho(ctx))
        if not rho >= 0:
            raise ValueError(f"{method.name}.sam_rho: the SAM radius must be >= 0, got {rho}")
        if rho and not method.sam:
            raise ValueError(
                f"{method.name}.sam_rho: {rho:g} > 0, but the method does not declare sam = True (the "
                f"memory budget counts SAM's two extra parameter rows per client only then)"
            )
        if not rho:
            return PlainGradient()
        if self.sam is None:
            self.sam = SAMGradient(self.stack.params)
        self.sam.rho = rho
        return self.sam

    def _local_step(self, ctx: Round, run: _ChunkRun, rows: np.ndarray, table: torch.Tensor, e: int, s: int):
        """Local step ``s`` of epoch ``e`` of the chunk's active clients (those with more than ``s`` steps): the
        minibatch from the row ``table`` (``rows``: its host copy), then :meth:`_step_body` - eagerly, or through
        the chunk's CUDA graph (``cuda_graphs``: a step without padding rows whose host values match the capture's)."""
        B, steps, lo = self.settings.batch_size, ctx.steps, run.lo
        n_act = int((steps[lo : run.hi] > s).sum())
        x, y, valid, ridx = self.plan.minibatch(ctx, table, lo, n_act, e, s, run.gen)
        # BatchNorm's statistics leave padding rows out: the mask only on steps that have any (host table)
        bn_valid = valid if (rows[:n_act, s * B : (s + 1) * B] < 0).any() else None
        self.tick("data")
        if not (run.graph and bn_valid is None):
            self._step_body(ctx, run, x, y, valid, ridx, bn_valid, n_act, e, s, None)
            return
        kw = self._step_kw(ctx, run, n_act, e, s)  # graph-safe hooks: the terms do not depend on the step's loss

        def body(x, y, valid, ridx):
            self._step_body(ctx, run, x, y, valid, ridx, None, n_act, e, s, kw)

        if not self.graph.step(step_key(n_act, kw), dict(x=x, y=y, valid=valid, ridx=ridx), body):
            body(x, y, valid, ridx)  # the chunk's warm-up, or a step the capture does not fit

    def _step_body(self, ctx: Round, run: _ChunkRun, x, y, valid, ridx, bn_valid, n_act: int, e: int, s: int, kw):
        """The device work of one local step: the forward and loss, the gradient (plain or SAM's) and the client
        optimiser's fused step with the method's terms (``kw``: computed before, in a graph's step; None: asked of
        the method after the backward)."""
        B = self.settings.batch_size
        pv = self.stack.leaf_views(slice(0, n_act))  # autograd leaves sharing the stack's storage
        t = run.teacher.rows(ridx.reshape(-1), x, bn_valid) if run.teacher is not None else None
        self.tick("teacher")
        seg = torch.arange(n_act, device=self.device).repeat_interleave(B)
        batch = dict(
            x=x,
            y=y,
            valid=valid,
            seg=seg,
            teacher=t,
            hist=run.hist[:n_act],
            features=run.features,
            epoch=e,
            step=s,
            bn_valid=bn_valid,
        )
        loss = self.step_loss(ctx, pv, perturbed=False, **batch)
        if run.graph:  # one flat gradient: the pieces' block table would be a host copy inside the graph
            out = torch.empty(n_act, self.stack.P, device=self.device, dtype=self.stack.params.dtype)
        else:
            out = None if self.gradbuf is None else self.gradbuf[:n_act]
        grad = run.rule.gradient(  # plain, or SAM's (the gradient at w + rho g / ||g||, applied at w)
            self.stack,
            loss,
            pv,
            n_act,
            lambda p2: self.step_loss(ctx, p2, perturbed=True, **batch),
            out,
        )
        self.tick("backward")
        if kw is None:
            kw = self._step_kw(ctx, run, n_act, e, s)
        self.optimizer.step(self.stack.params, grad, n_act, kw)
        run.loss_sum += loss.detach()  # sum of the active clients' minibatch means (no host sync)
        self.tick("step")

    def _step_kw(self, ctx: Round, run: _ChunkRun, n_act: int, e: int, s: int) -> dict:
        """The client step's keyword arguments: the chunk's, the method's ``step_terms`` (checked) and, on a private
        run's last step of its clients, the update norms' outputs."""
        method, steps, lo = self.method, ctx.steps, run.lo
        terms = method.step_terms(ctx, n_act)
        if not isinstance(terms, dict):
            check_hook_return(
                method,
                "step_terms",
                terms,
                kind="dict",
                what="a dict of fedfast.ops.client_step keyword arguments ({} for none)",
            )
        kw = {**run.step_kw, **terms}
        # a method's own `active` mask may skip a client's last step: then the rows are measured
        run.masked = run.masked or "active" in terms
        # private: the clients whose last step this is (the active prefix's tail) get ||theta - start||
        # from the step's own pass (every active row's, so that the rows stay one prefix)
        if run.track and e == ctx.epochs - 1 and n_act and int(steps[lo + n_act - 1]) == s + 1:
            kw.update(delta_from=run.start, delta_norm=self.delta_norm[:n_act])
        return kw

    def update_norms(self, n: int) -> torch.Tensor | None:
        """The chunk's clients' ``||theta_k - start||`` [n] from their last local steps, or None when something
        wrote the rows since (the stack's version counter moved: a method's ``chunk_end``, e.g. FedADC's Nesterov
        half-step), a method masked steps itself (``active`` in its step terms) or the run is not private; then
        :func:`fedfast.ops.aggregate` measures the rows itself."""
        if self.delta_norm is None or self._delta_version != self.stack.params._version:
            return None
        return self.delta_norm[:n]

    def step_loss(
        self,
        ctx: Round,
        pv,
        *,
        x,
        y,
        valid,
        seg,
        teacher,
        hist,
        features,
        perturbed: bool,
        epoch: int,
        step: int,
        bn_valid=None,
    ):
        """The forward of the active clients with parameters ``pv`` and the method's (or ``loss_fn``'s) loss. The
        forward updates BatchNorm's running statistics in the clients' buffer rows, except SAM's second pass
        (``perturbed``), as SAM's reference implementations disable them there. ``bn_valid``: the rows that enter
        BatchNorm's batch statistics (None: every row)."""
        n_act = x.shape[0]
        out = self.stack.vmap_forward(
            x, rows=slice(0, n_act), params=pv, features=features, valid=bn_valid, update=not perturbed
        )
        feat, z = out if features is not None else (None, out)
        self.tick("forward")
        zf, yf = z.reshape(-1, z.shape[-1]), y.reshape(-1)
        if self.loss_fn is not None:
            loss = self.loss_fn(zf, teacher.logits if teacher is not None else None, yf, seg, n_act)
        else:
            loss = self.method.loss(
                ctx,
                Step(
                    logits=zf,
                    target=yf,
                    segments=seg,
                    num_clients=n_act,
                    teacher=teacher,
                    hist=hist,
                    x=x,
                    valid=valid,
                    features=feat,
                    params=pv,
                    perturbed=perturbed,
                    epoch=epoch,
                    step=step,
                    bn_valid=bn_valid,
                ),
            )
        if not (torch.is_tensor(loss) and loss.dim() == 0 and loss.is_floating_point() and loss.requires_grad):
            self._bad_loss(loss)
        self.tick("loss")
        return loss

    def _bad_loss(self, loss) -> None:
        """HookError naming the loss hook (or loss_fn), its file and line, what it must return and what it gave."""
        if self.loss_fn is not None:
            fn = inspect.unwrap(
                getattr(self.loss_fn, "__call__", self.loss_fn)  # noqa: B004 - the method (its file, line)
                if not inspect.isfunction(self.loss_fn)
                else self.loss_fn
            )
            code = getattr(fn, "__code__", None)
            where = f"loss_fn ({code.co_filename}, line {code.co_firstlineno})" if code else "loss_fn"
        else:
            where = hook_site(self.method, "loss")
        must = (
            "one number: a 0-d float tensor that depends on the logits (the sum over the active clients of "
            "each client's minibatch mean; fedfast.methods.weighted_mean_rows(rows, b.valid) makes it from "
            "per-row losses)"
        )
        if torch.is_tensor(loss) and loss.dim() == 0 and loss.is_floating_point():
            raise HookError(
                f"{where}: must return {must}; the returned value has no gradient (computed without "
                f"autograd, detached, or from no input that requires grad)"
            )
        raise HookError(f"{where}: must return {must}, got {describe_value(loss)}")

    def collect(self, method, ctx: Round, out, lo: int, hi: int):
        """``method.collect(ctx, out, lo, hi)``, with :meth:`client_data` open on the chunk while it runs."""
        self.client_window = (lo, hi)
        try:
            return method.collect(ctx, out, lo, hi)
        finally:
            self.client_window = None

    # -- what a method reads of the chunk ----------------------------------------------------------------------------
    @torch.no_grad()
    def client_data(
        self,
        ctx: Round,
        lo: int,
        hi: int,
        *,
        features: bool = False,
        batch: int | None = None,
        train_mode: bool = False,
    ):
        """The chunk's clients' models (stack rows ``0:hi-lo``, as they are now) over their own samples: every
        sample of each client once, in the partition's order, un-augmented, ``batch`` samples per client at a time
        (default ``batch_size``); yields :class:`fedfast.methods.ClientData`. Eval mode unless ``train_mode`` (the
        model's modules are in that mode during each slice's forward only); no running statistics are updated; a
        client whose data is exhausted in a slice runs on its own first samples, marked invalid (and, for BatchNorm
        statistics, kept apart from the other clients'), so every value is finite."""
        w = self.client_window
        if w is None or not (isinstance(lo, (int, np.integer)) and isinstance(hi, (int, np.integer))):
            raise RuntimeError(
                "client_data: the chunk's models are the clients' own only inside the hooks chunk_end and collect "
                "(before and after them the stack holds other clients' or the global model); call it there, with "
                "that hook's lo and hi"
            )
        if not (lo == w[0] and lo <= hi <= w[1]):  # the stack's rows 0:hi-lo are the clients lo..hi-1
            raise ValueError(
                f"client_data: lo, hi = {lo}, {hi}: the hook's chunk is clients [{w[0]}, {w[1]}) of the round; pass "
                f"its lo ({w[0]}) and an hi up to {w[1]}"
            )
        b = self.settings.batch_size if batch is None else batch
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
            raise ValueError(f"batch: samples per client and slice, an integer >= 1, got {batch!r}")
        n = hi - lo
        clients = np.asarray(ctx.sampled[lo:hi])
        sizes = self.plan.client_sizes[clients]
        rows, owner = self.plan.cohort_rows(clients)
        pos = np.arange(len(rows)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        table = np.full((n, int(sizes.max()) if n else 0), -1, dtype=np.int64)
        table[owner, pos] = rows
        feat = self.runtime.features_module() if features else None
        for s in range(0, table.shape[1], int(b)):
            part = table[:, s : s + int(b)]
            ok = part >= 0
            idx = host_to_device(np.where(ok, part, table[:, :1]), self.device)  # exhausted: own first samples
            x, y = self.runtime.train.batch(idx)
            valid = host_to_device(ok, self.device)
            # BatchNorm: each client's valid rows; an exhausted client's (unused) rows form their own statistics
            bn = None if ok.all() else host_to_device(ok | ~ok.any(1, keepdims=True), self.device)
            with contextlib.nullcontext() if train_mode else self.runtime.eval_mode():
                out = self.stack.vmap_forward(x, rows=slice(0, n), features=feat, valid=bn)
            f, z = out if features else (None, out)
            yield ClientData(
                rows=host_to_device(part, self.device),
                y=torch.where(valid, y, torch.full_like(y, -100)),
                valid=valid,
                logits=z.float(),
                features=None if f is None else f.float(),
                start=s,
            )

    def local_gradients(self, ctx: Round, lo: int, hi: int, batches, *, epoch: int, gen: torch.Generator):
        """One pass over ``batches`` [hi-lo] (non-increasing) minibatches of each of the chunk's clients, in the data
        order of local epoch ``epoch``, at their current parameters (stack rows ``0:hi-lo``): yields ``(step,
        n_act, grad)`` with ``grad`` [n_act, P] the gradient of each active client's minibatch-mean cross-entropy
        (a buffer reused by the next step). FedCurv's Fisher information. The forwards use the clients' buffer rows
        and update no running statistics (only a local step's forward does)."""
        B, C = self.settings.batch_size, self.runtime.train.num_classes
        batches = np.asarray(batches, dtype=np.int64)
        if (
            batches.shape != (hi - lo,)
            or (np.diff(batches) > 0).any()
            or (batches < 0).any()
            or (batches > ctx.data_batches[lo:hi]).any()
        ):
            raise ValueError(
                f"batches: {hi - lo} non-increasing counts within each client's minibatches per epoch, "
                f"got {batches.tolist()}"
            )
        S = int(batches[0]) if len(batches) else 0
        table = self.plan.batch_table(ctx, lo, hi, epoch, S * B)
        table[np.arange(S * B)[None, :] >= (batches * B)[:, None]] = -1
        host = table
        table = host_to_device(table, self.device)
        buf = (
            self.gradbuf
            if self.gradbuf is not None
            else torch.empty(hi - lo, self.runtime.num_params, device=self.device)
        )
        for s in range(S):
            n_act = int((batches > s).sum())
            x, y, valid, _ = self.plan.minibatch(ctx, table, lo, n_act, epoch, s, gen)
            pv = self.stack.leaf_views(slice(0, n_act))
            bn_valid = valid if (host[:n_act, s * B : (s + 1) * B] < 0).any() else None
            z = self.stack.vmap_forward(x, rows=slice(0, n_act), params=pv, valid=bn_valid).reshape(-1, C)
            seg = torch.arange(n_act, device=self.device).repeat_interleave(B)
            loss = ops.distill(
                z,
                torch.zeros_like(z.detach()),
                y.reshape(-1),
                kd_weight=0.0,
                segments=seg,
                num_segments=n_act,
                reduction="mean",
                backend=self.settings.backend,
            )
            yield s, n_act, self.stack.flat_grad(loss, pv, buf[:n_act])
