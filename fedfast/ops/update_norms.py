"""DP-FedAvg's update norms ``||X_k - g||``: the bound step's measure of each client's update, in one pass over its
row (spec: :func:`fedfast.ops.aggregate_reference.update_norms_reference`; its own op since issue 61: it was a
function inside :mod:`fedfast.ops.aggregate`, which calls it when a private run's norms were not measured in the
local step).

Backends: ``cpu`` (C++, ``csrc``: squares summed in double), ``triton`` (the CUDA backend's too: slices of each row
in parallel, their sums added in double), ``reference`` (PyTorch, ``chunk_bytes`` of rows at a time).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from . import _backend
from ._door import Backends, OpArgs


def update_norms(
    clients: Tensor, global_params: Tensor, idx: Tensor, backend: str | None = None, chunk_bytes: int = 64 << 20
) -> Tensor:
    """``||X_k - g||`` [n] of the rows ``idx`` (spec: :func:`~fedfast.ops.aggregate_reference.update_norms_reference`),
    on the difference (no cancellation: an update is small against the parameters). The cpu backend streams each
    row once in C++ (squares summed in double), the GPU backends once in Triton (slices of each row in parallel,
    their sums added in double); the reference takes ``chunk_bytes`` of rows at a time (fp32; fp64 for fp64 rows)."""
    args = UpdateNormsArgs(X=clients, rows=idx, g=global_params)
    return UPDATE_NORMS(_backend.resolve(backend, clients.device.type), args, chunk_bytes=chunk_bytes)


@dataclasses.dataclass(frozen=True)
class UpdateNormsArgs(OpArgs):
    """:func:`update_norms`' arguments, ``FEDFAST_UPDATE_NORMS``' order (``csrc/op_signatures.h``)."""

    SIGNATURE: ClassVar[str] = "FEDFAST_UPDATE_NORMS"
    X: Tensor
    rows: Tensor
    g: Tensor


def _norms_reference(a: UpdateNormsArgs, chunk_bytes: int = 64 << 20) -> Tensor:
    """PyTorch, ``chunk_bytes`` of rows at a time, in fp32 (fp64 for fp64 rows)."""
    acc = torch.float64 if a.X.dtype == torch.float64 else torch.float32
    step = max(1, chunk_bytes // max(1, a.X.shape[1] * 4))
    g = a.g.to(acc)
    if not a.rows.numel():
        return torch.zeros(0, dtype=acc, device=a.X.device)
    return torch.cat(
        [
            torch.linalg.vector_norm(a.X.index_select(0, a.rows[i : i + step]).to(acc) - g, dim=1)
            for i in range(0, a.rows.numel(), step)
        ]
    )


def _norms_cpu(a: UpdateNormsArgs, chunk_bytes: int = 64 << 20) -> Tensor:
    """C++ (squares summed in double); fp64 rows and an empty set of rows: the reference."""
    if a.X.dtype == torch.float64 or not a.rows.numel():
        return _norms_reference(a, chunk_bytes)
    return _backend.cpu_ext().update_norms(*a.values())


def _norms_gpu(a: UpdateNormsArgs, chunk_bytes: int = 64 << 20) -> Tensor:
    """Triton, one pass over the rows (the CUDA backend's too); fp64 rows or no Triton: the reference."""
    if a.X.dtype == torch.float64 or not _backend.available("triton", a.X.device.type):
        return _norms_reference(a, chunk_bytes)
    from ..triton.update_norms import update_norms_triton

    return update_norms_triton(*a.values())


UPDATE_NORMS = Backends("update_norms", reference=_norms_reference, cpu=_norms_cpu, triton=_norms_gpu, cuda=_norms_gpu)
