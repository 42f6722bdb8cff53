"""The model's buffers in a round (BatchNorm's running statistics): where each chunk's clients start, the
participants' weighted sum and, under ``bn_stats = "local"`` / ``bn_params = "local"`` (FedBN), their own rows; the
store of the clients' own statistics and BatchNorm weights; and the checks a BatchNorm model gets when a run is
built (``docs/engine.md``, "BatchNorm")."""

from __future__ import annotations

import collections
import copy
import warnings

import numpy as np
import torch
from torch import nn

from ..methods.base import Method, TeacherSpec
from ..methods.hooks import HookError, hook_site
from ..store.state import ClientState
from .own_model import cross_sample
from .plan import RoundPlan
from .runtime import ModelRuntime
from .stores import StateStores


def bn_param_index(runtime: ModelRuntime) -> torch.Tensor:
    """[Q] int64: the positions of the BatchNorm layers' weights and biases in the flat parameter vector (layout
    order), for ``bn_params = "local"``."""
    names = {
        f"{mod}.{p}" if mod else p
        for mod, m in runtime.model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for p, v in (("weight", m.weight), ("bias", m.bias))
        if v is not None
    }
    parts = [torch.arange(s.offset, s.offset + s.numel) for s in runtime.layout.params if s.name in names]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


class RoundBuffers:
    """A round's model buffers and FedBN's local columns: where each chunk's clients start (the global model's
    buffers, or under ``bn_stats = "local"`` each client's own; under ``bn_params = "local"`` each client's own
    BatchNorm weights at :func:`bn_param_index`'s positions), gathered from ``store`` (rows ``[buffers | BatchNorm
    weights]``, the parts the settings keep local), the participants' buffer sum ``sum`` [B] (float64) and, with a
    store, their new rows ``rows`` [m, cols]."""

    def __init__(
        self,
        runtime: ModelRuntime,
        m: int,
        device: torch.device,
        store: ClientState | None,
        sampled: np.ndarray,
        bn_stats: str = "global",
        bn_params: str = "global",
    ):
        layout = runtime.layout
        B = layout.B
        self.layout, self.sum = layout, torch.zeros(B, dtype=torch.float64, device=device)
        self.nb = B if bn_stats == "local" else 0  # the store's leading buffer columns
        self.idx = bn_param_index(runtime).to(device) if bn_params == "local" else None
        self.own = store.gather(sampled) if store is not None and store.cols else None
        self.rows = torch.empty(m, store.cols, device=device) if self.own is not None else None

    def start(self, lo: int, hi: int, global_buffers: torch.Tensor) -> torch.Tensor:
        return self.own[lo:hi, : self.nb] if self.own is not None and self.nb else global_buffers

    def start_params(self, lo: int, hi: int):
        """``(positions, rows [hi-lo, Q])``: the chunk's clients' own BatchNorm weights, or None."""
        return None if self.idx is None else (self.idx, self.own[lo:hi, self.nb :])

    def add(self, lo: int, hi: int, weights: torch.Tensor, stack) -> None:
        """The chunk's clients' buffers (stack rows ``0:hi-lo``) into the weighted sum, and their local columns into
        the new rows."""
        n = hi - lo
        if self.sum.numel():
            self.sum += (weights[lo:hi, None].double() * stack.buffers[:n].double()).sum(0)
        if self.rows is not None:
            if self.nb:
                self.rows[lo:hi, : self.nb] = stack.buffers[:n]
            if self.idx is not None:
                self.rows[lo:hi, self.nb :] = stack.params[:n].index_select(1, self.idx)

    def average(self, total_weight: float) -> torch.Tensor:
        """[B] float32: the participants' weighted average (after the sum is all-reduced), integer buffers
        (``num_batches_tracked``) rounded to the nearest."""
        b = self.sum / total_weight
        return torch.where(self.layout.integer_mask(b.device), b.round(), b).float()


