"""A method's hooks, in two sets, each hook with its default (FedAvg's):

* :class:`ClientHooks`: what the clients do in their local steps - the teacher they distil from, a SAM radius, the
  loss, the per-chunk state and the fused client step's terms;
* :class:`ServerHooks`: what the server does with them - the participants' weights, per-round values, the fused
  aggregate's terms, reading each chunk's results, the server rule, the evaluated model, the round's metrics.

:class:`fedfast.methods.Method` is both; docs/methods.md lists the hooks in the order the engine calls them.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from .. import ops

if TYPE_CHECKING:  # the hooks' argument types (fedfast.methods.base imports this module)
    from .base import Step, TeacherSpec
    from .round import Round


class HookError(TypeError):
    """A method's hook (or a ``loss_fn``) returned the wrong thing: the message names the hook, its file and line,
    what it must return and what it returned."""


def hook_site(method, hook: str) -> str:
    """``"name.hook (FILE, line N)"``: where a method's hook is defined (the class in its MRO that defines it), for
    errors about what the hook returned."""
    name = getattr(method, "name", "") or type(method).__name__
    for cls in type(method).__mro__:
        fn = cls.__dict__.get(hook)
        if fn is not None:
            fn = inspect.unwrap(getattr(fn, "__func__", fn))
            code = getattr(fn, "__code__", None)
            if code is not None:
                return f"{name}.{hook} ({code.co_filename}, line {code.co_firstlineno})"
            break
    return f"{name}.{hook}"


def describe_value(v) -> str:
    """A short description of a returned value: a tensor's shape, dtype and device, else its type."""
    if torch.is_tensor(v):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)} on {v.device}"
    return f"{type(v).__name__} {v!r}"[:120]


def check_hook_return(
    method, hook: str, value, *, shape=None, device=None, kind: str = "tensor", what: str = ""
) -> None:
    """HookError naming the hook, its file and line, what it must return (``what``) and what it returned, when
    ``value`` is not a floating tensor (of ``shape``, on ``device``; ``kind="dict"``: a dict)."""
    if kind == "dict":
        ok = isinstance(value, dict)
    else:
        ok = (
            torch.is_tensor(value)
            and value.is_floating_point()
            and (shape is None or tuple(value.shape) == shape)
            and (device is None or value.device.type == torch.device(device).type)
        )
    if not ok:
        raise HookError(f"{hook_site(method, hook)}: must return {what}, got {describe_value(value)}")


def round_metrics(method, ctx) -> dict:
    """``method``'s own values for round ``ctx``'s record (``Method.round_metrics``), checked: names to numbers
    (read to the host once per round); HookError naming the hook otherwise."""
    got = method.round_metrics(ctx)
    if not got:
        return {}
    if not isinstance(got, dict):
        raise HookError(
            f"{hook_site(method, 'round_metrics')}: must return a dict of name -> number, got {type(got).__name__}"
        )
    out = {}
    for k, v in got.items():
        if not isinstance(k, str) or not k:
            raise HookError(f"{hook_site(method, 'round_metrics')}: names must be non-empty strings, got {k!r}")
        if torch.is_tensor(v):
            if v.numel() != 1:
                raise HookError(
                    f"{hook_site(method, 'round_metrics')}: {k!r} must be one number, got a "
                    f"tensor of shape {tuple(v.shape)}"
                )
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise HookError(f"{hook_site(method, 'round_metrics')}: {k!r} must be a number, got {v!r}")
        out[k] = float(v)
    return out


def cross_entropy(b: Step, backend) -> Tensor:
    """Plain CE over the step's rows: the sum over clients of each client's minibatch mean (padding ignored)."""
    return ops.distill(
        b.logits,
        torch.zeros_like(b.logits.detach()),
        b.target,
        kd_weight=0.0,
        segments=b.segments,
        num_segments=b.num_clients,
        reduction="mean",
        backend=backend,
    )


def weighted_mean_rows(rows: Tensor, valid: Tensor) -> Tensor:
    """``rows`` [n*B] per-row values -> the sum over clients of each client's mean over its valid rows."""
    v = valid.float()
    w = (v / v.sum(1, keepdim=True).clamp_min(1)).reshape(-1)
    return (rows * w).sum()


def graph_safe(hook):
    """Mark a ``loss`` or ``step_terms`` hook as safe to replay as a CUDA graph (``SimConfig(cuda_graphs=True)``,
    :mod:`fedfast.sim.step_graph`): within a chunk, its result depends on the chunk only - it reads no
    ``b.epoch`` / ``b.step`` and no host state that changes between steps, and returns no tensor made fresh each
    step (a term tensor is made in ``chunk_start`` or held by the method); ``step_terms`` also does not depend on
    the step's loss. A subclass that overrides a marked hook marks its own."""
    hook.graph_safe = True
    return hook


def graph_unsafe_hooks(method) -> list[str]:
    """The hooks among ``loss`` and ``step_terms`` that ``method`` (a method or its class) runs without the
    :func:`graph_safe` mark."""
    cls = method if isinstance(method, type) else type(method)
    return [h for h in ("loss", "step_terms") if not getattr(getattr(cls, h), "graph_safe", False)]


