"""fedfast.sim.evaluation alone: the Evaluator measures a model and makes a round's record, changing nothing;
FedNTD's forgetting by hand (issue 37)."""

import pytest
import torch
import torch.nn.functional as F

import fedfast
from fedfast import data, models
from fedfast.collectives import Local
from fedfast.sim.evaluation import EvalSettings, Evaluator, forgetting
from fedfast.sim.runtime import ModelRuntime, RuntimeSettings


def _evaluator(validation=False, **kw):
    train, test = data.synthetic(4, 40, 30, (1, 4, 4), seed=1)
    torch.manual_seed(0)
    model = models.MLP(16, (8,), 4)
    cfg = fedfast.SimConfig(eval_batch=8, **kw)
    rt = ModelRuntime(RuntimeSettings.of(cfg), model, train, torch.device("cpu"))
    return Evaluator(EvalSettings.of(cfg), rt, Local(), test, train if validation else None), rt, model, test


def test_evaluate_by_hand():
    ev, rt, model, test = _evaluator()
    flat = rt.initial * 1.5
    acc, loss, per_class = ev.evaluate(flat)
    rt.load_into_model(flat)
    x, y = test.batch(torch.arange(len(test)))
    with torch.no_grad():
        z = model(x)
    right = z.argmax(1) == y
    assert acc == pytest.approx(right.float().mean().item()) and loss == pytest.approx(F.cross_entropy(z, y).item())
    want = torch.stack([right[y == c].float().mean() if (y == c).any() else torch.tensor(0.0) for c in range(4)])
    torch.testing.assert_close(per_class, want)


def test_record_evaluates_every_eval_every_and_the_last_round_only():
    ev, rt, _, _ = _evaluator(validation=True, rounds=5, eval_every=2)
    hist, accs, totals = [], [], {"steps": 4, "clients": [0, 1]}
    for rnd in range(1, 6):
        timers = {}
        rec, ca = ev.record(
            rnd,
            rt.initial * (1 + rnd / 10),
            hist,
            accs,
            totals,
            torch.tensor(2.0),
            timers,
            0.0,
            chunk=3,
            method_metrics={"x": 1.0} if rnd == 2 else {},
        )
        evaluated = rnd in (2, 4, 5)
        assert (rec["test_accuracy"] is not None) == evaluated == (ca is not None) == (rec["val_accuracy"] is not None)
        assert rec["round"] == rnd and rec["train_loss"] == 0.5 and rec["client_chunk"] == 3 and "eval" in timers
        assert ("method_metrics" in rec) == (rnd == 2)
        if evaluated:
            assert rec["forgetting"] == (forgetting(accs + [ca]) if accs else None)
            assert rec["best_test_accuracy"] == max(
                [h["test_accuracy"] for h in hist if h["test_accuracy"] is not None] + [rec["test_accuracy"]]
            )
            accs.append(ca)
        hist.append(rec)
    assert len(hist) == 5 and len(accs) == 3  # the caller keeps both; record() appended nothing


def test_forgetting_by_hand():
    assert forgetting([torch.tensor([0.5, 0.5])]) is None
    A = [torch.tensor([0.9, 0.2]), torch.tensor([0.5, 0.6]), torch.tensor([0.6, 0.4])]
    assert forgetting(A) == pytest.approx(((0.9 - 0.6) + (0.6 - 0.4)) / 2)  # the best earlier minus the last
