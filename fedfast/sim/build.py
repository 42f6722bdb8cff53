"""A :class:`fedfast.Simulation`'s construction order, as one builder (issue 61): the method and the model it trains,
the inputs checked, the device and the data placed, the run's secret, the parts - each given the settings it reads -,
the method bound to its view of them (its state declared, the chunk sized, the trainer made, the state allocated,
``setup``), then the privacy mechanism. ``Simulation.__init__`` keeps the :class:`Parts` it returns.

The builder is the one module of ``fedfast/sim`` besides the method's view (``facade.py``) that reads the whole
config: it is where the config becomes each part's settings (``PartSettings.of(config)``); no part keeps it."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Sequence

import torch
from torch import nn

from .. import methods as _methods, privacy
from ..collectives import collectives
from ..cpu_alloc import tune_cpu_allocator
from ..data.datasets import ArrayDataset
from ..data.partition import Partition
from ..flat import find_classifier
from ..methods.base import Method
from ..methods.hooks import HookError, hook_site
from ..simconfig import SimConfig, check_device
from .buffers import check_batch_norm, check_cross_sample, local_statistics_store
from .evaluation import EvalSettings, Evaluator
from .facade import EngineView, bind_method
from .inputs import check_inputs
from .own_model import check_module
from .plan import PlanSettings, RoundPlan
from .runtime import ModelRuntime, RuntimeSettings, probe_batch
from .sizing import BudgetSettings, MemoryBudget
from .state import RunState
from .stores import StateStores, StoreSettings
from .trainer import ChunkTrainer, TrainerSettings


@dataclasses.dataclass(kw_only=True)
class Parts:
    """What a Simulation is made of, in the order it is built."""

    method: Method
    model: nn.Module  # the model the clients train (a method's prepare_model may have made it)
    comm: object  # the run's collectives (one process, or torch.distributed)
    device: torch.device
    train: ArrayDataset
    test: ArrayDataset
    validation: ArrayDataset | None
    server_splits: dict  # the server-held splits a method asked for ("val", "aux"), on the device
    plan: RoundPlan
    runtime: ModelRuntime
    budget: MemoryBudget
    evaluator: Evaluator
    state: RunState
    client_buffers: object  # each client's own BatchNorm statistics / weights (FedBN), or None
    engine: EngineView
    chunk: int
    trainer: ChunkTrainer
    uses_teacher: bool
    privacy: object  # the privacy mechanism (fedfast.privacy), NoPrivacy without dp_clip


def method_and_model(config: SimConfig, model: nn.Module, method, train) -> tuple:
    """``(method, model it trains, whether the classifier is needed)``: the method instance (``method``: one built
    from this config already, else a new one), the classifier found on the user's model before ``prepare_model``
    (MOON's projection head replaces it), the model ``prepare_model`` returns, and the method's caveats warned."""
    if not isinstance(config, SimConfig):
        raise TypeError(f"config: expected a fedfast.SimConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    check_module(model)
    if method is not None and (
        type(method) is not _methods.get(config.algorithm) or method.options() != config.method_options()
    ):
        raise ValueError(
            f"method: a {type(method).__name__} with other options than config's "
            f"{config.algorithm!r}; build it with config.method()"
        )
    method = method if method is not None else config.method()
    eager = method.needs_features or method.needs_classifier or config.features_layer is not None
    if eager and isinstance(train, ArrayDataset):
        method.classifier_name = find_classifier(model, probe_batch(model, train), config.features_layer)
    prepared = method.prepare_model(model, config.seed)
    if not isinstance(prepared, nn.Module):
        raise HookError(
            f"{hook_site(method, 'prepare_model')}: must return an nn.Module, got {type(prepared).__name__}"
        )
    for msg in method.check_settings(config, prepared):  # settings the method is known to fail under (caveats)
        warnings.warn(f"{config.algorithm}: {msg}", RuntimeWarning, stacklevel=4)  # the Simulation's caller
    return method, prepared, eager


def run_device(config: SimConfig, device, model: nn.Module) -> torch.device:
    """The run's device: ``device`` (checked), else the model's; the CPU allocator tuned where the config says."""
    if device is not None:
        check_device(str(device))
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if config.tune_cpu_allocator and device.type == "cpu":
        tune_cpu_allocator()
    return device


def bound(config: SimConfig, method: Method, view: EngineView, parts: tuple, comm, loss_fn) -> tuple:
    """``(chunk, trainer)``: the method bound to its view (:func:`~fedfast.sim.facade.bind_method`), the chunk sized
    by ``client_chunk`` or the budget (at most this rank's share of the largest cohort), its trainer made under the
    memory guard. ``parts``: ``(runtime, plan, budget, stores)``."""
    rt, plan, budget, stores = parts
    per_rank = -(-plan.max_cohort() // comm.world)

    def make_trainer(n: int) -> ChunkTrainer:
        with budget.guard(
            f"allocating the parameter buffers of a chunk of {n} clients", "client_chunk", next_round=1, chunk=n
        ):
            return ChunkTrainer(
                TrainerSettings.of(config),
                method,
                rt,
                plan,
                chunk=n,
                device=view.device,
                loss_fn=loss_fn,
                row_bytes=budget.client_bytes()[0],
            )

    size = lambda: max(1, min(per_rank, config.client_chunk or budget.auto_chunk()))  # noqa: E731
    return bind_method(method, view, budget, stores, size, make_trainer)


def checked_keys(config: SimConfig) -> dict:
    """The config keys :func:`~fedfast.sim.inputs.check_inputs` checks the inputs against."""
    return dict(client_sampling=config.client_sampling, augment=config.augment)


def round_plan(config: SimConfig, train, partition, method, device, comm, order: tuple, private: tuple) -> RoundPlan:
    """The round plan of this rank. ``order``: ``(schedule, data_order)``; ``private``: ``(privacy settings, the
    run's secret)`` - a private run's secret (OS entropy, rank 0's on every rank) draws its noise, never the run
    seed, and its cohorts too where the mechanism assumes them secret (DP-FedAvg's sampling amplification)."""
    dp_settings, secret = private
    return RoundPlan(
        PlanSettings.of(config),
        train,
        partition,
        method,
        device=device,
        rank=comm.rank,
        world=comm.world,
        schedule=order[0],
        data_order=order[1],
        cohort_secret=secret if privacy.secret_cohorts(dp_settings) else None,
    )


def sized_stores(config: SimConfig, method: Method, rt: ModelRuntime, plan: RoundPlan, device, state_dir) -> tuple:
    """``(budget, stores)``: the memory budget (it sizes the chunk) and the per-client state stores (the method's,
    FedBN's), built from their own settings."""
    budget = MemoryBudget(BudgetSettings.of(config), method, rt, device)
    stores = StateStores(
        StoreSettings.of(config),
        device,
        params=rt.num_params,
        guard=budget.guard,
        owner=method.name,
        state_dir=state_dir,
        max_cohort=plan.max_cohort(),
    )
    return budget, stores


def teacher_use(config: SimConfig, method: Method, rt: ModelRuntime, plan: RoundPlan, loss_fn, needs: bool) -> bool:
    """Whether the local steps read a teacher (the method's word, or ``loss_needs_teacher`` with a ``loss_fn``),
    checked against the augmentation (cached logits would ignore it) and the model's BatchNorm layers."""
    uses_teacher = bool(needs) if loss_fn is not None else method.uses_teacher()
    if uses_teacher and config.teacher == "cache" and config.augment != "none":
        raise ValueError("teacher: cached teacher logits would ignore the augmentation; use teacher='online'")
    c = config
    check_batch_norm(rt, plan, uses_teacher, teacher=c.teacher, batch_size=c.batch_size, drop_last=c.drop_last)
    check_cross_sample(rt, plan, batch_size=c.batch_size, drop_last=c.drop_last)
    return uses_teacher


def build_simulation(
    config: SimConfig,
    model: nn.Module,
    train: ArrayDataset,
    test: ArrayDataset,
    partition: Partition,
    *,
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
) -> Parts:
    """The parts of a Simulation of ``config`` (its arguments: :class:`fedfast.Simulation`'s), built in order."""
    c = config
    method, prepared, eager = method_and_model(c, model, method, train)
    datasets = (("train", train), ("test", test), ("val", val), ("aux", aux), ("validation", validation))
    check_inputs(prepared, datasets, partition, loss_fn, schedule, data_order, **checked_keys(c))
    comm = collectives(process_group)  # one process, or torch.distributed (the clients split between the ranks)
    device = run_device(c, device, prepared)
    trained = prepared.to(device)
    train, test = train.to(device), test.to(device)
    dp_settings = privacy.PrivacySettings.of(c)  # a private run's secret: its noise, maybe its cohorts (round_plan)
    secret = privacy.run_secret(dp_settings, comm.broadcast_, device)
    plan = round_plan(c, train, partition, method, device, comm, (schedule, data_order), (dp_settings, secret))
    rt = ModelRuntime(RuntimeSettings.of(c), trained, train, device)
    if eager:  # on the model prepare_model made (MOON's head: the new classifier); the same model: found before
        found = getattr(method, "classifier_name", None)
        rt.classifier_name = found if found is not None and prepared is model else rt.find_classifier(found)
    budget, stores = sized_stores(c, method, rt, plan, device, state_dir)
    validation = validation.to(device) if validation is not None else None
    server_splits = {k: v.to(device) for k, v in (("val", val), ("aux", aux)) if v is not None}
    state = RunState.start(rt.initial, rt.initial, c.seed, rt.initial_buffers)
    client_buffers = local_statistics_store(c.bn_stats, c.bn_params, rt, stores, plan.num_clients)  # FedBN's
    # all a method may touch of the engine: the parts; the method declares its per-client state to it, the chunk is
    # sized with that, the trainer made, the state allocated, then the method bound (setup)
    view = EngineView(
        c, runtime=rt, plan=plan, stores=stores, state=state, train=train, server_splits=server_splits, device=device
    )
    chunk, trainer = bound(c, method, view, (rt, plan, budget, stores), comm, loss_fn)
    uses_teacher = teacher_use(c, method, rt, plan, loss_fn, loss_needs_teacher)
    # the privacy mechanism (fedfast.privacy): DP-FedAvg or DP-FTRL under dp_clip, else NoPrivacy; called alike
    kw = dict(schedule=schedule, cohorts=plan.clients, device=device, secret=secret, method=method)
    mechanism = privacy.mechanism(dp_settings, num_clients=plan.num_clients, num_buffers=rt.num_buffers, **kw)
    return Parts(
        method=method,
        model=trained,
        comm=comm,
        device=device,
        train=train,
        test=test,
        validation=validation,
        server_splits=server_splits,
        plan=plan,
        runtime=rt,
        budget=budget,
        evaluator=Evaluator(EvalSettings.of(c), rt, comm, test, validation),
        state=state,
        client_buffers=client_buffers,
        engine=view,
        chunk=chunk,
        trainer=trainer,
        uses_teacher=uses_teacher,
        privacy=mechanism,
    )
