"""Bad input raises a clear ValueError/TypeError naming the argument; deferred (no-sync) validation."""

import pytest
import torch
from conftest import cpu_backends

from fedfast import nn as ffnn, ops

BACKENDS = cpu_backends()


def _inp(R=4, C=5):
    return torch.randn(R, C, requires_grad=True), torch.randn(R, C), torch.randint(0, C, (R,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_name_the_argument(backend):
    z, t, y = _inp()
    cases = [
        (lambda: ffnn.KDLoss(backend=backend)(z, t[:3], y), ValueError, "teacher"),
        (lambda: ffnn.KDLoss(backend=backend)(z, t, y[:3]), ValueError, "target"),
        (lambda: ffnn.KDLoss(backend=backend)(z, t, torch.tensor([0, 1, 5, 2])), ValueError, "target"),
        (lambda: ffnn.KDLoss(backend=backend)(z, t, torch.tensor([0, -3, 1, 2])), ValueError, "target"),
        (lambda: ffnn.KDLoss(backend=backend)(z, t, y.float()), TypeError, "target"),
        (lambda: ffnn.KDLoss(backend=backend)(z.detach().long(), t, y), TypeError, "student"),
        (lambda: ffnn.KDLoss(backend=backend)(z[0], t, y), ValueError, "student"),
        (lambda: ffnn.KDLoss(tau=0.0), ValueError, "tau"),
        (lambda: ffnn.KDLoss(tau=-1.0), ValueError, "tau"),
        (lambda: ffnn.KDLoss(reduction="avg"), ValueError, "reduction"),
        (
            lambda: ffnn.ASDLoss(backend=backend)(
                z, t, torch.tensor([0, 1, 2, 3]), torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0])
            ),
            ValueError,
            "class_prior",
        ),
        (lambda: ffnn.ASDLoss(backend=backend)(z, t, y, torch.ones(4)), ValueError, "class_prior"),
        (lambda: ffnn.CADLoss(backend=backend)(z, t, y, torch.full((5,), 1.5)), ValueError, "class_alpha"),
        (lambda: ffnn.CADLoss(backend=backend)(z, t, y, torch.ones(3)), ValueError, "class_alpha"),
        (lambda: ffnn.ADCLoss(backend=backend)(z, t, y, torch.zeros(5)), ValueError, "class_freq"),
        (lambda: ffnn.ADCLoss(backend=backend)(z, t, y, -torch.ones(5)), ValueError, "class_freq"),
        (lambda: ffnn.ADCLoss(lam=1.5), ValueError, "lam"),
        (
            lambda: ffnn.GKDLoss(backend=backend)(z, torch.randn(3, 4, 5), y, teacher_weights=torch.ones(2)),
            ValueError,
            "teacher_weights",
        ),
        (
            lambda: ffnn.GKDLoss(backend=backend)(
                z, torch.randn(3, 4, 5), y, teacher_weights=torch.tensor([1.0, -1, 1])
            ),
            ValueError,
            "teacher_weights",
        ),
        (lambda: ffnn.NTDLoss(backend=backend)(z, t, y, segments=torch.tensor([0, 1, 0, 1])), ValueError, "segments"),
        (lambda: ffnn.NTDLoss(backend=backend)(z, t, y, segments=torch.tensor([0, 0, 1, 9])), ValueError, "segments"),
        (lambda: ffnn.NTDLoss(backend=backend)(z, t, y, segments=torch.tensor([0.0, 0, 1, 1])), TypeError, "segments"),
        (
            lambda: ffnn.NTDLoss(backend=backend)(torch.randn(4, 1), torch.randn(4, 1), torch.zeros(4).long()),
            ValueError,
            "student",
        ),
        (lambda: ops.distill(z, t, y, kind="ntd"), ValueError, "kind"),
        (lambda: ops.distill(z, t, y, backend="tpu"), ValueError, "backend"),
    ]
    for fn, exc, name in cases:
        with pytest.raises(exc, match=name):
            fn()


def test_deferred_validation_flags_without_raising_now():
    """validate='defer': no exception at call time (no host sync); raise_if_invalid() names the argument."""
    z, t, _ = _inp()
    bad = torch.tensor([0, 1, 7, 2])
    out = ffnn.KDLoss(backend="reference", validate="defer")(z, t, bad)
    assert torch.isfinite(out)  # the bad row is treated as ignored meanwhile: no NaN, no crash
    with pytest.raises(ValueError, match="target"):
        ops.raise_if_invalid("cpu")
    ops.raise_if_invalid("cpu")  # flags were reset
    ffnn.KDLoss(backend="reference", validate="off")(z, t, bad)
    ops.raise_if_invalid("cpu")


def test_fallback_warns_once(monkeypatch):
    from fedfast.ops import _backend

    monkeypatch.setattr(_backend, "_ext_cache", {"fedfast._C": None, "fedfast._C_cuda": None})
    monkeypatch.setattr(_backend, "_warned", set())
    monkeypatch.delenv("FEDFAST_BACKEND", raising=False)
    with pytest.warns(RuntimeWarning, match="falling back"):
        assert _backend.resolve(None, "cpu") == "reference"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _backend.resolve(None, "cpu") == "reference"  # only one warning


def test_env_backend_override(monkeypatch):
    from fedfast.ops import _backend

    monkeypatch.setenv("FEDFAST_BACKEND", "reference")
    assert _backend.resolve(None, "cpu") == "reference"
    monkeypatch.setenv("FEDFAST_BACKEND", "cuda")
    with pytest.raises(ValueError, match="cuda"):
        _backend.resolve(None, "cpu")
