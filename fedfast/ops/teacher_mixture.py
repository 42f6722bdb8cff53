"""FedGKD-VOTE teacher mixture (Yao et al., Eq. 5): M teachers -> one target distribution.

``P_i = sum_m w_m softmax(t_mi / tau)`` and ``negent_i = sum_m w_m sum_c p_mic log p_mic`` so that
``sum_m w_m KL(p_mi || q_i) = negent_i - sum_c P_ic log q_ic`` exactly (same loss value and gradient as
M separate KL terms). With ``not_true`` each p_m is the softmax over the not-true classes (FedNTD).
In the engine it is computed once per round per cached teacher table.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from . import _backend, _validate
from ._door import Backends, OpArgs, extension
from .distill_reference import teacher_mixture_reference


def _mixture_rows(
    teachers: Tensor, weights: Tensor, target: Tensor, tau: float, not_true: bool, ignore_index: int, backend: str
) -> tuple[Tensor, Tensor]:
    """The op's door: its record and one table call (the custom op's body too)."""
    args = TeacherMixtureArgs(
        teachers=teachers,
        weights=weights,
        target=target,
        tau=float(tau),
        not_true=bool(not_true),
        ignore_index=int(ignore_index),
    )
    return tuple(TEACHER_MIXTURE(backend, args))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TeacherMixtureArgs(OpArgs):
    """:func:`teacher_mixture`'s arguments, ``FEDFAST_TEACHER_MIXTURE``'s order (``csrc/op_signatures.h``)."""

    SIGNATURE: ClassVar[str] = "FEDFAST_TEACHER_MIXTURE"
    teachers: Tensor
    weights: Tensor
    target: Tensor
    tau: float
    not_true: bool
    ignore_index: int


def _mixture_reference(a: TeacherMixtureArgs) -> tuple[Tensor, Tensor]:
    return teacher_mixture_reference(
        a.teachers, a.weights, a.target, tau=a.tau, not_true=a.not_true, ignore_index=a.ignore_index
    )


def _mixture_triton(a: TeacherMixtureArgs) -> tuple[Tensor, Tensor]:
    from ..triton.teacher_mixture import teacher_mixture_triton

    return teacher_mixture_triton(*a.values())


TEACHER_MIXTURE = Backends(
    "teacher_mixture",
    reference=_mixture_reference,
    cpu=extension("cpu", "teacher_mixture"),
    triton=_mixture_triton,
    cuda=extension("cuda", "teacher_mixture"),
)


# The op for torch.compile; eager calls go to the backend directly (a custom op's Python dispatch costs ~0.1 ms).
teacher_mixture_op = torch.library.custom_op("fedfast::teacher_mixture", mutates_args=())(_mixture_rows)


@teacher_mixture_op.register_fake
def _(teachers, weights, target, tau, not_true, ignore_index, backend):
    dt = torch.float64 if teachers.dtype == torch.float64 else torch.float32
    M, R, C = teachers.shape
    return teachers.new_empty((R, C), dtype=dt), teachers.new_empty((R,), dtype=dt)


def mixture_weights(weights, M: int, dev, dtype: torch.dtype, mode: str) -> Tensor:
    """The M teachers' weights as a contiguous [M] tensor on ``dev`` (fp64 for fp64 teachers, else fp32), checked
    finite and >= 0."""
    w = torch.as_tensor(weights, device=dev)
    if w.shape != (M,):
        raise ValueError(f"teacher_weights: expected shape ({M},) (one weight per teacher), got {tuple(w.shape)}")
    w = w.to(torch.float64 if dtype == torch.float64 else torch.float32).contiguous()
    if mode != "off":
        w = _validate.guard(
            w, "teacher_weights", ((w < 0) | ~torch.isfinite(w)).any(), "weights must be finite and >= 0", mode
        )
    return w


def teacher_mixture(
    teachers: Tensor,
    weights,
    target: Tensor,
    *,
    tau: float = 1.0,
    not_true: bool = False,
    ignore_index: int = -100,
    backend: str | None = None,
    validate: str | None = None,
):
    """Return ``(P [R, C], negent [R])`` (fp32; fp64 for fp64 teachers). See the module docstring."""
    _validate.check_logits("teachers", teachers, ndim=3)
    tau = _validate.check_tau("tau", tau)
    M, R, C = teachers.shape
    dev = teachers.device
    mode = _validate.mode_for(dev, validate)
    w = mixture_weights(weights, M, dev, teachers.dtype, mode)
    _validate.check_target(target, R, C, ignore_index, dev, mode)
    be = _backend.resolve_for(backend, dev.type, teachers.dtype)
    plain = _backend.plain_eager(teachers, w, target)
    return (_mixture_rows if plain else teacher_mixture_op)(
        teachers.detach().contiguous(), w, target.contiguous(), float(tau), bool(not_true), int(ignore_index), be
    )
