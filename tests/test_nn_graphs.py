"""fedfast.nn inside graphs (issue 59): every loss, with one teacher and with several, under torch.compile
(fullgraph), torch.export and torch.jit.trace, equal to eager in the loss and its gradient; and every value check
eager makes also made by the graph, each time it runs (FedCAD's class weights, ASD's class prior, the teachers'
weights), never skipped."""

import warnings

import pytest
import torch

import fedfast.nn as fnn

R, C, H, V = 12, 6, 8, 20


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(R, C, generator=g, dtype=torch.float64).float()
    t = torch.randn(R, C, generator=g)
    y = torch.randint(0, C, (R,), generator=g)
    y[3] = -100
    seg = torch.tensor([0] * 5 + [1] * 7)
    return z, t, y, seg


def _cases():
    z, t, y, seg = _data()
    prior = torch.bincount(y[y >= 0], minlength=C).float() + 0.5
    prior = prior / prior.sum()
    T3 = torch.stack([t, t.flip(0), t * 0.5])
    w3 = torch.tensor([0.2, 0.3, 0.5])
    alpha = torch.linspace(0.1, 0.9, C)
    conf = torch.rand(C, generator=torch.Generator().manual_seed(1)) + 0.1
    return {
        "kd": (fnn.KDLoss(tau=3.0), (t, y), {}),
        "kd-sum": (fnn.KDLoss(tau=2.0, reduction="sum"), (t, y), {}),
        "kd-segment": (fnn.KDLoss(tau=2.0, reduction="segment"), (t, y), dict(segments=seg, num_segments=2)),
        "ntd": (fnn.NTDLoss(tau=2.0, beta=1.0), (t, y), {}),
        "asd": (fnn.ASDLoss(), (t, y, prior), {}),
        "gkd-1": (fnn.GKDLoss(tau=2.0), (t, y), {}),
        "gkd-3": (fnn.GKDLoss(tau=2.0), (T3, y), {}),
        "vote-3": (fnn.GKDLoss(tau=2.0), (T3, y), dict(teacher_weights=w3)),
        "cad": (fnn.CADLoss(), (t, y, alpha), {}),
        "adc": (fnn.ADCLoss(), (t, y, conf), {}),
    }


class _Call(torch.nn.Module):
    """The loss called with its positional and keyword arguments (what export and trace record)."""

    def __init__(self, loss, kw):
        super().__init__()
        self.loss, self.kw = loss, kw

    def forward(self, z, *args):
        return self.loss(z, *args, **self.kw)


@pytest.mark.parametrize("name", list(_cases()))
@pytest.mark.parametrize("how", ["compile", "export", "trace"])
def test_every_loss_and_teacher_count_in_a_graph_equals_eager(name, how):
    loss, args, kw = _cases()[name]
    z = _data()[0]
    call = _Call(loss, kw)
    za, zb = z.clone().requires_grad_(), z.clone().requires_grad_()
    want = call(zb, *args)
    want.sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "compile":
            torch._dynamo.reset()
            f = torch.compile(call, backend="aot_eager", fullgraph=True)
        elif how == "export":
            f = torch.export.export(call, (z.clone().requires_grad_(), *args)).module()
        else:
            f = torch.jit.trace(call, (z.clone().requires_grad_(), *args), check_trace=False)
        got = f(za, *args)
    got.sum().backward()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want)
    assert torch.allclose(za.grad, zb.grad, rtol=1e-5, atol=1e-7)


def _linear():
    g = torch.Generator().manual_seed(3)
    h, W = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    y = torch.randint(0, V, (R,), generator=g)
    th, tW = torch.randn(R, H + 2, generator=g), torch.randn(V, H + 2, generator=g) * 0.3
    return h, W, y, th, tW


