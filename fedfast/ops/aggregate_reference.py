"""Pure-PyTorch reference of the fused server update (the spec of :func:`fedfast.ops.aggregate`).

Inputs: client rows ``X`` [n, P] (the participating clients' models after local training), the round's
starting global model ``g`` [P], normalised weights ``w`` [n].

    avg   = sum_k w_k X_k                                         the weighted average
    D     = g - avg                                               the pseudo-gradient (mean client update)
    m'    = beta * m + scale * D                                  a server momentum buffer (m = 0 if absent)
    g'    = g - lr * m'                                           the new global model

``beta = 0, scale = 1, lr = 1`` gives ``g' = avg`` (up to rounding: ``g - (g - avg)``).

Per-client state rows (optional): rows ``R`` [n, P] (one per participating client), coefficients ``a`` [n] (or a
scalar) and a shared shift ``s`` [P] (optional, 0 if absent):

    R_k'  = (R_k + s) + a_k (X_k - g)                           each client's new state row
    change = sum_k (R_k' - R_k)                                  the column sum of the changes [P]

A ring buffer (optional): ``B`` [M, P] of past global models: ``B[slot] = g'`` and ``ring_mean = mean(B[:count])``.

``avg_shift`` [P] (optional) starts the average: ``avg = avg_shift + sum_k w_k X_k``. DP-FedAvg (McMahan et al.,
ICLR 2018) is this with unnormalised weights (:func:`dp_average_reference` is its literal form):

    s_k   = min(1, C / ||X_k - g||)                              each client's clipping factor (1 at a zero update)
    avg   = g + (sum_k s_k (X_k - g) + noise) / E                C = dp_clip, E the expected cohort size
          = (1 - sum_k s_k / E) g + noise / E  +  sum_k (s_k / E) X_k

The ops know no method: which method fills which term (server momentum, control variates, FedDyn's h, a teacher
buffer) is written in its own file under ``fedfast/methods/`` (``chunk_aggregate``, ``server_terms``) and tabulated in
docs/methods.md.
"""

from __future__ import annotations

import torch
from torch import Tensor


def aggregate_reference(
    X: Tensor,
    g: Tensor,
    w: Tensor,
    *,
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
    avg_shift: Tensor | None = None,
):
    """Returns a dict with ``global`` [P], ``average`` [P] and, as used, ``momentum``, ``state_rows``,
    ``state_change``, ``ring``, ``ring_mean`` (all new tensors, fp32; fp64 when ``X`` is fp64)."""
    acc = torch.float64 if X.dtype == torch.float64 else torch.float32
    Xa, ga, wa = X.to(acc), g.to(acc), w.to(acc)
    avg = (wa[:, None] * Xa).sum(0)
    if avg_shift is not None:
        avg = avg_shift.to(acc) + avg
    out = {"average": avg}
    D = ga - avg
    m_new = scale * D if momentum is None else beta * momentum.to(acc) + scale * D
    if momentum is not None or beta != 0.0:
        out["momentum"] = m_new
    new_g = ga - lr * m_new
    if state_rows is not None:
        R = state_rows.to(acc)
        a = torch.as_tensor(1.0 if state_coef is None else state_coef, dtype=acc, device=X.device).reshape(-1, 1)
        base = R if state_shift is None else R + state_shift.to(acc)[None, :]
        R_new = base + a * (Xa - ga)
        out["state_rows"] = R_new
        out["state_change"] = (R_new - R).sum(0)
    if ring is not None:
        buf = ring.to(acc).clone()
        buf[ring_slot] = new_g
        out["ring"] = buf
        out["ring_mean"] = buf[:ring_count].mean(0)
    out["global"] = new_g
    return out


def dp_average_reference(X: Tensor, g: Tensor, clip: float, noise: Tensor | None, denominator: float) -> Tensor:
    """DP-FedAvg's noised mean update applied to ``g``, written out: each row's delta ``X_k - g`` scaled to L2 norm
    at most ``clip``, summed, ``noise`` [P] added (already scaled by the noise standard deviation), divided by the
    expected cohort size ``denominator``."""
    acc = torch.float64 if X.dtype == torch.float64 else torch.float32
    D = X.to(acc) - g.to(acc)
    norms = torch.linalg.vector_norm(D, dim=1)
    s = torch.clamp(clip / norms, max=1.0)  # a zero delta: inf, clamped to 1
    total = (s[:, None] * D).sum(0)
    if noise is not None:
        total = total + noise.to(acc)
    return g.to(acc) + total / denominator


def update_norms_reference(X: Tensor, g: Tensor) -> Tensor:
    """``||X_k - g||`` [n] in float64: each client's update norm (DP-FedAvg's clipping)."""
    return torch.linalg.vector_norm(X.double() - g.double(), dim=1)
