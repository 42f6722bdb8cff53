"""Pure-PyTorch reference of the fused server update (the spec of :func:`fedfast.ops.aggregate`).

Inputs: client rows ``X`` [n, P] (the participating clients' models after local training), the round's
starting global model ``g`` [P] (theta_t; for FedDyn the cloud model), normalised weights ``w`` [n].

    avg   = sum_k w_k X_k                                         (FedAvg, McMahan et al.; size-weighted)
    D     = g - avg                                               (pseudo-gradient, mean client update)
    m'    = beta * m + scale * D                                  (server momentum buffer; m = 0 if absent)
    g'    = g - lr * m'                                           (new global)

``beta = 0, scale = 1, lr = 1`` is FedAvg (g' = avg); ``scale = 1, lr = eta_s`` is FedAvgM (Hsu et al.);
``scale = 1/eta, lr = alpha*eta`` is SlowMo (FedADC Alg. 2); ``beta = beta_g - beta_l`` with the same
scale/lr is FedADC's server rule (Ozfatura et al., Alg. 3 line 17-19: m' = D/eta + (beta_g - beta_l) m).

FedDyn (Acar et al.; the cloud form used by the ASD code): with per-client ``h_k`` rows [n, P] and the
running mean of all K clients' h, ``hbar`` [P]:
    h_k'  = h_k + (X_k - g)          hbar' = hbar + (1/K) sum_k (X_k - g)          g' = avg + hbar'
SCAFFOLD (Karimireddy et al.; FedNTD code): with client controls ``c_k`` [n, P], server control ``c`` [P]
and per-client coefficients ``coef_k = 1 / (K_eff_k * lr_k)``:
    c_k'  = c_k - c + coef_k (g - X_k)                         c' = c + (1/K) sum_k (c_k' - c_k)
FedGKD (Yao et al.): ring buffer ``B`` [M, P] of the last global models: ``B[slot] = g'`` and the
teacher is ``mean(B[:count])`` (parameter average of the buffered globals, warm-up: those present).
"""
from __future__ import annotations

import torch
from torch import Tensor


def aggregate_reference(X: Tensor, g: Tensor, w: Tensor, *, beta: float = 0.0, scale: float = 1.0,
                        lr: float = 1.0, momentum: Tensor | None = None, dyn_h: Tensor | None = None,
                        dyn_hbar: Tensor | None = None, dyn_num_clients: int | None = None,
                        scaffold_c: Tensor | None = None, scaffold_ck: Tensor | None = None,
                        scaffold_coef: Tensor | None = None, scaffold_num_clients: int | None = None,
                        teacher_buffer: Tensor | None = None, teacher_slot: int = 0, teacher_count: int = 1):
    """Returns a dict with ``global`` [P], ``average`` [P] and, as used, ``momentum``, ``dyn_h``,
    ``dyn_hbar``, ``scaffold_c``, ``scaffold_ck``, ``teacher_buffer``, ``teacher`` (all new tensors,
    fp32; fp64 when ``X`` is fp64)."""
    acc = torch.float64 if X.dtype == torch.float64 else torch.float32
    Xa, ga, wa = X.to(acc), g.to(acc), w.to(acc)
    avg = (wa[:, None] * Xa).sum(0)
    out = {"average": avg}
    if dyn_h is not None:
        upd = Xa - ga
        out["dyn_h"] = dyn_h.to(acc) + upd
        out["dyn_hbar"] = dyn_hbar.to(acc) + upd.sum(0) / dyn_num_clients
        new_g = avg + out["dyn_hbar"]
    else:
        D = ga - avg
        m_new = scale * D if momentum is None else beta * momentum.to(acc) + scale * D
        if momentum is not None or beta != 0.0:
            out["momentum"] = m_new
        new_g = ga - lr * m_new
    if scaffold_c is not None:
        ca, cka = scaffold_c.to(acc), scaffold_ck.to(acc)
        ck_new = cka - ca + scaffold_coef.to(acc)[:, None] * (ga - Xa)
        out["scaffold_ck"] = ck_new
        out["scaffold_c"] = ca + (ck_new - cka).sum(0) / scaffold_num_clients
    if teacher_buffer is not None:
        buf = teacher_buffer.to(acc).clone()
        buf[teacher_slot] = new_g
        out["teacher_buffer"] = buf
        out["teacher"] = buf[:teacher_count].mean(0)
    out["global"] = new_g
    return out
