"""Backend selection for fedfast ops.

Backends: ``reference`` (pure PyTorch, the spec, float64-capable), ``cpu`` (C++ extension
``fedfast._C``), ``triton`` (GPU, or the interpreter when ``TRITON_INTERPRET=1``) and ``cuda``
(C++/CUDA extension ``fedfast._C_cuda``).

Choice: the ``backend=`` argument, else the ``FEDFAST_BACKEND`` environment variable, else
automatic by device (cpu tensors -> ``cpu``; cuda tensors -> ``triton`` if importable, else ``cuda``: both GPU
backends passed ``tests/test_gpu.py`` on an H100 at commit fedc5f8, and the Triton kernels carry the stronger
evidence besides, every CPU test run through the interpreter; ``fedfast doctor`` checks both on a real GPU).
A backend whose extension is missing falls back to ``reference`` with one warning per backend; the extensions are
optional at install time (setup.py), and :func:`ext_status` / ``fedfast doctor`` say why one is missing and how to
build it.
"""

from __future__ import annotations

import importlib
import os
import warnings

import torch
from torch.autograd import forward_ad as _forward_ad

BACKENDS = ("reference", "cpu", "triton", "cuda")
_warned: set[str] = set()
_ext_cache: dict[str, object] = {}
_ext_error: dict[str, str] = {}
# How to build the extensions, for messages: from a checkout, and from any source (sdist, git URL).
BUILD_HINT = (
    "with a C++ compiler (gcc >= 9 or clang) and the torch you run installed: `make install` in a "
    "checkout, or `pip install --no-build-isolation --force-reinstall --no-deps <fedfast source>` "
    "(without FEDFAST_NO_EXT=1)"
)


def _load(modname: str):
    if modname not in _ext_cache:
        try:
            _ext_cache[modname] = importlib.import_module(modname)
        except ImportError as e:
            _ext_cache[modname] = None
            if isinstance(e, ModuleNotFoundError) and e.name == modname:
                _ext_error[modname] = "not built (installed without a working compiler, or with FEDFAST_NO_EXT=1)"
            else:  # present but unloadable: typically built against another torch (an undefined C++ symbol)
                _ext_error[modname] = (
                    f"built but fails to import ({type(e).__name__}: {e}); it was probably "
                    f"compiled against another torch than {_torch_version()}: rebuild it"
                )
    return _ext_cache[modname]


def _torch_version() -> str:
    return torch.__version__


def ext_status(modname: str) -> str | None:
    """``None`` if extension ``modname`` (``fedfast._C`` or ``fedfast._C_cuda``) imports, else why it does not."""
    return None if _load(modname) is not None else _ext_error.get(modname, "not importable")


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


