"""Batched-client simulation engine: every sampled client of a round trains at once on one device.

A :class:`Simulation` wires owned parts (``fedfast/sim``), each built and tested alone: the model runtime
(:class:`~fedfast.sim.runtime.ModelRuntime`), the round plan (:class:`~fedfast.sim.plan.RoundPlan`), the memory
budget (:class:`~fedfast.sim.sizing.MemoryBudget`), the chunk trainer (:class:`~fedfast.sim.trainer.ChunkTrainer`),
the evaluator (:class:`~fedfast.sim.evaluation.Evaluator`), the run state (:class:`~fedfast.sim.state.RunState`,
all that crosses rounds) and the view a method gets of them (:class:`~fedfast.sim.facade.EngineView`). A round is
six phases, each a short method of :class:`Simulation`:

1. **sample** (``RoundPlan.sample``): the round's clients (seeded by ``(seed, round)``, or the user's ``schedule``),
   sorted by local step count so the clients still training at any step are a prefix of the stack;
2. **teacher** (``_teacher``): the method's :class:`~fedfast.methods.TeacherSpec` becomes a per-round table of
   teacher logits for the union of the sampled clients' rows, in large batches (``teacher="cache"``; M teachers:
   their mixture), or a per-step batched forward over the augmented rows (``teacher="online"``);
3. **local training** (``ChunkTrainer.train_chunk``), per chunk of clients that fits the memory budget (usually one):
   broadcast the global model into the stack rows; per local step gather every active client's minibatch
   (``[n_active, B]`` index table, the last partial batch padded and masked with ``ignore_index``), one batched
   forward/backward over the stacked parameters (``fedfast.batched`` for Sequential models, else ``vmap``), the
   method's fused loss with per-client segments (each client's gradient is that of its own minibatch mean), the
   fused client step with the method's terms;
4. **aggregation** (``_aggregate_chunk``): the chunk's rows through the fused server update (weighted sum,
   per-client state);
5. **server** (``_server``): the method's server rule on the participants' average;
6. **evaluation** (``Evaluator.record``): test accuracy, per-class accuracy, FedNTD's forgetting.

The method (:mod:`fedfast.methods`: loss, client-step terms, server rule, state, teacher) is an object the engine
calls through its hooks; the engine never branches on a method's name and reads none of its attributes beyond
the contract of :class:`fedfast.methods.Method`. The engine's own settings are :class:`SimConfig`; a method's
options are its own table (``SimConfig(algorithm="fedntd", options={"fedntd": {"beta": 1.0}})``).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from torch import nn

from . import ops, simconfig as _simconfig
from ._deprecation import deprecated
from ._io import host_to_device
from .data.datasets import ArrayDataset
from .data.partition import Partition
from .methods.base import TeacherSpec
from .methods.hooks import check_hook_return, round_metrics
from .methods.round import Round
from .sim import collect, diverged as _diverged
from .sim.buffers import (
    RoundBuffers,
    check_teacher_spec,
    client_state_dict,
    restore_local_statistics,
)
from .sim.build import build_simulation
from .sim.evaluation import forgetting
from .sim.state import RunState
from .simconfig import SimConfig
from .store.shared import store_rows
from .teachers import OnlineTeacher, cached_teacher


class Simulation:
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

    def __init__(
        self,
        config: SimConfig,
        model: nn.Module,
        train: ArrayDataset,
        test: ArrayDataset,
        partition: Partition,
        device=None,
        val: ArrayDataset | None = None,
        process_group=None,
        loss_fn=None,
        loss_needs_teacher: bool = False,
        aux: ArrayDataset | None = None,
        schedule: Sequence | Callable | None = None,
        data_order: Callable | None = None,
        validation: ArrayDataset | None = None,
        method=None,
        state_dir: str | None = None,
    ):
        b = build_simulation(
            config,
            model,
            train,
            test,
            partition,
            device=device,
            val=val,
            process_group=process_group,
            loss_fn=loss_fn,
            loss_needs_teacher=loss_needs_teacher,
            aux=aux,
            schedule=schedule,
            data_order=data_order,
            validation=validation,
            method=method,
            state_dir=state_dir,
        )  # the parts, in their construction order (fedfast/sim/build.py)
        self.cfg = self.config = config
        self.loss_fn, self.loss_needs_teacher, self._uses_teacher = loss_fn, bool(loss_needs_teacher), b.uses_teacher
        self.method, self.model, self.comm, self.device = b.method, b.model, b.comm, b.device
        self.train, self.test, self.validation, self.server_splits = b.train, b.test, b.validation, b.server_splits
        self.plan, self.runtime, self.budget, self.evaluator = b.plan, b.runtime, b.budget, b.evaluator
        self.state, self.client_buffers, self.engine = b.state, b.client_buffers, b.engine
        self.chunk, self.trainer, self.privacy = b.chunk, b.trainer, b.privacy
        self.state.eval_flat = self._evaluated(self.runtime.initial)

    # -- the run's facts and state, read-only ----------------------------------------------------------------
    @property
    def rnd(self) -> int:
        """Rounds completed (the 0-based index of the next round)."""
        return self.state.round

    @property
    def global_flat(self) -> torch.Tensor:
        """[P] the global model (the next round's clients start from it)."""
        return self.state.global_flat

    @property
    def eval_flat(self) -> torch.Tensor:
        """[P] the evaluated model (``Method.evaluated`` of the global model)."""
        return self.state.eval_flat

    @property
    def history(self) -> list[dict]:
        """The rounds' records so far."""
        return self.state.history

    @property
    def num_clients(self) -> int:
        return self.plan.num_clients

    K = num_clients

    @property
    def num_params(self) -> int:
        return self.runtime.num_params

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    # -- phase 2: teacher ------------------------------------------------------------------------------------
    def _teacher(self, ctx: Round):
        """The round's teacher: None, a table made once (:func:`fedfast.teachers.cached_teacher`), or run on every
        step's rows (:class:`fedfast.teachers.OnlineTeacher`)."""
        if self.loss_fn is not None:
            spec = TeacherSpec.of(self.global_flat) if self.loss_needs_teacher else None
        else:
            spec = self.method.teacher(ctx)
        if spec is None or not len(ctx.sampled):
            return None
        check_teacher_spec(spec, self.runtime.num_buffers, self.method)
        if self.cfg.teacher == "online":
            return OnlineTeacher(spec, self.engine)
        idx = host_to_device(self.plan.cohort_rows(ctx.sampled)[0], self.device)
        dt = torch.bfloat16 if self.cfg.teacher_cache_dtype == "bfloat16" else torch.float32
        return cached_teacher(spec, self.runtime.predict, self.train, idx, backend=self.cfg.backend, dtype=dt)

    # -- one round -------------------------------------------------------------------------------------------
    def round(self) -> dict:
        """One round: sample, teacher, local training and aggregation per chunk, server rule, evaluation."""
        t0 = time.perf_counter()
        timers = {}
        st = self.state
        ctx, totals, step_rows = self.plan.sample(st.round)
        # the round's accumulators (the engine's RoundSums: the increment, the new state rows, the sums round_start
        # declares), read by the method through the record (a new one: nothing writes a Round)
        ctx = collect.open_round(self.method, ctx, self.method.client_state, torch.zeros_like(self.global_flat))
        self.privacy.begin_round(ctx)  # private: the round's clip (refusing what the mechanism does not cover)
        t1 = time.perf_counter()
        with self._memory("the teacher's logits (eval_batch rows at a time)", "eval_batch"):
            teacher = self._teacher(ctx)
            self.trainer.sync()
        timers["teacher"] = time.perf_counter() - t1
        with self._memory(f"local training of a chunk of {self.chunk} clients", "client_chunk"):
            avg_sum, loss_sum, bufs, t_local, t_agg = self._local(ctx, teacher, step_rows)
        t1 = time.perf_counter()
        try:
            self._server(ctx, avg_sum, loss_sum, totals["weight"], bufs)
        except ops.NonFiniteUpdate:
            raise _diverged.Diverged(st.round + 1, self.method.name, "the server update", self.cfg) from None
        timers["local"], timers["aggregate"] = t_local, t_agg + time.perf_counter() - t1
        timers.update({f"local.{k}": v for k, v in self.trainer.prof.items()})
        method_metrics = round_metrics(self.method, ctx)
        t1 = time.perf_counter()
        st.round += 1  # the only place the round advances (restore replaces the state with a checkpoint's)
        with self._memory("evaluation (eval_batch rows at a time)", "eval_batch"):
            rec, class_acc = self.evaluator.record(
                st.round,
                st.eval_flat,
                st.history,
                st.class_acc,
                totals,
                loss_sum,
                timers,
                t1,
                chunk=self.chunk,
                method_metrics=method_metrics,
            )
        self.privacy.record(rec, st.round)  # private: the budget spent so far (on the host), the clip used
        self.runtime.load_into_model(st.eval_flat)
        if class_acc is not None:
            st.class_acc.append(class_acc)
        rec["seconds"] = time.perf_counter() - t0
        train_loss = rec["train_loss"]
        rec = self.privacy.publish(rec)  # private: without what the accounting does not cover
        st.history.append(rec)
        _diverged.check_finite(rec, self.state, self.method.name, self.cfg, train_loss=train_loss)
        return rec

    # -- phases 3-4: local training and aggregation, chunk by chunk ------------------------------------------
    def _local(self, ctx: Round, teacher, step_rows):
        m = len(ctx.sampled)
        weights = host_to_device(ctx.weights, self.device, torch.float32)
        tr = self.trainer
        tr.sync()
        t_local = t_agg = 0.0
        avg_sum = torch.zeros_like(self.global_flat)
        loss_sum = torch.zeros((), device=self.device)
        bufs = RoundBuffers(
            self.runtime, m, self.device, self.client_buffers, ctx.sampled, self.cfg.bn_stats, self.cfg.bn_params
        )
        tr.prof = {}
        for lo in range(0, m, self.chunk):  # usually a single chunk (an empty rank: none)
            hi = min(m, lo + self.chunk)
            t1 = time.perf_counter()
            chunk = tr.train_chunk(  # the round's record with the chunk's state (the method's chunk_start's)
                ctx,
                lo,
                hi,
                teacher,
                loss_sum,
                start=self.global_flat,
                start_buffers=bufs.start(lo, hi, self.state.global_buffers),
                start_rows=bufs.start_params(lo, hi),  # bn_params = "local": each client's own BatchNorm weights
                step_rows=step_rows,
                gen=self.state.augment,
            )
            tr.sync()
            t_local += time.perf_counter() - t1
            t1 = time.perf_counter()
            avg_sum += self._aggregate_chunk(chunk, lo, hi, weights)
            bufs.add(lo, hi, weights, tr.stack)
            t_agg += time.perf_counter() - t1
        return avg_sum, loss_sum, bufs, t_local, t_agg

    def _aggregate_chunk(self, ctx: Round, lo: int, hi: int, weights: torch.Tensor) -> torch.Tensor:
        """The chunk's rows through the fused server update: returns their weighted sum [P]."""
        extra = self.method.chunk_aggregate(ctx, lo, hi)
        if not isinstance(extra, dict):
            check_hook_return(
                self.method,
                "chunk_aggregate",
                extra,
                kind="dict",
                what="a dict of fedfast.ops.aggregate keyword arguments ({} for none)",
            )
        # the mechanism's bound step (private: the clipping factors as the weights, from the norms of the last steps,
        # joint with the clients' declared uploads)
        w = weights[lo:hi]
        ups = self.privacy.upload_rows(self.method, ctx, lo, hi)
        norms = self.trainer.update_norms(hi - lo)
        agg = dict(
            rows=hi - lo,
            backend=self.cfg.backend,
            **self.privacy.bound(extra, w, norms, ups, self.trainer.stack.params, self.global_flat),
        )
        try:
            out = ops.aggregate(self.trainer.stack.params, self.global_flat, **agg)
        except ops.NonFiniteUpdate as e:
            who = [int(ctx.sampled[lo + r]) for r in e.rows]
            if self.comm.world == 1:
                what = f"the update of client(s) {who}" if who else "the clients' weighted average"
                raise _diverged.Diverged(self.state.round + 1, self.method.name, what, self.cfg) from None
            # the other ranks are in this round's all-reduce: poison the sum, so every rank sees a non-finite
            # global model after it and stops at the same round
            return torch.full_like(self.global_flat, float("nan"))
        got = self.trainer.collect(self.method, ctx, out, lo, hi)  # (client_data valid inside)
        collect.take(self.method, ctx.accumulators, got, lo, hi)
        self.privacy.check_collected(got)  # private: what the method sums must be its declared uploads
        # the chunk's weighted sum (private: its clipped sum / E; the noise is added once, in _server)
        return self.privacy.chunk_sum(out, w, self.global_flat)

    # -- phase 5: server ---------------------------------------------------------------------------------------
    def _server(self, ctx: Round, avg_sum, loss_sum, total_w: float, bufs: RoundBuffers):
        # sums over all ranks' clients; every rank learns every updated client's state row (one process: as is)
        self.comm.sum_(
            avg_sum,
            ctx.increment,
            loss_sum,
            *(ctx.sums[k] for k in sorted(ctx.sums)),
            *self.privacy.round_sums(),
            *([bufs.sum] if bufs.sum.numel() else []),
        )
        for st, rows in ((self.method.client_state, ctx.state_out), (self.client_buffers, bufs.rows)):
            if rows is not None:
                with self._memory(
                    f"the per-client state store (rows of {st.written} clients, {st.cols} values "
                    f"each, growing with the clients trained)",
                    "state_dtype",
                ):
                    store_rows(self.comm, st, ctx.sampled_t, rows)
        # the mechanism's noise step (not private: the weighted average); None: no client, the global model stays
        avg = self.privacy.average(self.global_flat, avg_sum, total_w, ctx)
        if avg is None:
            return
        collect.release(
            ctx.accumulators, self.privacy.released()
        )  # private: the noised upload sums the server rule reads
        if bufs.sum.numel():  # the global model's buffers: the participants' weighted average (integers rounded)
            self.state.global_buffers = self.runtime.buffers = bufs.average(total_w)
        new = self.method.server(ctx, avg)
        P = tuple(self.global_flat.shape)
        check_hook_return(
            self.method,
            "server",
            new,
            shape=P,
            device=self.device,
            what=f"the new global model, a float tensor [P] = {P} on {self.device}",
        )
        self.state.global_flat = new
        self.state.eval_flat = self._evaluated(new)
        if self.device.type != "cpu":  # the ops' deferred (no-sync) input checks of this round: one read
            ops.raise_if_invalid(self.device)

    def _evaluated(self, flat: torch.Tensor) -> torch.Tensor:
        """The model the method has evaluated (``Method.evaluated``), checked: a float tensor [P] on the device."""
        out = self.method.evaluated(flat)
        P = tuple(self.global_flat.shape)
        check_hook_return(
            self.method,
            "evaluated",
            out,
            shape=P,
            device=self.device,
            what=f"the model to evaluate, a float tensor [P] = {P} on {self.device}",
        )
        return out

    def _memory(self, what: str, key: str):
        """An allocation failure inside the block becomes :class:`OutOfMemory` naming ``what`` and ``key``."""
        return self.budget.guard(what, key, next_round=self.state.round + 1, chunk=self.chunk)

    # -- what a user reads and runs --------------------------------------------------------------------------
    def run(self) -> list[dict]:
        """The remaining rounds (``config.rounds`` in all); returns the history of per-round metrics."""
        for _ in range(self.cfg.rounds - self.state.round):
            self.round()
        return self.history

    def predict(
        self,
        flat: torch.Tensor,
        dataset: ArrayDataset,
        idx: torch.Tensor | None = None,
        dtype=torch.float32,
        buffers: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of the model ``flat`` (``buffers``: its BatchNorm statistics, default the global model's) on rows
        ``idx`` of ``dataset`` (default all), in large batches, eval mode."""
        return self.runtime.predict(flat, dataset, idx, dtype, buffers)

    def evaluate(self, dataset: ArrayDataset | None = None) -> tuple[float, float, torch.Tensor]:
        """Accuracy, mean loss and per-class accuracy [C] of the evaluated model (the method's ``evaluated``: the
        global model; FedDyn: the participants' average, not the cloud model) on ``dataset`` (default the test
        set). Under torch.distributed each rank evaluates its share and the sums are all-reduced."""
        return self.evaluator.evaluate(self.state.eval_flat, dataset)

    def forgetting(self) -> float | None:
        """FedNTD's forgetting over the rounds evaluated so far (:func:`fedfast.sim.evaluation.forgetting`)."""
        return forgetting(self.state.class_acc)

    def _shape(self) -> dict:
        return {"num_params": self.num_params, "num_clients": self.num_clients, "num_classes": self.num_classes}

    @property
    def stores(self) -> list:
        """The run's per-client stores (ClientState): the method's, the clients' BatchNorm statistics (local)."""
        return [st for st in (self.method.client_state, self.client_buffers) if st is not None]

    def checkpoint(self) -> dict:
        """Everything the next rounds depend on, as plain data (tensors on the CPU): the run state (global and
        evaluated models and buffers, round, metrics so far, generators), the method's state and the clients'
        own BatchNorm statistics (``bn_stats = "local"``). :meth:`restore` on a Simulation built with the same
        config and data continues bit for bit (CPU)."""
        ck = self.state.checkpoint(self.method.state_dict(), self._shape())
        ck.update(self.privacy.checkpoint(self.state.round))
        return {**ck, "client_buffers": self.client_buffers.state_dict()} if self.client_buffers is not None else ck

    def restore(self, ck: dict) -> None:
        """Continue from :meth:`checkpoint`; ValueError if it does not fit this simulation."""
        RunState.check(ck, self._shape())
        self.privacy.restore(ck, self.cfg.rounds)
        restore_local_statistics(self.client_buffers, ck, self.cfg.bn_stats, self.cfg.bn_params)
        self.method.load_state_dict(ck["method"])
        self.state.restore_(ck)  # in place: the method's view holds this state
        self.runtime.buffers = self.state.global_buffers
        self.runtime.load_into_model(self.state.eval_flat)

    def state_dict(self, client: int | None = None) -> dict:
        """The evaluated global model as a ``state_dict`` of ``model`` (copies): ``model.load_state_dict(...)``.
        ``client=k``: the model client k starts its next round from (the global model with its own BatchNorm weights
        and statistics where ``bn_params`` / ``bn_stats`` keep them local: FedBN's per-client model, to evaluate on
        that client's own data); the model passed in is left as it is then."""
        return (
            self.runtime.state_dict(self.state.eval_flat)
            if client is None
            else client_state_dict(
                self.runtime,
                self.cfg.bn_stats,
                self.cfg.bn_params,
                self.client_buffers,
                self.global_flat,
                self.state.global_buffers,
                self.num_clients,
                client,
            )
        )


__all__ = ["Simulation"]


def __getattr__(name: str):
    """Names that moved from here (``fedfast.engine.Diverged``: to :mod:`fedfast.sim.diverged`, ``fedfast.Diverged``
    unchanged; ``check_device``: :mod:`fedfast.simconfig`); the old address works for one release, with a
    DeprecationWarning naming the new one."""
    moved = {
        "Diverged": (_diverged.Diverged, "fedfast.sim.diverged.Diverged (or use fedfast.Diverged)"),
        "check_device": (_simconfig.check_device, "fedfast.simconfig.check_device"),
    }
    if name in moved:
        value, home = moved[name]
        deprecated(f"fedfast.engine.{name} moved to {home}; the old address goes in the next release")
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