@pytest.mark.parametrize("how", ["compile", "export", "trace"])
@pytest.mark.parametrize("teacher", ["logits", "hidden"])
def test_linear_kd_loss_at_its_default_chunk_in_a_graph(how, teacher):
    """LinearKDLoss with the default chunk size (torch.jit.trace failed with "chunk_rows: ... got None"), the
    teacher as logits or as hidden states and head."""
    h, W, y, th, tW = _linear()
    loss = fnn.LinearKDLoss(tau=2.0, not_true=teacher == "hidden")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.W = torch.nn.Parameter(W.clone())

        def forward(self, h, y, th, tW):
            if teacher == "logits":
                return loss(h, self.W, y, th @ tW.T)
            return loss(h, self.W, y, teacher_hidden=th, teacher_weight=tW)

    net = Net()
    want = net(h, y, th, tW)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "compile":
            torch._dynamo.reset()
            f = torch.compile(net, backend="aot_eager", fullgraph=True)
        elif how == "export":
            f = torch.export.export(net, (h, y, th, tW)).module()
        else:
            f = torch.jit.trace(net, (h, y, th, tW), check_trace=False)
        got = f(h, y, th, tW)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def _bad_cases():
    z, t, y, _ = _data()
    prior = torch.full((C,), 1.0 / C)
    prior0 = prior.clone()
    prior0[int(y[0])] = 0.0  # a class present in the target with prior 0: ASD divides by it
    T3 = torch.stack([t, t.flip(0), t * 0.5])
    return {
        "class_alpha": (fnn.CADLoss(), (t, y, torch.full((C,), 0.5)), (t, y, torch.full((C,), 1.7)), {}),
        "class_prior": (fnn.ASDLoss(), (t, y, prior), (t, y, prior0), {}),
        "teacher_weights": (
            lambda z, T, y, w: fnn.GKDLoss(tau=2.0)(z, T, y, teacher_weights=w),
            (T3, y, torch.tensor([0.2, 0.3, 0.5])),
            (T3, y, torch.tensor([0.2, -0.3, 1.1])),
            {},
        ),
    }


@pytest.mark.parametrize("name", list(_bad_cases()))
@pytest.mark.parametrize("how", ["eager", "compile", "export", "trace"])
def test_value_checks_run_inside_the_graph(name, how):
    """A graph made from good values refuses bad ones when it runs, naming the argument (before issue 59: FedCAD's
    class_alpha 1.7 gave 2.4902, ASD's zero prior NaN, negative VOTE weights 4.3875 under jit.trace); the trace's
    refusal is TorchScript's RuntimeError carrying the same message."""
    loss, good, bad, kw = _bad_cases()[name]
    z = _data()[0]

    class Net(torch.nn.Module):
        def forward(self, z, *a):
            return loss(z, *a)

    net = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "eager":
            f = net
        elif how == "compile":
            torch._dynamo.reset()
            f = torch.compile(net, backend="aot_eager", fullgraph=True)
        elif how == "export":
            f = torch.export.export(net, (z, *good)).module()
        else:
            f = torch.jit.trace(net, (z, *good), check_trace=False)
        assert torch.isfinite(f(z, *good))
        with pytest.raises((ValueError, RuntimeError), match=f"{name}: "):
            f(z, *bad)


def test_backend_choice_is_marked_constant_as_torch_marks_it():
    """``_backend.resolve`` is marked with fedfast's own copy of ``torch.compiler.assume_constant_result`` (torch's
    imports ``torch._dynamo``, 2 s of ``import fedfast``): the mark must be the one torch's decorator sets, and
    ``import fedfast`` must not import dynamo."""
    import subprocess
    import sys

    from fedfast.ops import _backend

    def f():
        return 0

    marked = dict(vars(torch.compiler.assume_constant_result(f)))
    assert marked and all(getattr(_backend.resolve, k, None) == v for k, v in marked.items()), marked
    assert all(getattr(_backend.resolve_for, k, None) == v for k, v in marked.items())
    code = "import sys, fedfast; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", out