class ClientHooks:
    """The client side of a method (the engine calls these during local training)."""

    def sam_rho(self, ctx: Round) -> float:
        """The SAM radius rho of this round's local steps (0: plain steps). With rho > 0 every local step runs the
        loss twice: at w for g, then at ``w + rho g / ||g||`` (per client), whose gradient the step applies at w
        (Foret et al. 2021; FedSAM, FedSpeed). A method that returns rho > 0 declares ``sam = True``."""
        return 0.0

    def teacher(self, ctx: Round) -> TeacherSpec | None:
        """The models this method distils from this round (None: no teacher)."""
        return None

    # -- client loss ---------------------------------------------------------------------------------------
    @graph_safe
    def loss(self, ctx: Round, b: Step) -> Tensor:
        """The client loss of all active clients: the sum over clients of each client's minibatch mean."""
        return cross_entropy(b, self.engine.backend)

    # -- client step ---------------------------------------------------------------------------------------
    def chunk_start(self, ctx: Round, lo: int, hi: int):
        """Before the local steps of the round's clients ``lo:hi`` (stack rows ``0:hi-lo`` hold the global model).
        Returns the method's per-chunk state (any object, typically a small dataclass of its own, or None): the
        engine hands it back to the chunk's other hooks as ``ctx.chunk``."""
        return None

    @graph_safe
    def step_terms(self, ctx: Round, n_act: int) -> dict:
        """Extra keyword arguments of :func:`fedfast.ops.client_step` for the active prefix ``0:n_act``."""
        return {}

    def chunk_end(self, ctx: Round, lo: int, hi: int):
        """After the chunk's last local step. Returns the chunk's new state (the next hooks' ``ctx.chunk``), or None
        to keep it."""
        return None


class ServerHooks:
    """The server side of a method (the engine calls these around and after the clients' training)."""

    def aggregation_weights(self, ids: np.ndarray, sizes: np.ndarray, local_steps: np.ndarray) -> np.ndarray | None:
        """The weights of the round's participants in the average (host arrays over all of the round's clients in
        stack order: ids, data sizes, local steps E*ceil(n/B)); None: the engine's ``aggregate_weights``
        (sizes or uniform). FedDisco and FedNova set their own."""
        return None

    def round_start(self, ctx: Round) -> dict | None:
        """Per-round server-side values (class weights, per-client coefficients, kept on ``self``). Returns the
        round's sums, ``{name: a zero tensor of its shape}`` (every rank, even one without clients, returns the
        same names), which ``collect`` adds to and ``server`` reads as ``ctx.sums[name]`` (summed over the chunks and
        ranks); None: none."""
        return None

    def upload_spec(self) -> dict | None:
        """A private run (``dp_clip``): what each client uploads beside its model update, ``{target:
        fedfast.methods.UploadSpec}``, ``target`` where ``server`` reads its sum: ``"increment"`` or a name of the
        round's sums; None (the default): nothing. Called once, after :meth:`setup`. A method whose ``uploads`` is
        set and that does not declare them is refused under ``dp_clip``; raise a ValueError naming the option that
        makes an upload unboundable."""
        return None

    def upload_rows(self, ctx: Round, lo: int, hi: int) -> dict:
        """A private run: the chunk's clients' uploads, ``{target: [hi-lo, cols]}`` for each declared target with
        ``cols`` (after ``chunk_end``, before the aggregation; the trained models are the stack's rows). The engine
        clips each client's update and uploads jointly and hands ``server`` their noised sums times ``scale``."""
        return {}

    # -- server --------------------------------------------------------------------------------------------
    def chunk_aggregate(self, ctx: Round, lo: int, hi: int) -> dict:
        """Extra arguments of :func:`fedfast.ops.aggregate` for the chunk's rows (per-client state updates)."""
        return {}

    def collect(self, ctx: Round, out: dict, lo: int, hi: int):
        """The chunk's per-client results from the fused aggregate's outputs ``out`` and the trained rows: a
        :class:`fedfast.methods.Collected` (the clients' new state rows, an increment of the server's state, additions
        to the round's sums), or None. The engine accumulates it."""
        return None

    def server_terms(self, ctx: Round) -> dict:
        """Server-rule arguments of :func:`fedfast.ops.aggregate` (server momentum, teacher buffer)."""
        return {}

    def server(self, ctx: Round, avg: Tensor) -> Tensor:
        """The new global model from the participants' weighted average ``avg`` [P] (one fused call)."""
        out = ops.aggregate(
            avg[None], self.engine.global_flat, rows=1, backend=self.engine.backend, **self.server_terms(ctx)
        )
        self.after_server(ctx, out)
        return out["global"]

    def after_server(self, ctx: Round, out: dict) -> None:
        """Read the updated server state from the fused call's outputs."""

    def evaluated(self, global_flat: Tensor) -> Tensor:
        """The model the engine evaluates and reports (default: the global model)."""
        return global_flat

    def round_metrics(self, ctx: Round) -> dict:
        """The method's own values for this round's record, after ``server``: ``{name: number or 1-element
        tensor}`` (e.g. FedExP's server step size). They appear as ``method_metrics`` in ``sim.round()``'s record,
        ``metrics.jsonl`` and TensorBoard (``method/<name>``); read to the host once per round."""
        return {}
