"""DP-FedAvg's update norms ``||X_k - g||``: the bound step's measure of each client's update, in one pass over its
row (spec: :func:`fedfast.ops.aggregate_reference.update_norms_reference`; its own op since issue 61: it was a
function inside :mod:`fedfast.ops.aggregate`, which calls it when a private run's norms were not measured in the
local step).

Backends: ``cpu`` (C++, ``csrc``: squares summed in double), ``triton`` (the CUDA backend's too: slices of each row
in parallel, their sums added in double), ``reference`` (PyTorch, ``chunk_bytes`` of rows at a time).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _backend


def update_norms(
    clients: Tensor, global_params: Tensor, idx: Tensor, backend: str | None = None, chunk_bytes: int = 64 << 20
) -> Tensor:
    """``||X_k - g||`` [n] of the rows ``idx`` (spec: :func:`~fedfast.ops.aggregate_reference.update_norms_reference`),
    on the difference (no cancellation: an update is small against the parameters). The cpu backend streams each
    row once in C++ (squares summed in double), the GPU backends once in Triton (slices of each row in parallel,
    their sums added in double); the reference takes ``chunk_bytes`` of rows at a time (fp32; fp64 for fp64 rows)."""
    acc = torch.float64 if clients.dtype == torch.float64 else torch.float32
    be = _backend.resolve(backend, clients.device.type)
    if be == "cpu" and acc == torch.float32 and idx.numel():
        return _backend.cpu_ext().update_norms(clients, idx, global_params)
    if be in ("triton", "cuda") and acc == torch.float32 and _backend.available("triton", clients.device.type):
        from ..triton.update_norms import update_norms_triton  # one pass over the rows (the CUDA backend's too)

        return update_norms_triton(clients, idx, global_params)
    P = clients.shape[1]
    step = max(1, chunk_bytes // max(1, P * 4))
    g = global_params.to(acc)
    if not idx.numel():
        return torch.zeros(0, dtype=acc, device=clients.device)
    return torch.cat(
        [
            torch.linalg.vector_norm(clients.index_select(0, idx[a : a + step]).to(acc) - g, dim=1)
            for a in range(0, idx.numel(), step)
        ]
    )
