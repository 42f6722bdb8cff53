"""What the engine checks of a user's model before it trains one (``docs/own-model.md``, the own-model contract).

* :func:`check_module`: the kinds of module the engine cannot run with per-client weights, refused by name before
  anything runs them (TorchScript, ``DataParallel``, meta-device weights, no parameters, weights not float32).
* :func:`forward_effects`: a training forward that changes a buffer other than BatchNorm's running statistics (an
  EMA of batch means, a step counter). fedfast's executors update BatchNorm's statistics per client, over a client's
  valid rows only; another buffer updated in the forward would be updated once for all clients (or not at all)
  and would see the padding rows of a partial minibatch, so the model is refused, naming the buffer and its layer.
* :func:`cross_sample`: whether a sample's training output depends on the other rows of its minibatch or on the
  minibatch's size (a hand-written batch standardisation, a branch on ``x.shape[0]``). BatchNorm does, and the
  engine leaves the padding rows out of its statistics; anything else would see them. Found by running the model on
  a full minibatch and on the rows of a partial one (BatchNorm made per-sample for the probe, dropout off, one
  seed) and naming the innermost module whose output rows differ while its input rows do not. Refused unless every
  minibatch is full (``drop_last = true``), where the batched forward equals the loop's.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import traceback
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

_BN = nn.modules.batchnorm._BatchNorm
_BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def buffers_kept(model: nn.Module):
    """The model's buffers as they were before the block (a probe forward in training mode updates BatchNorm's
    running statistics and ``num_batches_tracked``; the run starts from the model as given)."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


def module_where(m: nn.Module) -> str:
    """``"ClassName (file:line)"``: where the module's class defines its forward."""
    fn = getattr(type(m), "forward", None)
    try:
        fname = inspect.getsourcefile(fn)
        line = inspect.getsourcelines(fn)[1]
    except (TypeError, OSError):
        return type(m).__name__
    return f"{type(m).__name__} ({fname}:{line})"


def check_module(model: nn.Module) -> None:
    """TypeError / ValueError naming what the engine cannot run: a TorchScript module, ``DataParallel`` /
    ``DistributedDataParallel``, weights on the meta device, no parameters, or parameters other than float32."""
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            f"model: a TorchScript module ({type(model).__name__}, from torch.jit.script or torch.jit.trace) cannot "
            f"run with each client's own weights (torch.func.functional_call refuses it); pass the nn.Module itself"
        )
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise TypeError(
            f"model: an {type(model).__name__} wrapper; pass the model inside it (model.module): fedfast places the "
            f"clients on its device itself, and torch.distributed runs split the clients between processes"
        )
    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            if t.is_meta:
                raise ValueError(
                    f"model: {kind} {name!r} is on the meta device (no values); materialise the model first "
                    f"(model.to_empty(device='cpu') then initialise its weights)"
                )
    params = list(model.named_parameters())
    if not params:
        raise ValueError(f"model: {type(model).__name__} has no parameters: there is nothing for the clients to train")
    for name, p in params:
        if p.dtype != torch.float32:
            raise TypeError(
                f"model: parameter {name!r} is {p.dtype}; the engine trains float32 weights (each client's row of "
                f"one float32 buffer): call model.float() (float64 runs are for the tests' reference loops only)"
            )


