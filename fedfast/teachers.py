"""The round's teacher as the local steps read it: cached logits (once per round), a cached mixture of several
teachers, or the teacher run on every step's (augmented) rows. Each gives a step's :class:`TeacherRows`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .methods.base import TeacherRows, TeacherSpec


@dataclass
class CachedTeacher:
    """Teacher logits [N, C] for the round's training rows (zero elsewhere), made once per round."""
    logits: torch.Tensor

    def rows(self, idx: torch.Tensor, x: torch.Tensor) -> TeacherRows:
        return TeacherRows(logits=self.logits[idx].float())


@dataclass
class CachedMixture:
    """M teachers' mixture ``(P [N, C], negent [N])`` for the round's rows (:func:`fedfast.ops.teacher_mixture`)."""
    probs: torch.Tensor
    negent: torch.Tensor

    def rows(self, idx, x) -> TeacherRows:
        return TeacherRows(mixture=(self.probs[idx], self.negent[idx]))


@dataclass
class OnlineTeacher:
    """The teacher run on every step's (augmented) rows: one batched forward per teacher model."""
    spec: TeacherSpec
    sim: object  # the fedfast.Simulation whose forward_each / eval_mode run the teacher

    @torch.no_grad()
    def rows(self, idx, x) -> TeacherRows:
        """Each teacher on every client's own batch (one grouped forward: a model that normalises with batch
        statistics sees the same batches as in a per-client loop)."""
        sim, s = self.sim, self.spec
        with sim.eval_mode():
            out = [sim.forward_each(m, x).float().reshape(-1, sim.num_classes) for m in s.models]
        if s.weights is None:
            return TeacherRows(logits=out[0])
        return TeacherRows(logits=torch.stack(out), weights=s.weights)