def local_statistics_store(bn_stats: str, bn_params: str, runtime: ModelRuntime, stores: StateStores, num_clients: int):
    """FedBN's per-client store (None when nothing is local): rows of the model's buffers under ``bn_stats =
    "local"`` (``runtime.num_buffers`` values, FedBN's statistics), then its BatchNorm weights and biases under
    ``bn_params = "local"``; float32 whatever ``state_dtype`` says, the initial model's as a client's first row.
    ValueError naming the setting for a model without running statistics, or without affine BatchNorm layers."""
    stats, params = bn_stats == "local", bn_params == "local"
    if not (stats or params):
        return None
    if stats and not runtime.running_stats:
        raise ValueError(
            "bn_stats: 'local' keeps each client's BatchNorm running statistics, but the model has no "
            "BatchNorm layer that tracks them (track_running_stats=True)"
        )
    idx = bn_param_index(runtime) if params else None
    if params and not idx.numel():
        raise ValueError(
            "bn_params: 'local' keeps each client's BatchNorm weights and biases, but the model has no BatchNorm "
            "layer with them (affine=True)"
        )
    init = torch.cat(
        ([runtime.initial_buffers.float()] if stats else [])
        + ([runtime.initial[idx.to(runtime.initial.device)].float()] if params else [])
    )
    return stores.client_state(num_clients, init, cols=init.numel(), name="client-buffers", float32=True)


def client_state_dict(
    runtime: ModelRuntime,
    bn_stats: str,
    bn_params: str,
    store: ClientState | None,
    global_flat: torch.Tensor,
    global_buffers: torch.Tensor,
    num_clients: int,
    client: int,
) -> dict:
    """``state_dict`` of the model client ``client`` starts its next round from: the global model's parameters
    (``global_flat``) and buffers, with the client's own BatchNorm statistics (``bn_stats = "local"``) and weights
    and biases (``bn_params = "local"``) from ``store`` where it keeps them (before its first round: the initial
    model's). Copies; the model is not touched. ValueError naming ``client`` for an id outside the population."""
    if isinstance(client, bool) or not isinstance(client, (int, np.integer)) or not 0 <= client < num_clients:
        raise ValueError(f"client: a client id in [0, {num_clients}), got {client!r}")
    flat, buffers = global_flat.detach().clone(), global_buffers.detach().clone()
    if store is not None:
        row = store.gather(np.array([int(client)]))[0].to(flat.device)
        nb = runtime.layout.B if bn_stats == "local" else 0
        if nb:
            buffers = row[:nb].to(buffers.dtype)
        if bn_params == "local":
            flat[bn_param_index(runtime).to(flat.device)] = row[nb:].to(flat.dtype)
    out = dict(runtime.layout.param_views(flat))
    out.update(runtime.layout.buffer_views(buffers))
    ref = runtime.model.state_dict()
    for k, v in ref.items():  # a buffer the layout does not carry stays the model's
        src = out.get(k, v)
        out[k] = (src.round() if not v.is_floating_point() else src).to(v.dtype).reshape(v.shape).clone()
    sd = collections.OrderedDict((k, out[k]) for k in ref)
    sd._metadata = copy.deepcopy(getattr(ref, "_metadata", {}))  # module versions: load_state_dict reads them
    return sd


def restore_local_statistics(store: ClientState | None, ck: dict, bn_stats: str, bn_params: str) -> None:
    """The clients' own BatchNorm rows from checkpoint ``ck`` into ``store``; ValueError when the checkpoint was made
    under other ``bn_stats`` / ``bn_params``."""
    saved = ck.get("client_buffers")
    cols = None
    if isinstance(saved, dict) and torch.is_tensor(saved.get("init")):
        cols = int(saved["init"].numel())
    elif torch.is_tensor(saved):
        cols = int(saved.shape[-1])
    if (store is None) != (saved is None) or (store is not None and cols is not None and cols != store.cols):
        raise ValueError(
            f"checkpoint: {'holds' if saved is not None else 'holds no'} per-client BatchNorm rows"
            f"{f' of {cols} values' if cols is not None else ''}, this run has bn_stats = {bn_stats!r}, "
            f"bn_params = {bn_params!r}" + (f" ({store.cols} values per client)" if store is not None else "")
        )
    if store is not None:
        store.load_state_dict(saved)