def _bn_per_sample(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A BatchNorm layer as a per-sample map for the probe: zero mean, unit variance, its affine weights."""
    C = x.shape[1]
    zero, one = torch.zeros(C, dtype=x.dtype, device=x.device), torch.ones(C, dtype=x.dtype, device=x.device)
    return F.batch_norm(x, zero, one, m.weight, m.bias, False, 0.0, m.eps)


@contextlib.contextmanager
def _probe_mode(model: nn.Module, train: bool):
    """The model in ``train`` mode with its BatchNorm layers per-sample and its dropout layers off, and its
    buffers and RNG state as they were after the block."""
    was = {m: m.training for m in model.modules()}
    bns = [m for m in model.modules() if isinstance(m, _BN)]
    try:
        model.train(train)
        for m in model.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                m.eval()
        for m in bns:
            m.forward = lambda x, m=m: _bn_per_sample(m, x)
        with buffers_kept(model), torch.random.fork_rng(devices=[]), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. the std of one row
            yield
    finally:
        for m in bns:
            del m.forward
        for m, t in was.items():
            m.training = t


def _rows(v, k: int):
    """The first ``k`` rows of every tensor in a module's input or output (the batch dimension: dim 0)."""
    if torch.is_tensor(v):
        return v[:k].detach().clone() if v.dim() and v.shape[0] >= k else None
    if isinstance(v, (tuple, list)):
        return [_rows(t, k) for t in v]
    if isinstance(v, dict):
        return [_rows(t, k) for t in v.values()]
    return None


def _same(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        if a.shape != b.shape:
            return False
        if not a.is_floating_point():
            return bool(torch.equal(a, b))
        scale = float(a.abs().max()) if a.numel() else 0.0
        # 1e-3 of the values' scale: a gemm's rounding differs with the rows it is given; mixing rows is far larger
        return bool((a - b).abs().max() <= 1e-3 * max(scale, 1e-6)) if a.numel() else True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return (a is None) == (b is None)


def _record(model: nn.Module, x: torch.Tensor, k: int, seed: int) -> dict:
    """``{module name: (input rows, output rows)}`` of one forward on ``x``, the first ``k`` rows of each."""
    got: dict = {}

    def hook(n, i, o) -> None:  # None: the module's output stays its own
        got.setdefault(n, (_rows(i, k), _rows(o, k)))

    hooks = [m.register_forward_hook(lambda m_, i, o, n=n: hook(n, i, o)) for n, m in model.named_modules()]
    try:
        torch.manual_seed(seed)
        model(x)
    finally:
        for h in hooks:
            h.remove()
    return got


def _culprit(model: nn.Module, a: dict, b: dict) -> str:
    """The innermost module whose output rows differ between two probe forwards while its input rows agree."""
    mods = dict(model.named_modules())
    bad = [n for n in a if n in b and _same(a[n][0], b[n][0]) and not _same(a[n][1], b[n][1])]
    inner = [n for n in bad if not any(o != n and (not n or o.startswith(f"{n}.")) for o in bad)]
    if not inner:
        return ""
    n = inner[0]
    return f"layer {n!r} ({module_where(mods[n])})" if n else f"its forward ({module_where(model)})"


def cross_sample(model: nn.Module, x: torch.Tensor, sizes) -> tuple[str, int]:
    """``("", 0)`` if the first row of the minibatch ``x`` gets the same training-mode output as on a minibatch of
    its first ``k`` rows alone, for each ``k`` in ``sizes`` (BatchNorm per-sample for the probe), else ``(the
    module that mixes the rows, named, k)``. Every module's first output row is compared, so the innermost module
    whose output differs while its input does not is found. A model whose training forward draws random numbers
    outside ``nn.Dropout`` is probed in eval mode, where it is deterministic."""
    sizes = [int(k) for k in sizes if 0 < int(k) < x.shape[0]]
    for train in (True, False):
        with _probe_mode(model, train):
            full = _record(model, x, 1, seed=0)
            again = _record(model, x, 1, seed=1)
            if any(not _same(full[n][1], again[n][1]) for n in full if n in again):
                continue  # random in this mode: the rows cannot be compared; eval mode next
            for k in sizes:
                why = _culprit(model, full, _record(model, x[:k], 1, seed=0))
                if why:
                    return why, k
            return "", 0
    return "", 0


def forward_effects(model: nn.Module, x: torch.Tensor) -> str:
    """ "" if a training forward of the model changes no buffer but BatchNorm's running statistics, else the first
    buffer it changes (its name, dtype and layer), named."""
    mods = dict(model.named_modules())
    before = {n: b.detach().clone() for n, b in model.named_buffers()}  # compared after, and put back
    was = model.training
    try:
        with torch.no_grad():
            model.train(True)
            model(x)
        for n, b in model.named_buffers():
            owner, _, leaf = n.rpartition(".")
            if isinstance(mods.get(owner), _BN) and leaf in _BN_BUFFERS:
                continue
            if n in before and not (before[n].shape == b.shape and torch.equal(before[n], b)):
                return f"buffer {n!r} ({b.dtype}) of {module_where(mods[owner]) if owner else module_where(model)}"
        return ""
    finally:
        model.train(was)
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in before and before[n].shape == b.shape:
                    b.copy_(before[n])


_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}


def _tensors(obj) -> list:
    return [t for t in tree_flatten(obj)[0] if torch.is_tensor(t)]


class HostReads(torch.overrides.TorchFunctionMode):
    """Inside the block, ``weights`` names the first read of a tensor's value on the host (``.item()``, ``bool()``
    in an ``if``, ``.tolist()``, ``.numpy()``, ``int()`` / ``float()``) of a value computed from the weights (a
    tensor that requires grad, or one made from such a tensor inside the block, through comparisons and
    ``detach()`` too): an executor running several clients as one batch would make one read for all of them."""

    def __init__(self):
        super().__init__()
        self.weights = ""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = _tensors((args, kwargs))
        from_weights = any(t.requires_grad or getattr(t, "_fedfast_weights", False) for t in ins)
        name = getattr(func, "__name__", "")
        if name in _READS and from_weights and not self.weights:
            self.weights = f"Tensor.{name} of a value computed from the weights"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "converting a tensor with requires_grad=True to a scalar"
            out = func(*args, **kwargs)
        if from_weights:
            for t in _tensors(out):
                with contextlib.suppress(AttributeError, RuntimeError):
                    t._fedfast_weights = True
        return out


def model_line(e: BaseException) -> str:
    """``"file:line: code"`` of the innermost frame of ``e``'s traceback outside PyTorch and fedfast (the model's
    line that raised), or ""."""
    skip = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)
    hit = ""
    for fs in traceback.extract_tb(e.__traceback__):
        if not fs.filename.startswith(skip) and not fs.filename.startswith("<"):
            hit = f"{fs.filename}:{fs.lineno}: {(fs.line or '').strip()}"
    return hit
