"""Input validation shared by the ops.

Host-side checks (shapes, dtypes, scalars) always run and cost nothing. Checks on tensor *values*
(targets in range, segments sorted, priors positive for present classes, ...) need the data:

* ``validate="eager"`` runs them now and raises ``ValueError`` naming the argument. On a GPU this
  forces a host sync, so it is the default only for CPU tensors.
* ``validate="defer"`` (default for GPU tensors) computes the same predicates with device ops into a
  per-device status tensor, without any sync; :func:`raise_if_invalid` reads it once (e.g. once per
  round in the engine) and raises ``ValueError`` naming the first bad argument. The kernels are
  memory-safe on bad values meanwhile (an out-of-range target row is treated as ignored).
* ``validate="off"`` skips value checks.

``FEDFAST_VALIDATE`` overrides the default.
"""
from __future__ import annotations

import os

import torch

_CHECKS = ("target", "segments", "class_prior", "class_alpha", "class_freq", "teacher_weights")
_status: dict[torch.device, torch.Tensor] = {}


def mode_for(device: torch.device, validate: str | None) -> str:
    m = validate or os.environ.get("FEDFAST_VALIDATE") or ("eager" if device.type == "cpu" else "defer")
    if m not in ("eager", "defer", "off"):
        raise ValueError(f"validate must be 'eager', 'defer' or 'off', got {m!r}")
    if torch.compiler.is_compiling() and m == "eager":
        return "off"  # data-dependent raises would break the graph; checks run eagerly outside compile
    return m


def status(device: torch.device) -> torch.Tensor:
    if device not in _status:
        _status[device] = torch.zeros(len(_CHECKS), dtype=torch.int32, device=device)
    return _status[device]


def raise_if_invalid(device: torch.device | str | None = None) -> None:
    """Read the deferred-validation flags (one host sync) and raise ``ValueError`` if any is set."""
    want = None if device is None else torch.device(device)
    devs = [d for d in _status if want is None or (d.type == want.type and want.index in (None, d.index))]
    for d in devs:
        st = _status.get(d)
        if st is None:
            continue
        flags = st.tolist()
        st.zero_()
        bad = [name for name, f in zip(_CHECKS, flags) if f]
        if bad:
            raise ValueError(f"fedfast: invalid values were passed on {d} in argument(s) {bad} "
                             f"(deferred validation; rerun with validate='eager' to locate the call)")


def check(name: str, bad: torch.Tensor, message: str, mode: str) -> None:
    """``bad`` is a 0-dim bool tensor that is True when the argument ``name`` is invalid."""
    if mode == "off":
        return
    if mode == "eager":
        if bool(bad):
            raise ValueError(f"{name}: {message}")
        return
    st = status(bad.device)
    i = _CHECKS.index(name)
    st[i : i + 1].bitwise_or_(bad.to(torch.int32).reshape(1))


def require(cond: bool, name: str, message: str, exc=ValueError) -> None:
    if not cond:
        raise exc(f"{name}: {message}")


FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int64, torch.int32)


def check_logits(name: str, x: torch.Tensor, ndim: int = 2) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a float tensor (fp32/fp64/bf16/fp16), got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(x.shape)}")


def check_tau(name: str, tau: float) -> None:
    if not (isinstance(tau, (int, float)) and tau > 0 and tau < float("inf")):
        raise ValueError(f"{name}: must be a finite number > 0, got {tau!r}")


def check_target(target: torch.Tensor, R: int, C: int, ignore_index: int, device, mode: str) -> None:
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target: expected a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in INT_DTYPES:
        raise TypeError(f"target: expected an int64 or int32 tensor of class indices, got {target.dtype}")
    if target.shape != (R,):
        raise ValueError(f"target: expected shape ({R},) to match student rows, got {tuple(target.shape)}")
    if target.device != device:
        raise ValueError(f"target: on {target.device}, student is on {device}")
    if R and mode != "off":
        bad = ((target < 0) | (target >= C)) & (target != ignore_index)
        check("target", bad.any(), f"class indices must lie in [0, {C}) or equal ignore_index={ignore_index}",
              mode)


def check_segments(segments: torch.Tensor, R: int, device, mode: str, num_segments: int | None) -> None:
    if segments.dtype not in INT_DTYPES:
        raise TypeError(f"segments: expected an int64/int32 tensor of client ids, got {segments.dtype}")
    if segments.shape != (R,):
        raise ValueError(f"segments: expected shape ({R},), got {tuple(segments.shape)}")
    if segments.device != device:
        raise ValueError(f"segments: on {segments.device}, student is on {device}")
    if num_segments is not None and num_segments < 1:
        raise ValueError(f"num_segments: must be >= 1, got {num_segments}")
    if R and mode != "off":
        hi = R if num_segments is None else num_segments
        bad = (segments < 0).any() | (segments >= hi).any()
        if R > 1:
            bad = bad | (segments[1:] < segments[:-1]).any()
        check("segments", bad, f"client ids must be sorted (contiguous per client) and lie in [0, {hi})", mode)