def _version(text: str) -> tuple:
    out = []
    for part in text.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def interpreter_problem() -> str:
    """Why Triton's interpreter (``TRITON_INTERPRET=1``) cannot run fedfast's kernels here, or ``""``.

    Known: triton 3.6's interpreter turns a kernel's integer arguments into 1-element numpy arrays and a loop
    bound ``range(0, n)`` into ``int(array)``, which numpy >= 2.4 refuses (an error since the deprecation of
    converting arrays of ndim > 0 to scalars expired); every kernel with a runtime loop bound then fails. triton
    3.6 with numpy 2.3 and triton 3.7 with numpy 2.4 both pass the interpreter tests. Compiled kernels (a GPU) are
    not affected."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return ""
    try:
        import numpy
        import triton
    except Exception:  # noqa: BLE001 - triton missing: available() says so
        return ""
    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        return (
            f"triton {triton.__version__}'s interpreter cannot run loops with a runtime bound under numpy "
            f"{numpy.__version__} (int() of a 1-element array is an error since numpy 2.4): install "
            f"triton>=3.7 or numpy<2.4"
        )
    return ""


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
        if device_type == "cuda":
            return True
        return os.environ.get("TRITON_INTERPRET") == "1" and not interpreter_problem()
    return False


def _fallback(name: str, why: str) -> str:
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"fedfast: backend {name!r} is not usable ({why}); falling back to 'reference' (correct, "
            f"slower). Build it {BUILD_HINT}; `fedfast doctor` shows what is built.",
            RuntimeWarning,
            stacklevel=4,
        )
    return "reference"


def _constant_result(fn):
    """``torch.compiler.assume_constant_result`` without its import of ``torch._dynamo`` (2 s, most of ``import
    fedfast``): the decorator only marks the function, as this does (``tests/test_nn_graphs.py`` checks the mark is
    the one torch's decorator sets)."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_result
def resolve(backend: str | None, device_type: str) -> str:
    """Return the backend that will run, given the request and the tensors' device type. Under ``torch.compile``
    it runs once, eagerly, while the graph is made (it may import an extension, which traced code cannot)."""
    req = backend if backend is not None else os.environ.get("FEDFAST_BACKEND") or "auto"
    if req == "auto":
        if device_type == "cuda":  # Triton first: the interpreter-tested kernels (see the module docstring)
            if triton_available():
                return "triton"
            if cuda_ext() is not None:
                return "cuda"
            return _fallback("cuda", "neither triton nor fedfast._C_cuda is importable")
        if device_type == "cpu":
            return "cpu" if cpu_ext() is not None else _fallback("cpu", "fedfast._C " + ext_status("fedfast._C"))
        return "reference"
    if req not in BACKENDS:
        key = "backend" if backend is not None else "FEDFAST_BACKEND (environment variable)"
        raise ValueError(f"{key}: must be one of {('auto',) + BACKENDS}, got {req!r}")
    if available(req, device_type):
        return req
    if req in ("cpu", "cuda") and (device_type == ("cpu" if req == "cpu" else "cuda")):
        mod = "fedfast._C" if req == "cpu" else "fedfast._C_cuda"
        return _fallback(req, f"{mod} {ext_status(mod)}")
    why = interpreter_problem() if req == "triton" and device_type != "cuda" else ""
    raise ValueError(f"backend={req!r} cannot run on {device_type} tensors" + (f": {why}" if why else ""))


@_constant_result
def resolve_for(backend: str | None, device_type: str, dtype) -> str:
    """:func:`resolve` for a loss op on tensors of ``dtype``: with the backend chosen automatically (no ``backend=``
    and no ``FEDFAST_BACKEND``), a float64 input on a GPU takes ``reference`` (float64 throughout), as the GPU
    kernels compute in fp32 and refuse float64 by name when asked for explicitly."""
    be = resolve(backend, device_type)
    if be in ("triton", "cuda") and dtype == torch.float64 and backend is None:
        if not os.environ.get("FEDFAST_BACKEND"):
            return "reference"
    return be


def functorch_wrapped(*ts) -> bool:
    """Whether a torch.func transform wraps one of these tensors (a batched or traced value: no host reads)."""
    is_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return is_wrapped is not None and any(isinstance(t, torch.Tensor) and is_wrapped(t) for t in ts)


def functorch_active(*ts) -> bool:
    """Whether a torch.func transform (grad, vmap, jacrev, ...) is running, or wraps one of these tensors."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    if peek is not None and peek() is not None:  # inside a transform, whichever tensors it wraps
        return True
    return functorch_wrapped(*ts)


def forward_ad_active(*ts) -> bool:
    """Whether one of these tensors is a forward-mode AD dual tensor (``torch.autograd.forward_ad``) with a
    tangent at the current level: the fused ops have no forward derivative, so the losses take PyTorch's formulas."""
    if getattr(_forward_ad, "_current_level", 0) < 0:  # no dual level open: nothing to check
        return False
    return any(isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None for t in ts)


_ENV_KEYS = ("FEDFAST_BACKEND", "FEDFAST_VALIDATE")
try:  # os.environ's own dict (bytes keys on POSIX): a membership test without the Mapping's per-key encoding
    _ENV_DATA, _ENV_ENCODED = os.environ._data, tuple(os.environ.encodekey(k) for k in _ENV_KEYS)
except AttributeError:  # pragma: no cover - another Python
    _ENV_DATA, _ENV_ENCODED = None, ()


def env_overrides() -> bool:
    """Whether ``FEDFAST_BACKEND`` or ``FEDFAST_VALIDATE`` is set (0.1 us: a hot path's test)."""
    if _ENV_DATA is not None and _ENV_DATA is os.environ._data:
        return _ENV_ENCODED[0] in _ENV_DATA or _ENV_ENCODED[1] in _ENV_DATA
    return any(k in os.environ for k in _ENV_KEYS)


def plain_eager(*ts) -> bool:
    """Not compiling, not tracing, no torch.func transform: a backend kernel can be called directly, without its
    ``torch.library`` custom op (whose Python dispatch costs ~0.1 ms a call)."""
    return not (
        torch.compiler.is_compiling() or torch.jit.is_tracing() or functorch_active(*ts) or forward_ad_active(*ts)
    )