def check_teacher_spec(spec, num_buffers: int, method: Method) -> None:
    """What a method's ``teacher`` returned (not None): a :class:`~fedfast.methods.TeacherSpec` whose ``buffers``
    are None or [M, B] (each teacher's buffers); HookError naming the hook."""
    if not isinstance(spec, TeacherSpec):
        raise HookError(
            f"{hook_site(method, 'teacher')}: must return a fedfast.methods.TeacherSpec or None, "
            f"got {type(spec).__name__}"
        )
    if spec.buffers is not None and tuple(spec.buffers.shape) != (len(spec.models), num_buffers):
        raise HookError(
            f"{hook_site(method, 'teacher')}: TeacherSpec.buffers must be [M, B] = [{len(spec.models)}, "
            f"{num_buffers}] (each teacher's buffers), got {tuple(spec.buffers.shape)}"
        )


def check_cross_sample(runtime: ModelRuntime, plan: RoundPlan, *, batch_size: int, drop_last: bool) -> None:
    """A model whose training output for a sample depends on the other rows of its minibatch or on its size (other
    than through BatchNorm: :func:`fedfast.sim.own_model.cross_sample`, probed on a full minibatch against the rows
    of the run's first partial one) is refused, naming the layer, where a client's last minibatch is partial: the
    engine pads it and such a model would see the padding. With full minibatches only (``drop_last``, or every
    client's data a multiple of the batch) the batched forward equals a loop's."""
    sizes = plan.client_sizes
    rest = sizes % batch_size
    short = np.flatnonzero(rest != 0) if not drop_last else []
    if not len(short):
        return
    kinds = np.unique(rest[short])  # the partial minibatches' sizes: up to 8 of them, spread, the smallest first
    kinds = kinds[np.unique(np.linspace(0, len(kinds) - 1, min(8, len(kinds))).round().astype(int))]
    x, _ = runtime.train.batch(torch.arange(batch_size, device=runtime.device) % len(runtime.train))
    why, rows = cross_sample(runtime.model, x, kinds)
    if why:
        k = int(short[rest[short] == rows][0])
        raise ValueError(
            f"model: {why} makes a sample's training output depend on the other rows of its minibatch or on the "
            f"minibatch's size (only BatchNorm may: the engine leaves the padding out of its statistics); client {k}'s "
            f"last minibatch is partial ({rows} of batch_size {batch_size}) and the engine pads it to the full size, "
            f"which this model would see: set drop_last = true, or make each sample's output depend on it alone"
        )


def check_batch_norm(
    runtime: ModelRuntime, plan: RoundPlan, uses_teacher: bool, *, teacher: str | None, batch_size: int, drop_last: bool
) -> None:
    """Where a model that normalises with batch statistics cannot equal a per-client loop: a warning (a cached
    teacher of a model that uses batch statistics in eval mode too) or a refusal naming the setting (a BatchNorm
    that would normalise one value per channel in a last minibatch of one sample). Padding rows never enter a
    client's statistics: the executors mask them. ``teacher``, ``batch_size``, ``drop_last``: the run's settings."""
    bns = [m for m in runtime.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return
    if uses_teacher and teacher == "cache" and any(m.running_mean is None for m in bns):
        warnings.warn(
            "teacher: the model normalises with batch statistics in eval mode too (BatchNorm with "
            "track_running_stats=False), so cached teacher logits (computed in large evaluation batches) "
            "differ from a per-client loop's teacher; teacher='online' runs the teacher on each client's "
            "own batch.",
            stacklevel=4,
        )
    single = [n for n, S in runtime.batch_norm_positions().items() if S == 1]  # one value per sample
    B, sizes = batch_size, plan.client_sizes
    lone = np.flatnonzero((sizes % B == 1) | (B == 1)) if single and not (drop_last and B > 1) else []
    if len(lone):
        more = f" and {len(lone) - 1} more clients" if len(lone) > 1 else ""
        raise ValueError(
            f"batch_size: client {int(lone[0])}'s last minibatch holds one sample "
            f"({int(sizes[lone[0]])} samples, batch_size {B}){more}, and BatchNorm {single[0]!r} "
            f"normalises one value per sample there: its training statistics need more than one value "
            f"per channel (a per-client loop raises there); set drop_last = true or another batch_size"
        )
