"""fedfast.teachers alone: a step's teacher rows from a cached table, a cached mixture, or the teacher run on the
step's own rows, and the round's cached teacher against the predictions it is made from (issue 37)."""

import torch

from fedfast import data, ops
from fedfast.methods.base import TeacherSpec
from fedfast.teachers import CachedMixture, CachedTeacher, OnlineTeacher, cached_teacher


class _Engine:
    """The two Engine members an online teacher uses, with the model logits = x @ flat.view(C, F)."""

    num_classes = 3

    def __init__(self):
        self.modes = []

    def eval_mode(self):
        engine = self

        class _Mode:
            def __enter__(self):
                engine.modes.append("eval")

            def __exit__(self, *a):
                engine.modes.append("train")

        return _Mode()

    def forward_each(self, flat, x, buffers=None, valid=None):
        self.modes.append(("buffers", buffers, "valid", valid))
        return x.reshape(x.shape[0], x.shape[1], -1) @ flat.view(3, -1).T


_SEEN = []


def _predict(flat, dataset, idx, dtype=torch.float32, buffers=None):
    _SEEN.append(buffers)
    x, _ = dataset.batch(idx)
    return (x.reshape(len(idx), -1) @ flat.view(3, -1).T).to(dtype)


def test_cached_tables_give_the_rows_asked_for():
    logits = torch.randn(6, 3)
    assert torch.equal(
        CachedTeacher(logits.half()).rows(torch.tensor([4, 1]), None).logits, logits.half()[[4, 1]].float()
    )
    P, neg = torch.rand(6, 3), torch.rand(6)
    r = CachedMixture(P, neg).rows(torch.tensor([2, 2, 0]), None)
    assert torch.equal(r.mixture[0], P[[2, 2, 0]]) and torch.equal(r.mixture[1], neg[[2, 2, 0]])


def test_online_teacher_runs_each_model_on_the_steps_rows_in_eval_mode():
    e = _Engine()
    m1, m2 = torch.randn(12), torch.randn(12)
    x = torch.randn(2, 4, 1, 2, 2)  # 2 clients x 4 rows
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    one = OnlineTeacher(TeacherSpec.of(m1), e).rows(None, x, valid)
    torch.testing.assert_close(one.logits, e.forward_each(m1, x).reshape(-1, 3))
    # the model's buffers (None: the global model's) and the step's valid rows reach the forward
    assert e.modes[0] == "eval" and e.modes[1] == ("buffers", None, "valid", valid) and e.modes[2] == "train"
    assert one.weights is None
    w = torch.tensor([0.25, 0.75])
    bufs = torch.randn(2, 5)
    e.modes.clear()
    two = OnlineTeacher(TeacherSpec(models=[m1, m2], weights=w, tau=2.0, buffers=bufs), e).rows(None, x)
    assert two.logits.shape == (2, 8, 3) and torch.equal(two.weights, w)
    assert [torch.equal(m[1], bufs[i]) for i, m in enumerate(e.modes[1:3])] == [True, True]


def test_cached_teacher_holds_the_predictions_on_the_cohorts_rows_only():
    train, _ = data.synthetic(3, 12, 3, (1, 2, 2), seed=0)
    flat = torch.randn(12)
    idx = torch.tensor([1, 5, 7])
    t = cached_teacher(TeacherSpec.of(flat), _predict, train, idx)
    torch.testing.assert_close(t.logits[idx], _predict(flat, train, idx))
    assert t.logits[[0, 2, 11]].abs().sum() == 0
    assert (
        cached_teacher(TeacherSpec.of(flat), _predict, train, idx, dtype=torch.bfloat16).logits.dtype == torch.bfloat16
    )
    models, w = [flat, -flat], torch.tensor([0.5, 0.5])
    mix = cached_teacher(TeacherSpec(models=models, weights=w, tau=1.5), _predict, train, idx)
    P, neg = ops.teacher_mixture(torch.stack([_predict(m, train, idx) for m in models]), w, train.y[idx], tau=1.5)
    torch.testing.assert_close(mix.probs[idx], P.float())
    torch.testing.assert_close(mix.negent[idx], neg.float())
    assert mix.probs[0].abs().sum() == 0
    _SEEN.clear()
    bufs = torch.randn(2, 4)
    cached_teacher(TeacherSpec(models=models, weights=w, tau=1.5, buffers=bufs), _predict, train, idx)
    assert torch.equal(_SEEN[0], bufs[0]) and torch.equal(_SEEN[1], bufs[1])  # each teacher with its own buffers
