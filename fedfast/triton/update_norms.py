"""Triton kernel of DP-FedAvg's update norms ``||X_k - g||`` (reference: ``update_norms_reference`` in
:mod:`fedfast.ops.aggregate_reference`; C++ twin: ``fedfast._C.update_norms``).

A grid of (client row, column slice): each program streams ``BLOCK * ITERS`` columns of its row against ``g`` once
and writes the slice's sum of squares (fp32 lanes); the slices' partial sums are added in float64. One pass over the
participating rows instead of the chunked ``index_select`` + difference + norm of the tensor-op path (three reads and
two writes of each row). Bytes: n*P*x (rows) + P*4 per row slice (g, from L2) + n*S*4 (partials).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norms_kernel(x_ptr, idx_ptr, g_ptr, out_ptr, P, S, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    k = tl.program_id(0)
    s = tl.program_id(1)
    row = tl.load(idx_ptr + k).to(tl.int64)
    base = s.to(tl.int64) * (BLOCK * ITERS)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        cols = base + i * BLOCK + offs
        m = cols < P
        x = tl.load(x_ptr + row * P + cols, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + cols, mask=m, other=0.0)
        d = x - g
        acc += d * d
    tl.store(out_ptr + k * S + s, tl.sum(acc, axis=0))


def update_norms_triton(
    clients: torch.Tensor, idx: torch.Tensor, global_params: torch.Tensor, BLOCK: int = 1024, ITERS: int = 16
) -> torch.Tensor:
    """``||X_k - g||`` [n] (fp32) of the rows ``idx`` of ``clients`` [N, P] (fp32/bf16/fp16); the arguments in
    ``FEDFAST_UPDATE_NORMS``'s order."""
    n, P = idx.numel(), clients.shape[1]
    S = triton.cdiv(P, BLOCK * ITERS)
    part = torch.empty(n, S, dtype=torch.float32, device=clients.device)
    if n:
        _norms_kernel[(n, S)](
            clients.contiguous(),
            idx.contiguous(),
            global_params.float().contiguous(),
            part,
            P,
            S,
            BLOCK=BLOCK,
            ITERS=ITERS,
            num_warps=4,
        )
    return part.double().sum(1).sqrt().float()
