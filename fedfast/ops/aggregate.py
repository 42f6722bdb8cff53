"""Fused server update: one pass over the participating clients' rows of a flat ``[N, P]`` buffer.

Formulas (FedAvg, FedAvgM, SlowMo, FedADC's server rule, FedDyn, SCAFFOLD, the FedGKD teacher buffer):
:mod:`fedfast.ops.aggregate_reference`.

Backends: ``cpu`` (C++), ``cuda`` (kernels/aggregate.cu), ``triton``, ``reference``.

NaN policy: a client row containing NaN or inf is detected in the same pass; the update is refused with
a ``ValueError`` naming the rows (nothing is returned, so the caller's global model and state are
untouched: every output is a new tensor).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _backend
from .aggregate_reference import aggregate_reference


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


def aggregate(clients: Tensor, global_params: Tensor, *, weights=None, rows=None, beta: float = 0.0,
              scale: float = 1.0, lr: float = 1.0, momentum: Tensor | None = None, dyn_h: Tensor | None = None,
              dyn_hbar: Tensor | None = None, dyn_num_clients: int | None = None, scaffold_c: Tensor | None = None,
              scaffold_ck: Tensor | None = None, scaffold_coef=None, scaffold_num_clients: int | None = None,
              teacher_buffer: Tensor | None = None, teacher_slot: int = 0, teacher_count: int = 1,
              backend: str | None = None) -> dict:
    """New global model and server state from the participating clients (one pass over their rows).

    ``clients`` [N, P] (fp32/bf16/fp16); ``rows``: participating row indices [n] or a prefix length
    (default all N); ``weights`` [n] (data sizes or weights; normalised here; default uniform);
    ``global_params`` [P] = theta_t (FedDyn: the cloud model). Server rule ``m' = beta m + scale (g - avg)``,
    ``g' = g - lr m'`` (FedAvg by default). FedDyn: ``dyn_h`` [n, P] rows of the participants, ``dyn_hbar``
    [P], ``dyn_num_clients`` K. SCAFFOLD: ``scaffold_c`` [P], ``scaffold_ck`` [n, P], ``scaffold_coef`` [n] =
    1/(K_eff lr), ``scaffold_num_clients`` K. FedGKD: ``teacher_buffer`` [M, P], ``teacher_slot``,
    ``teacher_count`` (entries present after this write). Returns a dict of new tensors: ``global``,
    ``average`` and the updated state that was passed (``momentum``, ``dyn_h``, ``dyn_hbar``, ``scaffold_c``,
    ``scaffold_ck``, ``teacher_buffer``, ``teacher``).
    """
    if not isinstance(clients, Tensor) or clients.dim() != 2 or not clients.is_floating_point():
        raise TypeError("clients: expected a float [N, P] tensor")
    N, P = clients.shape
    dev = clients.device
    if global_params.shape != (P,):
        raise ValueError(f"global_params: expected shape ({P},), got {tuple(global_params.shape)}")
    idx = _rows_index(rows, N, dev)
    n = idx.numel()
    if weights is None:
        w = torch.full((n,), 1.0 / n, device=dev)
    else:
        w = torch.as_tensor(weights, device=dev, dtype=torch.float32)
        if w.shape != (n,):
            raise ValueError(f"weights: expected shape ({n},) (one per participating client), got {tuple(w.shape)}")
        total = w.sum()
        if dev.type == "cpu" and (not torch.isfinite(w).all() or (w < 0).any() or not total > 0):
            raise ValueError("weights: must be finite, >= 0 and sum to a positive number")
        w = w / total
    _vec("momentum", momentum, P)
    if dyn_h is not None:
        _state_rows("dyn_h", dyn_h, n, P)
        _vec("dyn_hbar", dyn_hbar, P)
        if dyn_hbar is None or not dyn_num_clients:
            raise ValueError("dyn_hbar and dyn_num_clients: FedDyn needs the mean h over all clients and K")
        if momentum is not None or beta != 0.0:
            raise ValueError("momentum: FedDyn's server rule has no momentum")
    if scaffold_c is not None:
        _vec("scaffold_c", scaffold_c, P)
        _state_rows("scaffold_ck", scaffold_ck, n, P)
        if scaffold_coef is None or not scaffold_num_clients:
            raise ValueError("scaffold_coef and scaffold_num_clients: SCAFFOLD needs 1/(K_eff lr) per client and K")
        scaffold_coef = torch.as_tensor(scaffold_coef, device=dev, dtype=torch.float32).reshape(-1).expand(n)
    if teacher_buffer is not None:
        if teacher_buffer.dim() != 2 or teacher_buffer.shape[1] != P:
            raise ValueError(f"teacher_buffer: expected shape [M, {P}], got {tuple(teacher_buffer.shape)}")
        M = teacher_buffer.shape[0]
        if not (0 <= teacher_slot < M and 1 <= teacher_count <= M):
            raise ValueError(f"teacher_slot/teacher_count: need 0 <= slot < {M} and 1 <= count <= {M}")
    be = _backend.resolve(backend, dev.type)

    if be in ("cpu", "triton", "cuda") and clients.dtype != torch.float64:
        args = (clients, idx, global_params, w, float(beta), float(scale), float(lr), momentum, dyn_h, dyn_hbar,
                float(dyn_num_clients or 1), scaffold_c, scaffold_ck, scaffold_coef, float(scaffold_num_clients or 1),
                teacher_buffer, int(teacher_slot), int(teacher_count))
        if be == "cpu":
            res = _backend.cpu_ext().aggregate(*args)
        elif be == "cuda":
            res = _backend.cuda_ext().aggregate(*args)
        else:
            from ..triton.aggregate import aggregate_triton
            res = aggregate_triton(*args)
        keys = ("global", "average", "momentum", "dyn_h", "dyn_hbar", "scaffold_c", "scaffold_ck", "teacher_buffer",
                "teacher", "_bad")
        out = {k: v for k, v in zip(keys, res) if v is not None and (k != "teacher" or teacher_buffer is not None)}
        bad = out.pop("_bad")
    else:
        X = clients.index_select(0, idx)
        out = aggregate_reference(X, global_params, w, beta=beta, scale=scale, lr=lr, momentum=momentum,
                                  dyn_h=dyn_h, dyn_hbar=dyn_hbar, dyn_num_clients=dyn_num_clients,
                                  scaffold_c=scaffold_c, scaffold_ck=scaffold_ck, scaffold_coef=scaffold_coef,
                                  scaffold_num_clients=scaffold_num_clients, teacher_buffer=teacher_buffer,
                                  teacher_slot=teacher_slot, teacher_count=teacher_count)
        bad = torch.cat([~torch.isfinite(X).all(dim=1), ~torch.isfinite(out["average"]).all().reshape(1)])
    if bad.any():
        rows_bad = idx[bad[:-1]].tolist()
        what = f"rows {rows_bad} contain NaN or inf" if rows_bad else "the weighted average overflowed"
        raise NonFiniteUpdate(f"clients: {what}; the update was refused (global model and server state unchanged)",
                              rows_bad)
    return out
