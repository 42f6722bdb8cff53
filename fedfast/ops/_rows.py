"""Row bookkeeping the loss ops share (:mod:`.distill`, :mod:`.asd_weights`, :mod:`.linear_distill`): which rows
count, how many valid rows each segment holds, and per-class tables checked and laid out for the kernels."""

from __future__ import annotations

import torch
from torch import Tensor


def class_table(name: str, x, C: int, device, segments: Tensor | None) -> Tensor:
    """A per-class table ([C], or [num_segments, C] with ``segments``) as a contiguous [S, C] tensor on
    ``device``: fp64 if given fp64, else fp32."""
    t = torch.as_tensor(x, device=device)
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.shape[1] != C:
        raise ValueError(f"{name}: expected shape [{C}] or [num_segments, {C}], got {tuple(t.shape)}")
    if t.shape[0] > 1 and segments is None:
        raise ValueError(f"{name}: a per-segment table [{t.shape[0]}, {C}] needs `segments`")
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32).contiguous()


def valid_rows(target: Tensor, C: int, ignore_index: int) -> Tensor:
    """[R] bool: the rows whose target is a class (not ``ignore_index``, in [0, C))."""
    return (target != ignore_index) & (target >= 0) & (target < C)


def segment_counts(segments: Tensor, valid: Tensor) -> Tensor:
    """Per-row count of valid rows in the row's segment, [R] int (no host sync)."""
    R = segments.shape[0]
    seg = segments.long().clamp(0, max(R - 1, 0))
    counts = torch.zeros(R, dtype=torch.int32, device=segments.device).index_add(0, seg, valid.to(torch.int32))
    return counts[seg]
