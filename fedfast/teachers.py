"""The round's teacher as the local steps read it: cached logits (once per round), a cached mixture of several
teachers, or the teacher run on every step's (augmented) rows. Each gives a step's :class:`TeacherRows`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops
from .methods.base import TeacherRows, TeacherSpec


@dataclass
class CachedTeacher:
    """Teacher logits [N, C] for the round's training rows (zero elsewhere), made once per round."""

    logits: torch.Tensor

    def rows(self, idx: torch.Tensor, x: torch.Tensor, valid=None) -> TeacherRows:
        return TeacherRows(logits=self.logits[idx].float())


@dataclass
class CachedMixture:
    """M teachers' mixture ``(P [N, C], negent [N])`` for the round's rows (:func:`fedfast.ops.teacher_mixture`)."""

    probs: torch.Tensor
    negent: torch.Tensor

    def rows(self, idx, x, valid=None) -> TeacherRows:
        return TeacherRows(mixture=(self.probs[idx], self.negent[idx]))


@dataclass
class OnlineTeacher:
    """The teacher run on every step's (augmented) rows: one batched forward per teacher model."""

    spec: TeacherSpec
    sim: object  # the fedfast.Simulation whose forward_each / eval_mode run the teacher

    @torch.no_grad()
    def rows(self, idx, x, valid=None) -> TeacherRows:
        """Each teacher on every client's own batch (one grouped forward: a model that normalises with batch
        statistics sees the same batches as in a per-client loop, ``valid`` [n, B] its rows without padding)."""
        sim, s = self.sim, self.spec
        with sim.eval_mode():
            out = [
                sim.forward_each(m, x, buffers=s.buffers_of(i), valid=valid).float().reshape(-1, sim.num_classes)
                for i, m in enumerate(s.models)
            ]
        if s.weights is None:
            return TeacherRows(logits=out[0])
        return TeacherRows(logits=torch.stack(out), weights=s.weights)


def cached_teacher(
    spec: TeacherSpec, predict, train, idx: torch.Tensor, *, backend=None, dtype: torch.dtype = torch.float32
):
    """The round's teacher computed once, on rows ``idx`` of ``train`` (the cohort's rows) with ``predict(model,
    dataset, idx[, dtype])`` in large batches: a :class:`CachedTeacher` of logits (``dtype``: the cache's, float32
    or bfloat16), or for M teachers a :class:`CachedMixture` of their mixture at ``spec.tau``
    (:func:`fedfast.ops.teacher_mixture`). Rows outside ``idx`` hold zeros."""
    N, C = len(train), train.num_classes
    dev = idx.device
    if spec.weights is not None:  # M teachers: their mixture at the method's temperature, cached once
        T = torch.stack([predict(m, train, idx, buffers=spec.buffers_of(i)) for i, m in enumerate(spec.models)])
        Pm, neg = ops.teacher_mixture(T, spec.weights, train.y[idx], tau=spec.tau, backend=backend)
        P_all = torch.zeros(N, C, device=dev)
        neg_all = torch.zeros(N, device=dev)
        P_all[idx], neg_all[idx] = Pm.float(), neg.float()
        return CachedMixture(P_all, neg_all)
    cache = torch.zeros(N, C, device=dev, dtype=dtype)
    cache[idx] = predict(spec.models[0], train, idx, dtype, buffers=spec.buffers_of(0))
    return CachedTeacher(cache)
