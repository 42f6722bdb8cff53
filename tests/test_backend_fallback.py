"""A missing or unloadable compiled extension: one warning per backend naming why and how to build it, the same in
``fedfast doctor``, and the reference backend's results (the real no-extension install: tests/test_packaging.py)."""

import importlib
import warnings

import pytest
import torch

import fedfast
from fedfast import doctor
from fedfast.ops import _backend


@pytest.fixture()
def broken_cpu_ext(monkeypatch, request):
    """fedfast._C behaves as not built (``missing``) or as built against another torch (``abi``)."""
    kind = request.param
    real = importlib.import_module

    def fake(name, *a, **k):
        if name == "fedfast._C":
            if kind == "missing":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            raise ImportError(f"{name}.so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev")
        return real(name, *a, **k)

    monkeypatch.setattr(_backend.importlib, "import_module", fake)
    monkeypatch.setattr(_backend, "_ext_cache", {})
    monkeypatch.setattr(_backend, "_ext_error", {})
    monkeypatch.setattr(_backend, "_warned", set())
    return kind


@pytest.mark.parametrize("broken_cpu_ext", ["missing", "abi"], indirect=True)
def test_one_warning_per_backend_with_the_reason(broken_cpu_ext):
    why = _backend.ext_status("fedfast._C")
    if broken_cpu_ext == "missing":
        assert why.startswith("not built") and "FEDFAST_NO_EXT=1" in why
    else:
        assert "fails to import" in why and "undefined symbol" in why and "another torch" in why
    z, t = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3, 4, 0])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        a = fedfast.nn.NTDLoss(backend="cpu")(z, t, y)
        b = fedfast.nn.NTDLoss()(z, t, y)
        fedfast.nn.KDLoss(backend="cpu")(z, t, y)
    msgs = [str(r.message) for r in rec if issubclass(r.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "backend 'cpu' is not usable" in msgs[0] and why in msgs[0] and "--no-build-isolation" in msgs[0]
    ref = fedfast.nn.NTDLoss(backend="reference")(z, t, y)
    assert torch.equal(a, ref) and torch.equal(b, ref)


@pytest.mark.parametrize("broken_cpu_ext", ["abi"], indirect=True)
def test_doctor_names_the_missing_extension(broken_cpu_ext, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert doctor.main(quick=True) == 0
    out = capsys.readouterr().out
    assert "cpu extension NO" in out and "fedfast._C: built but fails to import" in out
    assert "make install" in out and "--no-build-isolation" in out
    assert "automatic backend on cpu: reference" in out


@pytest.mark.parametrize(
    "triton_v,numpy_v,bad",
    [("3.6.0", "2.4.4", True), ("3.6.0", "2.3.5", False), ("3.7.1", "2.4.6", False), ("3.8.0+git1", "3.0.0", False)],
)
def test_triton_interpreter_with_a_numpy_it_cannot_run(monkeypatch, triton_v, numpy_v, bad):
    """triton 3.6's interpreter fails every kernel with a runtime loop bound under numpy >= 2.4 (measured: 27 of
    the 46 triton tests of the aggregate, client-step, Adam and convolution files; with numpy 2.3 all 52 of a wider
    selection pass): the backend is then off on the CPU, and asking for
    it names the two versions and the fix instead of an InterpreterError from inside a kernel."""
    triton = pytest.importorskip("triton")
    import numpy

    from fedfast.ops.client_conv import client_conv2d

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton, "__version__", triton_v)
    monkeypatch.setattr(numpy, "__version__", numpy_v)
    assert bool(_backend.interpreter_problem()) == bad
    assert _backend.available("triton", "cpu") == (not bad)
    assert _backend.available("triton", "cuda")  # compiled kernels are not affected
    if not bad:
        assert _backend.resolve("triton", "cpu") == "triton"
        return
    with pytest.raises(ValueError, match=rf"triton {triton_v}'s interpreter .* numpy {numpy_v}.*triton>=3.7"):
        _backend.resolve("triton", "cpu")
    with pytest.raises(ValueError, match="triton>=3.7 or numpy<2.4"):
        client_conv2d(torch.zeros(1, 4, 5, 5), torch.zeros(1, 3, 4, 3, 3), None, impl="triton")
    from fedfast.sim.runtime import conv_impl

    with pytest.raises(ValueError, match=r"conv: 'triton' .*triton>=3.7 or numpy<2.4.*use conv"):
        conv_impl("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _backend.interpreter_problem() == ""


def test_automatic_conv_needs_no_triton(monkeypatch):
    """conv = "auto" picks the device's default (CUDA: "hybrid", which needs triton) and falls back to "grouped"
    where triton cannot run; an explicit "hybrid" there is refused by name."""
    from fedfast.ops import _backend
    from fedfast.sim import runtime

    monkeypatch.setitem(runtime.CONV_AUTO, "cpu", "hybrid")
    monkeypatch.setattr(_backend, "available", lambda name, dev: False)
    assert runtime.conv_impl("auto", torch.device("cpu")) == "grouped"
    with pytest.raises(ValueError, match=r"conv: 'hybrid' runs on CUDA"):
        runtime.conv_impl("hybrid", torch.device("cpu"))
    monkeypatch.setattr(_backend, "available", lambda name, dev: True)
    assert runtime.conv_impl("auto", torch.device("cpu")) == "hybrid"
    assert runtime.CONV_AUTO["cuda"] == "hybrid"
