"""The model's buffers in a round (BatchNorm's running statistics): where each chunk's clients start, the
participants' weighted sum and, under ``bn_stats = "local"``, their own rows; the store of the clients' own
statistics; and the checks a BatchNorm model gets when a run is built (``docs/engine.md``, "BatchNorm")."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn

from ..flat import FlatLayout
from ..methods.base import Method, TeacherSpec
from ..methods.hooks import HookError, hook_site
from .plan import RoundPlan
from .runtime import ModelRuntime
from ..store.state import ClientState
from .sizing import MemoryBudget


class RoundBuffers:
    """A round's model buffers: where each chunk's clients start (the global model's, or under ``bn_stats =
    "local"`` each client's own, gathered from ``store``), the participants' weighted sum ``sum`` [B] (float64) and,
    with a store, their new rows ``rows`` [m, B]. ``layout``: the model's :class:`fedfast.flat.FlatLayout`."""

    def __init__(
        self, layout: FlatLayout, m: int, device: torch.device, store: ClientState | None, sampled: np.ndarray
    ):
        B = layout.B
        self.layout, self.sum = layout, torch.zeros(B, dtype=torch.float64, device=device)
        self.own = store.gather(sampled) if store is not None and B else None
        self.rows = torch.empty(m, B, device=device) if self.own is not None else None

    def start(self, lo: int, hi: int, global_buffers: torch.Tensor) -> torch.Tensor:
        return self.own[lo:hi] if self.own is not None else global_buffers

    def add(self, lo: int, hi: int, weights: torch.Tensor, stack_buffers: torch.Tensor) -> None:
        """The chunk's clients' buffers (stack rows ``0:hi-lo``) into the weighted sum (and the new rows)."""
        if not self.sum.numel():
            return
        rows = stack_buffers[: hi - lo]
        self.sum += (weights[lo:hi, None].double() * rows.double()).sum(0)
        if self.rows is not None:
            self.rows[lo:hi] = rows

    def average(self, total_weight: float) -> torch.Tensor:
        """[B] float32: the participants' weighted average (after the sum is all-reduced), integer buffers
        (``num_batches_tracked``) rounded to the nearest."""
        b = self.sum / total_weight
        return torch.where(self.layout.integer_mask(b.device), b.round(), b).float()


def local_statistics_store(bn_stats: str, runtime: ModelRuntime, budget: MemoryBudget, num_clients: int):
    """``bn_stats = "local"`` (FedBN's statistics): a per-client store of the model's buffers (rows of
    ``runtime.num_buffers`` values, float32 whatever ``state_dtype`` says, the initial model's as a client's first
    row); None for ``"global"``. ValueError naming ``bn_stats`` for a model without running statistics."""
    if bn_stats != "local":
        return None
    if not runtime.running_stats:
        raise ValueError(
            "bn_stats: 'local' keeps each client's BatchNorm running statistics, but the model has no "
            "BatchNorm layer that tracks them (track_running_stats=True)"
        )
    return budget.client_state(
        num_clients, runtime.initial_buffers, cols=runtime.num_buffers, name="client-buffers", float32=True
    )


def restore_local_statistics(store: ClientState | None, ck: dict, bn_stats: str) -> None:
    """The clients' own statistics from checkpoint ``ck`` into ``store``; ValueError when the checkpoint was made
    under the other ``bn_stats``."""
    if (store is None) != ("client_buffers" not in ck):
        raise ValueError(
            f"checkpoint: {'holds' if 'client_buffers' in ck else 'holds no'} per-client BatchNorm "
            f"statistics, this run has bn_stats = {bn_stats!r}"
        )
    if store is not None:
        store.load_state_dict(ck["client_buffers"])


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
