"""Test (and validation) metrics of the evaluated model, per class, a round's record, and FedNTD's forgetting."""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F

from .._settings import Settings
from ..collectives import Distributed, Local
from ..data.datasets import ArrayDataset
from .runtime import ModelRuntime


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSettings(Settings):
    """What the evaluator reads of a run's config: which rounds are evaluated."""

    eval_every: int
    rounds: int


class Evaluator:
    """Measures a model (flat parameters) on the test set and the validation split, and makes a round's record
    from the measurements. Holds no run state: every call returns what it measured and changes nothing.
    ``runtime``: the :class:`~fedfast.sim.runtime.ModelRuntime`; ``comm``: the run's collectives (each process
    evaluates its share of the rows, the sums are all-reduced)."""

    def __init__(
        self,
        settings: EvalSettings,
        runtime: ModelRuntime,
        comm: Local | Distributed,
        test: ArrayDataset,
        validation: ArrayDataset | None,
    ):
        self.settings = EvalSettings.given(settings)
        self.runtime, self.comm, self.test, self.validation = runtime, comm, test, validation

    @torch.no_grad()
    def evaluate(self, flat: torch.Tensor, dataset: ArrayDataset | None = None) -> tuple[float, float, torch.Tensor]:
        """Accuracy, mean loss and per-class accuracy [C] of the model ``flat`` on ``dataset`` (default the test
        set)."""
        data = self.test if dataset is None else dataset
        rt = self.runtime
        C = data.num_classes
        acc = torch.zeros(2 * C + 1, device=rt.device, dtype=torch.float64)  # correct [C], count [C], loss
        rows = torch.arange(len(data), device=rt.device).tensor_split(self.comm.world)[self.comm.rank]
        with rt.eval_mode():
            for chunk in rows.split(rt.eval_batch):
                x, y = data.batch(chunk)
                z = rt.forward(flat, x).float()
                acc[-1] += F.cross_entropy(z, y, reduction="sum").double()
                acc[:C].index_add_(0, y, (z.argmax(1) == y).double())
                acc[C : 2 * C].index_add_(0, y, torch.ones_like(y, dtype=torch.float64))
        self.comm.sum_(acc)
        correct, count = acc[:C], acc[C : 2 * C]
        n = len(data)
        class_acc = (correct / count.clamp_min(1)).float().cpu()
        return float(correct.sum()) / n, float(acc[-1]) / n, class_acc

    def record(
        self,
        rnd: int,
        flat: torch.Tensor,
        history: list,
        class_accs: list,
        totals: dict,
        loss_sum,
        timers: dict,
        t1: float,
        *,
        chunk: int,
        method_metrics: dict,
    ) -> tuple[dict, object]:
        """Round ``rnd``'s record (1-based) and the per-class test accuracy it measured (None when it did not
        evaluate): test metrics of the model ``flat`` on every ``eval_every``-th round and after the last one;
        other rounds report ``None`` for them (forgetting and the best accuracy run over the evaluated rounds of
        ``history`` and ``class_accs``, the earlier rounds'). ``timers["eval"]``: the seconds since ``t1``."""
        c = self.settings
        acc = test_loss = class_acc = val = None
        if rnd % c.eval_every == 0 or rnd >= c.rounds:
            acc, test_loss, class_acc = self.evaluate(flat)
            if self.validation is not None:
                val = self.evaluate(flat, self.validation)
        timers["eval"] = time.perf_counter() - t1
        accs = [h["test_accuracy"] for h in history if h["test_accuracy"] is not None] + (
            [acc] if acc is not None else []
        )
        rec = {
            "round": rnd,
            "test_accuracy": acc,
            "test_loss": test_loss,
            "train_loss": float(loss_sum) / max(totals["steps"], 1),
            "best_test_accuracy": max(accs) if accs else None,
            "forgetting": forgetting(class_accs + [class_acc]) if acc is not None else None,
            "class_accuracy": [round(v, 6) for v in class_acc.tolist()] if class_acc is not None else None,
            "clients": totals["clients"],
            "cohort_size": len(totals["clients"]),
            "timers": timers,
            "client_chunk": chunk,
        }
        if self.validation is not None:
            rec["val_accuracy"], rec["val_loss"] = (val[0], val[1]) if val is not None else (None, None)
        if method_metrics:
            rec["method_metrics"] = method_metrics
        return rec, class_acc


def forgetting(class_accs: list) -> float | None:
    """FedNTD's forgetting (Eq. 5): F = (1/C) sum_c max_{t < T} (A_c^t - A_c^T) over the evaluated rounds' per-class
    test accuracies (oldest first); None before two evaluations."""
    if len(class_accs) < 2:
        return None
    A = torch.stack(class_accs)
    return float((A[:-1] - A[-1]).max(0).values.mean())
