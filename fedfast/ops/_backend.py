"""Backend selection for fedfast ops.

Backends: ``reference`` (pure PyTorch, the spec, float64-capable), ``cpu`` (C++ extension
``fedfast._C``), ``triton`` (GPU, or the interpreter when ``TRITON_INTERPRET=1``) and ``cuda``
(C++/CUDA extension ``fedfast._C_cuda``).

Choice: the ``backend=`` argument, else the ``FEDFAST_BACKEND`` environment variable, else
automatic by device (cpu tensors -> ``cpu``; cuda tensors -> ``triton`` if importable, else ``cuda``: both GPU
backends are compiled here but neither has run on a GPU yet, and the Triton kernels carry the stronger evidence,
every test run through the interpreter; ``fedfast doctor`` checks both on a real GPU).
A backend whose extension is missing falls back to ``reference`` with one warning per backend.
"""
from __future__ import annotations

import importlib
import os
import warnings

BACKENDS = ("reference", "cpu", "triton", "cuda")
_warned: set[str] = set()
_ext_cache: dict[str, object] = {}


def _load(modname: str):
    if modname not in _ext_cache:
        try:
            _ext_cache[modname] = importlib.import_module(modname)
        except ImportError:
            _ext_cache[modname] = None
    return _ext_cache[modname]


def cpu_ext():
    """The compiled CPU extension (``fedfast._C``) or ``None``."""
    return _load("fedfast._C")


def cuda_ext():
    """The compiled CUDA extension (``fedfast._C_cuda``) or ``None``."""
    return _load("fedfast._C_cuda")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def available(name: str, device_type: str) -> bool:
    """Whether backend ``name`` can run on tensors of ``device_type``."""
    if name == "reference":
        return True
    if name == "cpu":
        return device_type == "cpu" and cpu_ext() is not None
    if name == "cuda":
        return device_type == "cuda" and cuda_ext() is not None
    if name == "triton":
        if not triton_available():
            return False
        return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return False


def _fallback(name: str, why: str) -> str:
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"fedfast: backend {name!r} is not usable ({why}); falling back to 'reference'. "
                      f"Build the extension with `pip install -e . --no-build-isolation` (see README).",
                      RuntimeWarning, stacklevel=4)
    return "reference"


def resolve(backend: str | None, device_type: str) -> str:
    """Return the backend that will run, given the request and the tensors' device type."""
    req = backend if backend is not None else os.environ.get("FEDFAST_BACKEND") or "auto"
    if req == "auto":
        if device_type == "cuda":  # Triton first: the interpreter-tested kernels (see the module docstring)
            if triton_available():
                return "triton"
            if cuda_ext() is not None:
                return "cuda"
            return _fallback("cuda", "neither triton nor fedfast._C_cuda is importable")
        if device_type == "cpu":
            return "cpu" if cpu_ext() is not None else _fallback("cpu", "fedfast._C is not built")
        return "reference"
    if req not in BACKENDS:
        key = "backend" if backend is not None else "FEDFAST_BACKEND (environment variable)"
        raise ValueError(f"{key}: must be one of {('auto',) + BACKENDS}, got {req!r}")
    if available(req, device_type):
        return req
    if req in ("cpu", "cuda") and (device_type == ("cpu" if req == "cpu" else "cuda")):
        return _fallback(req, f"fedfast.{'_C' if req == 'cpu' else '_C_cuda'} is not built")
    raise ValueError(f"backend={req!r} cannot run on {device_type} tensors")
