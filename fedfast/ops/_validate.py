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

``FEDFAST_VALIDATE`` overrides the default. Inside ``torch.compile``, ``torch.export`` and ``torch.jit.trace`` an
eager check cannot run on the host at trace time (it would be recorded as a constant: a later call's bad target
silently dropped): the checks go into the graph instead (mode ``"graph"``: the ``fedfast::checked_target`` /
``fedfast::checked_segments`` / ``fedfast::checked_value`` ops, which raise when the graph runs: targets, segments,
FedCAD's class weights, ASD's class prior, the teachers' weights). Inside a
``torch.func.vmap`` transform values are batched and cannot be read: checks are off there.
"""

from __future__ import annotations

import numbers
import os

import torch

try:  # functorch's interpreter stack (which transforms are running): for in_vmap
    from torch._C._functorch import TransformType as _TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters as _interpreters
except ImportError:  # pragma: no cover - a torch without functorch
    _TransformType = _interpreters = None

_CHECKS = ("target", "segments", "class_prior", "class_alpha", "class_freq", "teacher_weights", "class_weight")
_status: dict[torch.device, torch.Tensor] = {}


def mode_for(device: torch.device, validate: str | None) -> str:
    if validate == "graph" and (torch.compiler.is_compiling() or torch.jit.is_tracing()):
        return "graph"  # an op resolved it already and hands it on (GKD's teacher mixture inside a traced loss)
    m = validate or os.environ.get("FEDFAST_VALIDATE") or ("eager" if device.type == "cpu" else "defer")
    if m not in ("eager", "defer", "off"):
        raise ValueError(f"validate must be 'eager', 'defer' or 'off', got {m!r}")
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return "graph" if m == "eager" else m  # a host check would be a trace-time constant: ops of the graph
    if m != "off" and in_vmap():
        return "off"  # a batched value cannot be read on the host (nor flagged: no vmap rule for the status write)
    return m


def in_vmap() -> bool:
    """Whether a ``torch.func.vmap`` transform is running (at any level): values are batched, and reading one on
    the host (a value check) raises. Under vmap the value checks are skipped; an out-of-range target row counts
    as ignored (zero loss and gradient), as every backend treats it."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    if peek is not None and peek() is None:  # no transform at all: the common, eager case (0.1 us)
        return False
    if _interpreters is None:  # pragma: no cover - a torch without functorch
        return False
    return any(i.key() == _TransformType.Vmap for i in _interpreters())


def segment_count(segments: torch.Tensor, num_segments) -> int:
    """The number of segments of reduction="segment": ``num_segments``, else the largest id + 1 (read on the
    host: refused by name under ``torch.func.vmap``, where the ids are batched)."""
    if num_segments is not None:
        return int(num_segments)
    if segments.shape[0] == 0:
        return 1
    if in_vmap():
        raise ValueError(
            "num_segments: reduction='segment' under torch.func.vmap needs num_segments (the count "
            "of segments is otherwise read from the batched ids)"
        )
    return int(segments.max()) + 1


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
        bad = [name for name, f in zip(_CHECKS, flags, strict=True) if f]
        if bad:
            raise ValueError(
                f"fedfast: invalid values were passed on {d} in argument(s) {bad} "
                f"(deferred validation; rerun with validate='eager' to locate the call)"
            )


def check(name: str, bad: torch.Tensor, message: str, mode: str) -> None:
    """``bad`` is a 0-dim bool tensor that is True when the argument ``name`` is invalid. (Mode ``"graph"``: the
    checks are graph ops, :func:`in_graph` for targets and segments, :func:`guard` for the others.)"""
    if mode in ("off", "graph"):
        return
    if mode == "eager":
        if bool(bad):
            raise ValueError(f"{name}: {message}")
        return
    st = status(bad.device)
    i = _CHECKS.index(name)
    st[i : i + 1].bitwise_or_(bad.to(torch.int32).reshape(1))


@torch.library.custom_op("fedfast::checked_value", mutates_args=())
def checked_value(x: torch.Tensor, bad: torch.Tensor, name: str, message: str) -> torch.Tensor:
    """``x`` (a copy), after raising the eager check's ValueError when ``bad`` holds: a value check (a class table's
    range, a teacher weight's sign) as an op of a traced graph, run each time the graph runs."""
    if bool(bad):
        raise ValueError(f"{name}: {message}")
    return x.clone()


@checked_value.register_fake
def _(x, bad, name, message):
    return torch.empty_like(x)


def guard(x: torch.Tensor, name: str, bad: torch.Tensor, message: str, mode: str) -> torch.Tensor:
    """``x`` after its value check ``bad`` (a 0-dim bool tensor, True when ``name`` is invalid): :func:`check` in
    the eager and deferred modes; in a traced graph (mode ``"graph"``) through :func:`checked_value`, so that the
    graph checks every call's values (use the returned tensor)."""
    if mode == "graph":
        return checked_value(x, bad, name, message)
    check(name, bad, message, mode)
    return x


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


def real(name: str, v, *, positive: bool = False) -> float:
    """``v`` as a Python float: any real number (int, float, a NumPy scalar such as ``np.float32(2)``; not a bool or
    a tensor), finite, and > 0 when ``positive``; else a ValueError naming ``name``."""
    if type(v) is float or type(v) is int:  # the common case, without the ABC check (a hot path at small shapes)
        ok, f = True, float(v)
    else:
        ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
        f = float(v) if ok else float("nan")
    if not ok or f != f or abs(f) == float("inf") or (positive and not f > 0):
        what = "a finite number > 0" if positive else "a finite number"
        raise ValueError(f"{name}: must be {what}, got {v!r}")
    return f


def check_tau(name: str, tau) -> float:
    """A temperature: a finite number > 0, returned as a float."""
    return real(name, tau, positive=True)


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
        check("target", bad.any(), _TARGET_MESSAGE.format(C=C, ignore_index=ignore_index), mode)


_TARGET_MESSAGE = "class indices must lie in [0, {C}) or equal ignore_index={ignore_index}"
_SEGMENT_MESSAGE = "client ids must be sorted (contiguous per client) and lie in [0, {hi})"


@torch.library.custom_op("fedfast::checked_target", mutates_args=())
def checked_target(target: torch.Tensor, C: int, ignore_index: int) -> torch.Tensor:
    """``target`` (a copy), after checking its values: the target check as an op of a traced graph (mode
    ``"graph"``), which raises the eager check's ValueError when the graph runs."""
    bad = ((target < 0) | (target >= C)) & (target != ignore_index)
    if target.numel() and bool(bad.any()):
        raise ValueError("target: " + _TARGET_MESSAGE.format(C=C, ignore_index=ignore_index))
    return target.clone()


@checked_target.register_fake
def _(target, C, ignore_index):
    return torch.empty_like(target)


@torch.library.custom_op("fedfast::checked_segments", mutates_args=())
def checked_segments(segments: torch.Tensor, hi: int) -> torch.Tensor:
    """``segments`` (a copy), after the eager check of their values, as an op of a traced graph."""
    bad = (segments < 0).any() | (segments >= hi).any()
    if segments.numel() > 1:
        bad = bad | (segments[1:] < segments[:-1]).any()
    if segments.numel() and bool(bad):
        raise ValueError("segments: " + _SEGMENT_MESSAGE.format(hi=hi))
    return segments.clone()


@checked_segments.register_fake
def _(segments, hi):
    return torch.empty_like(segments)


def in_graph(target: torch.Tensor, segments, C: int, ignore_index: int, num_segments, mode: str):
    """``(target, segments)``: as given, or, in mode ``"graph"`` (a traced graph), passed through the checking ops
    so that the graph checks every call's values (use the returned tensors)."""
    if mode != "graph":
        return target, segments
    target = checked_target(target, int(C), int(ignore_index))
    if segments is not None:
        segments = checked_segments(segments, int(num_segments) if num_segments is not None else segments.shape[0])
    return target, segments


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
        check("segments", bad, _SEGMENT_MESSAGE.format(hi=hi), mode)
