"""Fused server update: one pass over the participating clients' rows of a flat ``[N, P]`` buffer.

Formulas (the weighted average, a server rule with momentum, per-client state rows with the sum of their changes,
a ring buffer of past global models): :mod:`fedfast.ops.aggregate_reference`. The terms are generic; each method
says in its own file which of its quantities fills which.

Backends: ``cpu`` (C++), ``cuda`` (kernels/aggregate.cu), ``triton``, ``reference``.

NaN policy: a client row containing NaN or inf is detected in the same pass; the update is refused with
a ``ValueError`` naming the rows (nothing is returned, so the caller's global model and state are
untouched: every output is a new tensor).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from . import _backend
from ._door import Backends, OpArgs, extension
from .aggregate_reference import aggregate_reference
from .update_norms import update_norms


class NonFiniteUpdate(ValueError):
    """A client row (or the weighted average) holds NaN or inf; the update was refused. ``rows``: the bad rows."""

    def __init__(self, message: str, rows: list):
        super().__init__(message)
        self.rows = rows


def _rows_index(rows, N: int, device) -> Tensor:
    if rows is None:
        return torch.arange(N, device=device)
    if isinstance(rows, int):
        if not 1 <= rows <= N:
            raise ValueError(f"rows: a prefix length must lie in [1, {N}], got {rows}")
        return torch.arange(rows, device=device)
    r = torch.as_tensor(rows, device=device)
    if r.dtype not in (torch.int64, torch.int32) or r.dim() != 1 or r.numel() == 0:
        raise ValueError("rows: expected a non-empty 1-d integer tensor of row indices (or a prefix length)")
    if r.device.type == "cpu" and ((r < 0).any() or (r >= N).any()):
        raise ValueError(f"rows: indices must lie in [0, {N})")
    return r.long()


def _state_rows(name, t, n, P):
    if t is None:
        return None
    if t.shape != (n, P):
        raise ValueError(f"{name}: expected shape ({n}, {P}) (one row per participating client), got {tuple(t.shape)}")
    return t


def _vec(name, t, P):
    if t is None:
        return None
    if t.shape != (P,):
        raise ValueError(f"{name}: expected shape ({P},), got {tuple(t.shape)}")
    return t


def _dp_terms(clients, g, idx, weights, clip, noise, denominator, norms, backend):
    """(unnormalised weights [n], average shift [P], the count of updates no longer than the clip) of DP-FedAvg's
    noised mean, or None without ``dp_clip``."""
    if clip is None:
        if noise is not None or denominator is not None or norms is not None:
            raise ValueError("dp_noise/dp_denominator/dp_norms: given without dp_clip")
        return None
    if not (isinstance(clip, (int, float)) and 0 < clip < float("inf")):
        raise ValueError(f"dp_clip: a finite number > 0, got {clip!r}")
    if not (isinstance(denominator, (int, float)) and 0 < denominator < float("inf")):
        raise ValueError(f"dp_denominator: the expected cohort size, a finite number > 0, got {denominator!r}")
    if weights is not None:
        raise ValueError(
            "weights: size-weighted aggregation is refused under DP (dp_clip): DP-FedAvg sums the "
            "clipped updates and divides by the expected cohort size"
        )
    P = clients.shape[1]
    acc = torch.float64 if clients.dtype == torch.float64 else torch.float32
    _vec("dp_noise", noise, P)
    if norms is None:
        norms = update_norms(clients, g, idx, backend)
    elif not (isinstance(norms, Tensor) and norms.shape == (idx.numel(),) and norms.is_floating_point()):
        raise ValueError(
            f"dp_norms: expected a float tensor of shape ({idx.numel()},) (one update norm per participating client)"
        )
    s = torch.clamp(float(clip) / norms, max=1.0)
    w = s / float(denominator)
    shift = (1.0 - w.sum()) * g.to(acc)
    if noise is not None:
        shift = shift + noise.to(acc) / float(denominator)
    return w.to(acc), shift, (norms <= float(clip)).sum().to(acc)


def aggregate(
    clients: Tensor,
    global_params: Tensor,
    *,
    weights=None,
    rows=None,
    beta: float = 0.0,
    scale: float = 1.0,
    lr: float = 1.0,
    momentum: Tensor | None = None,
    state_rows: Tensor | None = None,
    state_coef=None,
    state_shift: Tensor | None = None,
    ring: Tensor | None = None,
    ring_slot: int = 0,
    ring_count: int = 1,
    dp_clip: float | None = None,
    dp_noise: Tensor | None = None,
    dp_denominator: float | None = None,
    dp_norms: Tensor | None = None,
    backend: str | None = None,
) -> dict:
    """New global model and server state from the participating clients (one pass over their rows).

    ``clients`` [N, P] (fp32/bf16/fp16); ``rows``: participating row indices [n] or a prefix length
    (default all N); ``weights`` [n] (data sizes or weights; normalised here; default uniform);
    ``global_params`` [P] = g. Server rule ``m' = beta m + scale (g - avg)``, ``g' = g - lr m'`` (the plain
    average by default). ``state_rows`` [n, P] with ``state_coef`` (a scalar or [n]; default 1) and
    ``state_shift`` [P] (optional): ``R_k' = (R_k + shift) + a_k (X_k - g)``, returned with the column sum of the
    changes. ``ring`` [M, P] with ``ring_slot`` and ``ring_count`` (entries present after this write): ``B[slot] =
    g'`` and their mean. Returns a dict of new tensors: ``global``, ``average`` and, as used, ``momentum``,
    ``state_rows``, ``state_change``, ``ring``, ``ring_mean``.

    DP-FedAvg (``dp_clip`` C, ``dp_denominator`` E, ``dp_noise`` [P] optional, already scaled by its standard
    deviation): the average is ``g + (sum_k min(1, C / ||X_k - g||) (X_k - g) + noise) / E``
    (:func:`~fedfast.ops.aggregate_reference.dp_average_reference`): the clients' update norms (given, or in one
    pass over their rows), then the op's pass with the clipping factors as unnormalised weights and the rest as a
    shift of the average. ``dp_norms`` [n]: the norms ``||X_k - g||`` when the caller has them (the engine: each
    client's last :func:`~fedfast.ops.client_step` adds them up in its pass over the row, ``delta_norm``): no pass
    of their own. ``dp_unclipped`` in the result: how many of the updates were no longer than C (adaptive
    clipping's count). ``dp_norms`` may be larger than the update's own norm (a joint norm over the update and what
    the client uploads beside it: the factor ``min(1, C / norm)`` is then the joint one). Weights are refused with it;
    per-client state rows are updated unclipped (the clients' own state: their column sum ``state_change`` is not
    clipped, and a private caller must not release it); the CUDA backend does not take it yet.
    """
    N, P, dev = _operands(clients, global_params)
    idx = _rows_index(rows, N, dev)
    dp = _dp_terms(clients, global_params, idx, weights, dp_clip, dp_noise, dp_denominator, dp_norms, backend)
    _vec("momentum", momentum, P)
    _check_ring(ring, ring_slot, ring_count, P)
    args = AggregateArgs(
        X=clients,
        rows=idx,
        g=global_params,
        w=dp[0] if dp is not None else _weights(weights, idx.numel(), dev),
        beta=float(beta),
        scale=float(scale),
        lr=float(lr),
        momentum=momentum,
        state_rows=state_rows,
        state_coef=_state_coef(state_rows, state_coef, state_shift, idx.numel(), P, dev),
        state_shift=state_shift,
        ring=ring,
        slot=int(ring_slot),
        count=int(ring_count),
        avg_shift=dp[1] if dp is not None else None,
    )
    out, bad = AGGREGATE(_resolve(backend, dev.type, dp is not None), args)
    if bad.any():
        rows_bad = idx[bad[:-1]].tolist()
        what = f"rows {rows_bad} contain NaN or inf" if rows_bad else "the weighted average overflowed"
        raise NonFiniteUpdate(
            f"clients: {what}; the update was refused (global model and server state unchanged)", rows_bad
        )
    if dp is not None:
        out["dp_unclipped"] = dp[2]
    return out


def _operands(clients, global_params) -> tuple:
    """``(N, P, device)`` of the client rows; TypeError / ValueError naming ``clients`` or ``global_params``."""
    if not isinstance(clients, Tensor) or clients.dim() != 2 or not clients.is_floating_point():
        raise TypeError("clients: expected a float [N, P] tensor")
    N, P = clients.shape
    if global_params.shape != (P,):
        raise ValueError(f"global_params: expected shape ({P},), got {tuple(global_params.shape)}")
    return N, P, clients.device


def _check_ring(ring, slot: int, count: int, P: int) -> None:
    if ring is not None:
        if ring.dim() != 2 or ring.shape[1] != P:
            raise ValueError(f"ring: expected shape [M, {P}], got {tuple(ring.shape)}")
        M = ring.shape[0]
        if not (0 <= slot < M and 1 <= count <= M):
            raise ValueError(f"ring_slot/ring_count: need 0 <= slot < {M} and 1 <= count <= {M}")


def _weights(weights, n: int, dev) -> Tensor:
    """The participants' weights [n] normalised to sum 1 (default uniform); ValueError naming ``weights``."""
    if weights is None:
        return torch.full((n,), 1.0 / n, device=dev)
    w = torch.as_tensor(weights, device=dev, dtype=torch.float32)
    if w.shape != (n,):
        raise ValueError(f"weights: expected shape ({n},) (one per participating client), got {tuple(w.shape)}")
    total = w.sum()
    if dev.type == "cpu" and (not torch.isfinite(w).all() or (w < 0).any() or not total > 0):
        raise ValueError("weights: must be finite, >= 0 and sum to a positive number")
    return w / total


def _state_coef(state_rows, state_coef, state_shift, n: int, P: int, dev) -> Tensor | None:
    """The state rows' coefficients [n] fp32 (default 1), their shapes checked; None without state rows."""
    if state_rows is None:
        if state_coef is not None or state_shift is not None:
            raise ValueError("state_coef/state_shift: given without state_rows")
        return None
    _state_rows("state_rows", state_rows, n, P)
    _vec("state_shift", state_shift, P)
    coef = torch.as_tensor(1.0 if state_coef is None else state_coef, device=dev, dtype=torch.float32).reshape(-1)
    if coef.numel() not in (1, n):
        raise ValueError(
            f"state_coef: expected a scalar or one value per participating client ({n}), got {coef.numel()} values"
        )
    return coef.expand(n).contiguous()


def _resolve(backend: str | None, device_type: str, dp: bool) -> str:
    """The backend that runs: DP-FedAvg's shifted average is not in the CUDA kernel yet, so a private aggregation
    asked of ``cuda`` is refused, and one that ``cuda`` would run by default takes Triton (or the reference)."""
    be = _backend.resolve(backend, device_type)
    if dp and be == "cuda":
        if backend == "cuda":
            raise ValueError(
                "backend: DP-FedAvg's aggregation (dp_clip) is not on the CUDA backend yet; use "
                "backend='triton' (or leave it unset)"
            )
        return "triton" if _backend.available("triton", device_type) else "reference"
    return be


@dataclasses.dataclass(frozen=True, kw_only=True)
class AggregateArgs(OpArgs):
    """:func:`aggregate`'s checked arguments, ``FEDFAST_AGGREGATE``'s order (``csrc/op_signatures.h``): ``rows``
    the participants' row indices [n], ``w`` their weights [n] (normalised, or DP-FedAvg's clipping factors / E),
    ``state_coef`` [n] or None, ``avg_shift`` [P] (DP-FedAvg's) or None."""

    SIGNATURE: ClassVar[str] = "FEDFAST_AGGREGATE"
    X: Tensor
    rows: Tensor
    g: Tensor
    w: Tensor
    beta: float
    scale: float
    lr: float
    momentum: Tensor | None
    state_rows: Tensor | None
    state_coef: Tensor | None
    state_shift: Tensor | None
    ring: Tensor | None
    slot: int
    count: int
    avg_shift: Tensor | None


_OUTPUTS = ("global", "average", "momentum", "state_rows", "state_change", "ring", "ring_mean", "_bad")


def _compiled(run):
    """A compiled backend's entry: its list of outputs as the op's dict and the rows' non-finite flags [n + 1];
    float64 rows take the reference (the kernels compute in fp32)."""

    def entry(a: AggregateArgs):
        if a.X.dtype == torch.float64:
            return _agg_reference(a)
        res = run(a)
        out = {
            k: v
            for k, v in zip(_OUTPUTS, res, strict=True)
            if v is not None and (k != "ring_mean" or a.ring is not None)
        }
        return out, out.pop("_bad")

    return entry


def _agg_triton(a: AggregateArgs):
    from ..triton.aggregate import aggregate_triton

    return aggregate_triton(*a.values())


def _agg_reference(a: AggregateArgs):
    X = a.X.index_select(0, a.rows)
    out = aggregate_reference(
        X,
        a.g,
        a.w,
        beta=a.beta,
        scale=a.scale,
        lr=a.lr,
        momentum=a.momentum,
        state_rows=a.state_rows,
        state_coef=a.state_coef,
        state_shift=a.state_shift,
        ring=a.ring,
        ring_slot=a.slot,
        ring_count=a.count,
        avg_shift=a.avg_shift,
    )
    return out, torch.cat([~torch.isfinite(X).all(dim=1), ~torch.isfinite(out["average"]).all().reshape(1)])


AGGREGATE = Backends(
    "aggregate",
    reference=_agg_reference,
    cpu=_compiled(extension("cpu", "aggregate")),
    cuda=_compiled(extension("cuda", "aggregate")),
    triton=_compiled(_agg_triton),
)
