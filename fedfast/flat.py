"""Flat client state: N copies of a model's parameters in one contiguous buffer.

``ClientStack`` holds the parameters of N clients as one fp32 tensor ``[N, P]`` (and the floating-point
buffers, e.g. BatchNorm statistics, as ``[N, B]``), with zero-copy per-parameter views ``[N, *shape]``
that ``torch.func.functional_call`` + ``torch.func.vmap`` accept, so every whole-model operation of a
federated round (broadcast of the global model, a client step, aggregation) is one op over a flat buffer
instead of a Python loop over clients and ``state_dict`` entries (pfl-research keeps one model and
updates it in place; fedfast keeps one buffer for all clients).

``ClientState`` is per-client state of the methods that keep it (FedDyn ``h_k``, SCAFFOLD ``c_k``, MOON's
previous model) for up to all K clients, on the device or in pinned host memory, fp32 or bf16; the
rows of the participating clients are gathered into / scattered from a ``[n, P]`` working buffer.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import shutil
import tempfile
import types
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from .batched import plan
from .ops.client_batch_norm_reference import client_batch_norm_reference
from .rowfile import RowFile, paths_of



@dataclass(frozen=True)
class _Slot:
    name: str
    shape: torch.Size
    offset: int
    numel: int


def _layout(named) -> tuple[list[_Slot], int]:
    slots, off = [], 0
    for name, t in named:
        n = t.numel()
        slots.append(_Slot(name, t.shape, off, n))
        off += n
    return slots, off


def _model_buffers(module: nn.Module):
    """The buffers a client's model carries: the floating-point ones (BatchNorm running statistics, ...) and
    BatchNorm's ``num_batches_tracked`` (held as a float in the flat buffer vector: exact up to 2^24 steps). Other
    integer and boolean buffers (position ids, masks) are constants of the architecture and stay in the module."""
    out = []
    for mod_name, mod in module.named_modules():
        for n, b in mod.named_buffers(recurse=False):
            if b is not None and (b.is_floating_point() or (
                    n == "num_batches_tracked" and isinstance(mod, nn.modules.batchnorm._NormBase))):
                out.append((f"{mod_name}.{n}" if mod_name else n, b))
    return out


def has_running_stats(module: nn.Module) -> bool:
    """Whether the model has BatchNorm layers that keep running statistics (``track_running_stats=True``)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
               for m in module.modules())


class FlatLayout:
    """Where each parameter (and float buffer) of a module lives inside a flat vector."""

    def __init__(self, module: nn.Module):
        self.params, self.P = _layout(module.named_parameters())
        self.buffers, self.B = _layout(_model_buffers(module))
        # the buffer slots that hold integers (num_batches_tracked): averaged, then rounded to the nearest integer
        self.integer_buffers = [s for s, (_, b) in zip(self.buffers, _model_buffers(module)) if not b.is_floating_point()]

    @staticmethod
    def _views(flat: Tensor, slots: list[_Slot]) -> "OrderedDict[str, Tensor]":
        lead = flat.shape[:-1]
        return OrderedDict((s.name, flat[..., s.offset:s.offset + s.numel].view(tuple(lead) + tuple(s.shape)))
                           for s in slots)

    def param_views(self, flat: Tensor) -> "OrderedDict[str, Tensor]":
        """Zero-copy views ``[*lead, *shape]`` of a ``[*lead, P]`` parameter buffer."""
        return self._views(flat, self.params)

    def buffer_views(self, flat: Tensor) -> "OrderedDict[str, Tensor]":
        return self._views(flat, self.buffers)

    def flatten_params(self, module: nn.Module, out: Tensor | None = None) -> Tensor:
        """The module's parameters as one ``[P]`` vector (exact copy)."""
        return self._flatten([p for _, p in module.named_parameters()], self.P, out)

    def flatten_buffers(self, module: nn.Module, out: Tensor | None = None) -> Tensor:
        return self._flatten([b for _, b in _model_buffers(module)], self.B, out)

    def integer_mask(self, device=None) -> Tensor:
        """[B] True at the buffer values that are integers in the module (BatchNorm's num_batches_tracked)."""
        m = torch.zeros(self.B, dtype=torch.bool, device=device)
        for s in self.integer_buffers:
            m[s.offset:s.offset + s.numel] = True
        return m

    def load_buffers(self, module: nn.Module, flat: Tensor) -> None:
        """The module's buffers set to ``flat`` [B] (integers rounded to the nearest)."""
        with torch.no_grad():
            for (_, b), v in zip(_model_buffers(module), self.buffer_views(flat).values()):
                b.copy_(v if b.is_floating_point() else v.round())

    @staticmethod
    def _flatten(tensors, n, out):
        if out is None:
            dev = tensors[0].device if tensors else "cpu"
            out = torch.empty(n, dtype=torch.float32, device=dev)
        if tensors:
            torch.cat([t.detach().reshape(-1).to(out.dtype) for t in tensors], out=out)
        return out

    def check_module(self, module: nn.Module) -> None:
        names = [n for n, _ in module.named_parameters()]
        if names != [s.name for s in self.params] or \
                [p.shape for _, p in module.named_parameters()] != [s.shape for s in self.params]:
            raise ValueError("module: its parameters do not match this layout (names or shapes differ)")


class ClientStack:
    """N copies of ``module``'s parameters in one contiguous ``[N, P]`` fp32 buffer (plus ``[N, B]`` float
    buffers), with zero-copy views.

    >>> stack = ClientStack(model, 100)            # all rows = model's weights
    >>> out = stack.vmap_forward(x)                 # x: [N, batch, ...] -> [N, batch, C]
    >>> stack.broadcast_(global_flat)               # one copy into all rows
    >>> stack.load_into(model, k)                   # client k back into an nn.Module (exact)

    ``module`` itself is used as the stateless template for ``torch.func.functional_call``.
    """

    def __init__(self, module: nn.Module, num_clients: int, *, device=None, dtype: torch.dtype = torch.float32,
                 use_executor: bool = True):
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")
        if int(num_clients) < 1:
            raise ValueError(f"num_clients: must be >= 1, got {num_clients}")
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype: client parameters are kept in fp32 (or fp64), got {dtype}")
        self.module = module
        self.layout = FlatLayout(module)
        self.N = int(num_clients)
        dev = torch.device(device) if device is not None else next(module.parameters()).device
        self.params = torch.empty(self.N, self.layout.P, dtype=dtype, device=dev)
        self.buffers = torch.empty(self.N, self.layout.B, dtype=dtype, device=dev)
        self.broadcast_module_(module)
        self.plan = plan(module)[0] if use_executor else None  # None: torch.func.vmap of functional_call

    def leaf_views(self, rows: slice) -> "OrderedDict[str, Tensor]":
        """Per-parameter autograd leaves ``[n, *shape]`` sharing storage with rows ``rows``; :meth:`flat_grad`
        joins their gradients into one ``[n, P]`` tensor (slicing one ``[n, P]`` leaf instead makes autograd
        zero-fill a full ``[n, P]`` buffer per parameter)."""
        return OrderedDict((k, v.detach().requires_grad_(True)) for k, v in self.param_views(rows).items())

    def leaves_of(self, flat: Tensor) -> "OrderedDict[str, Tensor]":
        """Per-parameter autograd leaves ``[n, *shape]`` viewing a ``[n, P]`` buffer other than the stack (SAM's
        perturbed weights)."""
        return OrderedDict((k, v.detach().requires_grad_(True)) for k, v in self.layout.param_views(flat).items())

    def flat_grad(self, loss: Tensor, leaves: "OrderedDict[str, Tensor]", out: Tensor | None) -> Tensor | list:
        """d loss / d leaves as one ``[n, P]`` tensor written into ``out`` (``torch.autograd.grad``: no
        ``.grad`` accumulation, whose layout contract would copy each gradient to the leaf's strides); with
        ``out=None`` the per-parameter pieces ``[n, numel_p]`` in column order, uncopied (what
        :func:`fedfast.ops.client_step` reads in place on the CPU backend)."""
        gs = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        n = next(iter(leaves.values())).shape[0]
        gs = [g.reshape(n, -1) if g is not None else torch.zeros(n, lf.numel() // n, device=lf.device)
              for g, lf in zip(gs, leaves.values())]
        return gs if out is None else torch.cat(gs, 1, out=out)

    # -- views -------------------------------------------------------------------------------------
    @property
    def P(self) -> int:
        return self.layout.P

    @property
    def device(self) -> torch.device:
        return self.params.device

    def param_views(self, rows: slice | None = None) -> "OrderedDict[str, Tensor]":
        """``{name: [n, *shape]}`` zero-copy views of rows ``rows`` (default all)."""
        return self.layout.param_views(self.params if rows is None else self.params[rows])

    def buffer_views(self, rows: slice | None = None) -> "OrderedDict[str, Tensor]":
        return self.layout.buffer_views(self.buffers if rows is None else self.buffers[rows])

    # -- whole-model operations ----------------------------------------------------------------------
    def broadcast_(self, flat_params: Tensor, flat_buffers: Tensor | None = None, rows: slice | None = None):
        """Copy one model ``[P]`` (and ``[B]`` buffers) into all rows (or ``rows``): one op each."""
        if flat_params.shape != (self.P,):
            raise ValueError(f"flat_params: expected shape ({self.P},), got {tuple(flat_params.shape)}")
        dst = self.params if rows is None else self.params[rows]
        dst.copy_(flat_params.to(dst.dtype).expand_as(dst))
        if flat_buffers is not None and self.layout.B:
            if flat_buffers.shape != (self.layout.B,):
                raise ValueError(f"flat_buffers: expected shape ({self.layout.B},), got {tuple(flat_buffers.shape)}")
            dstb = self.buffers if rows is None else self.buffers[rows]
            dstb.copy_(flat_buffers.to(dstb.dtype).expand_as(dstb))
        return self

    def broadcast_module_(self, module: nn.Module, rows: slice | None = None):
        """Broadcast an ``nn.Module``'s parameters and float buffers into all rows (or ``rows``)."""
        self.layout.check_module(module)
        flat = self.layout.flatten_params(module).to(self.device)
        fb = self.layout.flatten_buffers(module).to(self.device) if self.layout.B else None
        return self.broadcast_(flat, fb, rows)

    def load_into(self, module: nn.Module, k: int) -> nn.Module:
        """Write client ``k``'s parameters and buffers into ``module`` (exact)."""
        self.layout.check_module(module)
        with torch.no_grad():
            for (name, p), v in zip(module.named_parameters(), self.param_views(slice(k, k + 1)).values()):
                p.copy_(v[0])
        self.layout.load_buffers(module, self.buffers[k])
        return module

    def state_dict(self, k: int) -> "OrderedDict[str, Tensor]":
        """Client ``k`` as a ``state_dict``-style mapping of views (parameters and float buffers)."""
        sd = OrderedDict((n, v[0]) for n, v in self.param_views(slice(k, k + 1)).items())
        sd.update((n, v[0]) for n, v in self.buffer_views(slice(k, k + 1)).items())
        return sd

    def load_state_dict(self, k: int, state: dict) -> None:
        """Write a ``state_dict`` (names as in the module) into row ``k`` (exact)."""
        missing = [s.name for s in self.layout.params + self.layout.buffers if s.name not in state]
        if missing:
            raise ValueError(f"state: missing entries {missing[:5]}")
        for n, v in self.param_views(slice(k, k + 1)).items():
            v[0].copy_(state[n])
        for n, v in self.buffer_views(slice(k, k + 1)).items():
            v[0].copy_(state[n])

    # -- batched forward ------------------------------------------------------------------------------
    def vmap_forward(self, x: Tensor, rows: slice | None = None, *, params: dict | None = None,
                     features: nn.Module | None = None, buffers: dict | None = None, valid: Tensor | None = None,
                     update: bool = False):
        """``f(theta_k, x_k)`` for every row k at once: ``x`` is ``[n, batch, ...]``, returns ``[n, batch, ...]``.

        ``params`` (default: this stack's views) lets autograd-tracked tensors be substituted. ``features``:
        a submodule of the model whose *input* is returned too, ``(features [n, batch, d], out)`` (MOON's
        representation: the classifier's input, see :func:`classifier_of`). ``buffers``: ``{name: [n, *shape]}``
        (default: this stack's buffer rows). ``valid`` [n, batch]: the rows that are data (False: the padding of a
        client's last partial minibatch), which alone enter BatchNorm's batch statistics. ``update``: a training
        forward updates BatchNorm's running buffers in ``buffers`` (the local step's forward; no other)."""
        p = self.param_views(rows) if params is None else params
        b = self.buffer_views(rows) if buffers is None else buffers
        if self.plan is not None:  # a vmap-free executor: fedfast.batched (traced graph) or fedfast.grouped
            return self.plan.forward(p, x, self.module.training, features, buffers=b, valid=valid, update=update)
        f = functional_forward(self.module, features, update=update)
        with fedfast_batch_norm(self.module):  # dropout: independent per client
            return vmap(f, in_dims=(0, 0, 0, None if valid is None else 0), randomness="different")(p, b, x, valid)


# -- BatchNorm on the vmap path ------------------------------------------------------------------------------
_BN_STEP: contextvars.ContextVar = contextvars.ContextVar("fedfast_bn_step", default=None)


def _bn_forward(self, input):
    """``nn.BatchNorm``'s forward as fedfast runs it (:func:`fedfast.ops.client_batch_norm_reference` with n = 1):
    two-pass statistics over the valid rows only, running buffers updated only by a local step's forward (the
    ``(valid, update)`` of the call in ``_BN_STEP``)."""
    valid, update = _BN_STEP.get() or (None, False)
    self._check_input_dim(input)
    tracks = self.running_mean is not None and self.running_var is not None

    def one(t):
        return None if t is None else t[None]
    return client_batch_norm_reference(
        input, 1, one(self.weight), one(self.bias), valid=one(valid), running_mean=one(self.running_mean),
        running_var=one(self.running_var), num_batches_tracked=one(self.num_batches_tracked) if tracks else None,
        use_batch_stats=self.training or not tracks, update=bool(update and self.training and tracks),
        momentum=self.momentum, eps=self.eps)


@contextlib.contextmanager
def fedfast_batch_norm(module: nn.Module):
    """Inside the block, the BatchNorm layers of ``module`` run :func:`_bn_forward` (the model's forward through
    ``functional_call``: the vmap executor and single-model forwards); as they were after."""
    bns = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and "forward" not in vars(m)]
    for m in bns:
        m.forward = types.MethodType(_bn_forward, m)
    try:
        yield
    finally:
        for m in bns:
            vars(m).pop("forward", None)


def find_classifier(model: nn.Module, probe: Tensor | None = None, name: str | None = None) -> str:
    """The qualified name of the model's classifier: the ``nn.Linear`` whose input is the representation (MOON's
    features, ``Step.features``) and whose output is the logits.

    * ``name`` (the run's ``features_layer``), else the model's own ``features_layer`` attribute, names it: an
      ``nn.Linear``, or a module holding it (then the last ``nn.Linear`` to run inside it, e.g. a projection head
      put in the classifier's place).
    * Otherwise, with ``probe`` (a batch of inputs), it is the last ``nn.Linear`` to run in one forward -
      execution order, not declaration order (a model may declare its head first). It is refused as ambiguous,
      naming the fix (``features_layer``), when that layer runs more than once, or when the model's output is not
      that layer's output or a view of it (something follows it: a scale, a log-softmax, a second head).
    * Without either, the last ``nn.Linear`` declared (no forward to watch).

    ValueError names ``features_layer`` (or ``model``) and the model's ``nn.Linear`` layers."""
    mods = dict(model.named_modules())
    linears = [n for n, m in mods.items() if isinstance(m, nn.Linear)]
    known = f"its nn.Linear layers: {', '.join(repr(n) for n in linears) or 'none'}"
    if name is None:
        name = getattr(model, "features_layer", None)
        if name is not None and not isinstance(name, str):
            raise ValueError(f"model.features_layer: expected a layer name, got {name!r}")
    scope = ""
    if name:
        if name not in mods:
            raise ValueError(f"features_layer: the model has no layer {name!r} ({known})")
        if isinstance(mods[name], nn.Linear):
            return name
        scope = name
        if not any(n.startswith(name + ".") for n in linears):
            raise ValueError(f"features_layer: {name!r} is a {type(mods[name]).__name__} with no nn.Linear in it; "
                             f"the classifier is an nn.Linear ({known})")
    if probe is None:
        inside = [n for n in linears if not scope or n.startswith(scope + ".")]
        if not inside:
            raise ValueError(f"model: has no nn.Linear layer to take the representation from ({known})")
        return inside[-1]
    calls: list[tuple[str, Tensor]] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out, n=n: calls.append((n, out)))
             for n, m in mods.items() if isinstance(m, nn.Linear) and (not scope or n.startswith(scope + "."))]
    modes = [(m, m.training) for m in model.modules()]
    model.eval()  # no running statistics updated, no dropout
    try:
        with torch.no_grad():
            out = model(probe)
    finally:
        for h in hooks:
            h.remove()
        for m, was in modes:
            m.training = was
    if not calls:
        where = f"inside features_layer {scope!r}" if scope else "in the model's forward"
        raise ValueError(f"{'features_layer' if scope else 'model'}: no nn.Linear runs {where}, so there is no "
                         f"classifier to take the features from ({known})")
    last, y = calls[-1]
    runs = sum(1 for n, _ in calls if n == last)
    fix = (f"name the classifier: features_layer = \"<layer>\" in the run config (SimConfig(features_layer=...)), "
           f"or a features_layer attribute on the model ({known})")
    if runs > 1:
        raise ValueError(f"model: its last nn.Linear to run, {last!r}, runs {runs} times in one forward, so which "
                         f"call is the classifier is ambiguous; {fix}")
    same = out is y or (torch.is_tensor(out) and out.numel() == y.numel() and out.data_ptr() == y.data_ptr())
    if not scope and not same:  # the output, or a view of it (a reshape), else something follows the layer
        raise ValueError(f"model: its output is not the output of the last nn.Linear to run ({last!r}): something "
                         f"follows it, so the classifier is ambiguous; {fix}")
    return last


def classifier_of(module: nn.Module, probe: Tensor | None = None, name: str | None = None) -> nn.Module:
    """The classifier module :func:`find_classifier` names (its input is the representation MOON contrasts)."""
    return module.get_submodule(find_classifier(module, probe, name))


def functional_forward(module: nn.Module, features: nn.Module | None = None, *, update: bool = False):
    """``f(params, buffers, x, valid)`` -> ``out`` (or ``(input of features, out)``) with ``functional_call``; run
    it inside :func:`fedfast_batch_norm` so BatchNorm layers leave ``valid``'s padding rows (None: none) out of
    their statistics and update their running buffers only when ``update``."""
    def f(pp, bb, xx, vv=None):
        got = []
        h = features.register_forward_pre_hook(lambda _m, inp: got.append(inp[0])) if features is not None else None
        token = _BN_STEP.set((vv, update))
        try:
            out = functional_call(module, {**pp, **bb}, (xx,))
        finally:
            _BN_STEP.reset(token)
            if h is not None:
                h.remove()
        return (got[-1], out) if features is not None else out
    return f


def _physical_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 30


class ClientState:
    """Per-client state of K clients (FedDyn h_k, SCAFFOLD c_k, MOON's previous model), ``cols`` values each,
    stored for the clients that were written only: a client never written reads as ``fill`` (its initial
    value), so memory grows with the clients a run trains (at most rounds x cohort), not with K.

    Rows live in one table ``[1 + written, cols]`` (row 0: the initial value) that grows as it fills; the
    client -> row map is a host int64 array [K] (8 bytes a client, no Python object per client); a gather and a
    scatter are one ``index_select`` / ``index_copy_`` each. ``dtype`` fp32 or bf16 (storage; gathered rows are
    fp32), ``pin_memory=True`` keeps the table in pinned host memory (rows copied to ``device``). Rows are
    addressed by client id (a tensor, array or list; a device tensor is read to the host once per call).

    ``store``: where the table lives. ``"memory"`` (the default): device or host memory. ``"disk"``: a
    memory-mapped file (:mod:`fedfast.rowfile`, ``<directory>/<name>.rows`` and ``.stamps``) from the first write
    on. ``"auto"``: memory while the table fits ``memory_budget`` bytes, then the file (the rows written so far
    are copied there once). Without ``directory`` the file is in a temporary directory removed with the store,
    and :meth:`state_dict` holds the rows (as in memory). With ``directory`` (a run's directory) the file outlives
    the process and a checkpoint refers to it instead of copying it: then rows are copy-on-write (a scatter writes
    new rows, never a row the latest checkpoint holds, so a process killed during a scatter loses nothing) and a
    row superseded since the latest :meth:`state_dict` is reused after the next one; the newest checkpoint is
    always resumable, an older one whose rows were reused is refused by :meth:`load_state_dict` (each row's
    stamp), never read as garbage. ``max_rows``: the most rows a run can write (``1 + min(K, rounds x cohort)``;
    a hint that caps growth, not a limit)."""

    def __init__(self, num_clients: int, P: int, *, device=None, dtype: torch.dtype = torch.float32,
                 pin_memory: bool = False, fill=0.0, store: str = "memory", directory: str | None = None,
                 memory_budget: int | None = None, name: str = "client-state", max_rows: int | None = None):
        if dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"dtype: per-client state is fp32 or bf16, got {dtype}")
        if int(num_clients) < 1 or int(P) < 1:
            raise ValueError(f"num_clients and P: must be >= 1, got {num_clients}, {P}")
        if store not in ("memory", "disk", "auto"):
            raise ValueError(f"store: 'memory', 'disk' or 'auto', got {store!r}")
        if memory_budget is not None and not memory_budget > 0:
            raise ValueError(f"memory_budget: bytes > 0 (or None: no limit), got {memory_budget!r}")
        if directory is not None and not os.path.isdir(directory):
            raise ValueError(f"directory: {directory!r} is not a directory")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.store, self.directory, self.memory_budget, self.name = store, directory, memory_budget, name
        self.max_rows = 1 + int(num_clients) if max_rows is None else max(1, int(max_rows))
        self.pin = pin_memory and torch.cuda.is_available() and store != "disk"  # until "auto" moves to the file
        self.store_device = torch.device("cpu") if pin_memory or store == "disk" else self.device
        self.dtype, self.cols, self.num_clients = dtype, int(P), int(num_clients)
        self.row_bytes = self.cols * torch.empty((), dtype=dtype).element_size()
        init = torch.as_tensor(fill, dtype=torch.float32).reshape(-1)
        if init.numel() not in (1, self.cols):
            raise ValueError(f"fill: a number or {self.cols} values (a client's initial row), got {init.numel()}")
        self.file: RowFile | None = None  # the disk tier, once the table moved there
        self._tmp = None                   # the temporary directory of a file without ``directory``
        self.table = self._alloc(1)
        self.table[0] = init.expand(self.cols).to(self.store_device, dtype)
        self.slot_of = np.zeros(self.num_clients, dtype=np.int64)  # 0: never written (reads the initial row)
        self._written = 0
        self.used = 1        # rows [0, used) of the table are allocated
        self.seq = 0         # writes so far (a row's stamp: the write that filled it)
        self.commit_seq = 0  # the write count at the latest state_dict / load_state_dict
        self.free = np.empty(0, dtype=np.int64)     # rows to reuse (copy-on-write files)
        self.pending = np.empty(0, dtype=np.int64)  # superseded rows the latest checkpoint may hold

    def _alloc(self, rows: int) -> Tensor:
        t = torch.empty(rows, self.cols, dtype=self.dtype, device=self.store_device)
        return t.pin_memory() if self.pin else t

    @property
    def K(self) -> int:
        return self.num_clients

    @property
    def shape(self) -> tuple:
        """``(K, cols)``: the state as if every client's row were stored."""
        return (self.num_clients, self.cols)

    @property
    def written(self) -> int:
        """Clients with a row of their own."""
        return self._written

    @property
    def on_disk(self) -> bool:
        return self.file is not None

    @property
    def cow(self) -> bool:
        """Rows are copy-on-write: the table is a file a checkpoint refers to (``directory`` given)."""
        return self.file is not None and self._tmp is None

    @property
    def nbytes(self) -> int:
        """Bytes held in memory: the table's rows in use (a host table reserves the run's rows, and pages never
        written take no memory; a device or pinned table: as allocated; a file: none) and the client -> row map."""
        if self.on_disk:
            table = 0
        elif self.store_device.type == "cpu" and not self.pin:
            table = self.used * self.row_bytes
        else:
            table = self.table.numel() * self.table.element_size()
        return table + self.slot_of.nbytes + self.free.nbytes + self.pending.nbytes

    @property
    def file_bytes(self) -> int:
        """Bytes of the file's rows written so far (0 in memory)."""
        return self.used * self.row_bytes if self.on_disk else 0

    def file_paths(self) -> tuple[str, str] | tuple:
        """The paths of the rows and stamps files in ``directory`` (whether made yet or not); () without one."""
        return () if self.directory is None else paths_of(os.path.join(self.directory, self.name))

    def _ids(self, ids) -> np.ndarray:
        a = ids.detach().cpu().numpy() if isinstance(ids, Tensor) else np.asarray(ids)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise ValueError(f"ids: expected a 1-d list of client ids, got shape {a.shape}")
        if a.size and (a.min() < 0 or a.max() >= self.num_clients):
            raise ValueError(f"ids: client ids in [0, {self.num_clients}), got {int(a.min())}..{int(a.max())}")
        return a.astype(np.int64, copy=False)

    def _slots(self, slots: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots)).to(self.store_device, non_blocking=True)

    def gather(self, ids, out: Tensor | None = None) -> Tensor:
        """Rows of clients ``ids`` as fp32 ``[n, cols]`` on ``self.device`` (the initial row for a client never
        written)."""
        rows = self.table.index_select(0, self._slots(self.slot_of[self._ids(ids)]))
        if self.file is not None:
            self.file.release()  # the rows are copied out: the process keeps no mapping of them
        rows = rows.to(self.device, non_blocking=True).float()
        if out is not None:
            out.copy_(rows)
            return out
        return rows

    def scatter_(self, ids, rows: Tensor, *, spill: bool = True) -> None:
        """Write fp32 rows ``[n, cols]`` for clients ``ids`` (rounded to the storage dtype); a client written for
        the first time gets a row of its own (the table grows when full; ``store="auto"`` moves it to the file
        beyond ``memory_budget``, unless ``spill=False``)."""
        a = self._ids(ids)
        if rows.shape != (len(a), self.cols):
            raise ValueError(f"rows: expected shape ({len(a)}, {self.cols}), got {tuple(rows.shape)}")
        if len(np.unique(a)) != len(a):
            raise ValueError("ids: a client written twice in one scatter")
        slots = self.allocate(a, spill=spill)
        self.write(slots, rows)
        self.assign(a, slots)

    # -- the steps of a scatter (several processes sharing one file run them apart: fedfast.sim.rows) ----------
    def spills(self, ids) -> bool:
        """Whether writing clients ``ids`` moves an ``"auto"`` table from memory to the file (or a ``"disk"`` one
        makes its file)."""
        if self.on_disk or self.store == "memory":
            return False
        if self.store == "disk":
            return True
        need = self.used + self._new_rows(self._ids(ids))
        return self.memory_budget is not None and need * self.row_bytes > self.memory_budget

    def _new_rows(self, a: np.ndarray) -> int:
        return len(a) if self.cow else int(np.count_nonzero(self.slot_of[a] == 0))

    def allocate(self, ids, *, spill: bool = True) -> np.ndarray:
        """Rows for clients ``ids`` to be written: a new client's next free row; a client with a row keeps it,
        or, copy-on-write, gets a free or new one. Grows the table (``spill=False``: never into the file)."""
        a = self._ids(ids)
        if spill and self.spills(a):
            self.spill()
        slots = self.slot_of[a].copy()
        fresh = np.ones(len(a), dtype=bool) if self.cow else slots == 0
        n = int(fresh.sum())
        reuse = self.free[:n]
        self.free = self.free[n:]
        need = self.used + n - len(reuse)
        self._grow(need)
        slots[fresh] = np.concatenate([reuse, np.arange(self.used, need, dtype=np.int64)])
        self.used = need
        return slots

    def write(self, slots: np.ndarray, rows: Tensor) -> None:
        """Rows ``[n, cols]`` (fp32) into table rows ``slots``, stamped with this write's number."""
        self.table.index_copy_(0, self._slots(slots), rows.to(self.store_device, self.dtype))
        if self.file is not None:
            self.file.stamps[slots] = self.seq + 1
            self.file.release()

    def assign(self, ids, slots: np.ndarray, *, track: bool = True) -> None:
        """Clients ``ids`` read rows ``slots`` from now on (after :meth:`write`); ``track=False``: a process that
        does not allocate (another process's rows of a shared file) keeps no free list."""
        a = self._ids(ids)
        old = self.slot_of[a]
        self.slot_of[a] = slots
        self.seq += 1
        self._written += int(np.count_nonzero(old == 0))
        if len(slots):
            self.used = max(self.used, int(slots.max()) + 1)
        if track and self.cow:
            gone = old[(old != 0) & (old != slots)]
            held = self.file.stamps[gone] <= self.commit_seq  # filled before the latest checkpoint: it may hold it
            self.pending = np.concatenate([self.pending, gone[held]])
            self.free = np.concatenate([self.free, gone[~held]])

    def _grow(self, need: int) -> None:
        if self.file is not None:
            self.file.grow(need)
            self.file.reserve(self.used, need)
            self.table = self.file.rows
            return
        cap = self.table.shape[0]
        if need <= cap:
            return
        # host memory: all the rows the run can write (``max_rows``) at once, up to the memory budget, as a
        # reservation (pages untouched take no memory: the rows written are what the process holds; no copy
        # later). Else (device memory, or past it): doubling while small, then by a quarter (a growth copies:
        # old and new are held at once), never past ``max_rows``
        cap_rows = self.max_rows if self.memory_budget is None else min(self.max_rows, self.memory_budget //
                                                                         self.row_bytes)
        grown = None
        if self.store_device.type == "cpu" and not self.pin and need <= cap_rows and \
                cap_rows * self.row_bytes <= _physical_bytes():
            try:
                grown = self._alloc(cap_rows)
            except RuntimeError:  # no room to reserve (a strict overcommit policy): grow as needed instead
                grown = None
        if grown is None:
            new = max(need, min(2 * cap if cap * self.row_bytes < 2**26 else cap + cap // 4, self.max_rows))
            if self.store == "auto" and self.memory_budget is not None:
                new = max(need, min(new, self.memory_budget // self.row_bytes))
            grown = self._alloc(new)
        grown[:self.used] = self.table[:self.used]
        self.table = grown

    def spill(self) -> None:
        """Move the table to the file (``<directory>/<name>``, or a temporary directory): the rows written so far
        are copied once; later growth extends the file."""
        if self.file is not None:
            return
        directory = self.directory
        if directory is None:
            self._tmp = tempfile.mkdtemp(prefix="fedfast-state-")
            weakref.finalize(self, shutil.rmtree, self._tmp, True)
            directory = self._tmp
        f = RowFile.create(os.path.join(directory, self.name), self.cols, self.dtype, max(self.used, 1))
        f.reserve(0, self.used)
        for s in range(0, self.used, 4096):  # blocks: no second full-size table
            e = min(self.used, s + 4096)
            f.rows[s:e] = self.table[s:e].cpu()
        f.stamps[:self.used] = self.seq
        self.commit_seq = -1  # no checkpoint refers to the file yet: a superseded row is free at once
        self._use(f)

    def _use(self, f: RowFile) -> None:
        """The table is the file's rows from now on (host memory: the mapping)."""
        self.file, self.table, self.store_device, self.pin = f, f.rows, torch.device("cpu"), False

    def attach(self, uid: str | None = None) -> None:
        """Map the file another process made (the table moves there; ``uid``: the file it must be)."""
        if self.file is None:
            if self.directory is None:
                raise ValueError("directory: a store shared by several processes keeps its file in a directory they "
                                 "all see (a run directory)")
            self._use(RowFile.open(os.path.join(self.directory, self.name), self.cols, self.dtype, uid))

    def follow(self, slots: np.ndarray) -> None:
        """Map the file as far as rows ``slots`` (grown by the process that allocated them)."""
        if len(slots):
            self.file.follow(int(slots.max()) + 1)
            self.table = self.file.rows

    def _referenced(self) -> tuple[np.ndarray, np.ndarray]:
        """The written clients and their rows, in row order (a checkpoint restores the same table)."""
        ids = np.flatnonzero(self.slot_of)
        ids = ids[np.argsort(self.slot_of[ids], kind="stable")]
        return ids, self.slot_of[ids]

    def mean(self) -> Tensor:
        """Mean over all K clients in fp32 (FedDyn's server correction, FedDistill+'s logit sum): the written rows'
        sum, in client-id order and 64 MiB of rows at a time (the same sum whatever the table's layout: in memory,
        on disk, after a resume), and the initial row for every client never written."""
        slots = self.slot_of[np.flatnonzero(self.slot_of)]
        total = torch.zeros(self.cols, device=self.table.device)
        step = max(1, 2**26 // self.row_bytes)
        for s in range(0, len(slots), step):
            total += self.table.index_select(0, self._slots(slots[s:s + step])).float().sum(0)
        if self.file is not None:
            self.file.release()
        total = total + (self.num_clients - len(slots)) * self.table[0].float()
        return (total / self.num_clients).to(self.device)

    def dense(self) -> Tensor:
        """Every client's row, ``[K, cols]`` fp32 on the storage device (K rows: small populations and tests)."""
        return self.table.index_select(0, self._slots(self.slot_of)).float()

    def state_dict(self) -> dict:
        """Plain data for a checkpoint. In memory (or a temporary file): the written clients' ids and rows
        (storage dtype) and the initial row. A file in ``directory``: flushed, and referred to by name and id
        with each written client's row and stamp (the rows stay in the file; rows superseded before this call
        are reused from now on, so only the newest checkpoint is resumable)."""
        ids, slots = self._referenced()
        if not self.cow:
            rows = self.table.index_select(0, self._slots(slots)).cpu()
            return {"ids": torch.from_numpy(ids), "rows": rows, "init": self.table[0].cpu(),
                    "num_clients": self.num_clients}
        self.file.flush()
        out = {"file": self.name, "uuid": self.file.uuid, "ids": torch.from_numpy(ids),
               "slots": torch.from_numpy(slots.copy()), "stamps": torch.from_numpy(np.array(self.file.stamps[slots])),
               "used": self.used, "seq": self.seq, "num_clients": self.num_clients, "cols": self.cols,
               "dtype": str(self.dtype).replace("torch.", "")}
        self.free = np.concatenate([self.free, self.pending])
        self.pending = np.empty(0, dtype=np.int64)
        self.commit_seq = self.seq
        return out

    def load_state_dict(self, state) -> None:
        """Back to :meth:`state_dict`'s state (or a dense ``[K, cols]`` tensor, as fedfast 0.1 checkpointed it:
        every client then has a row); ValueError naming what does not fit."""
        if torch.is_tensor(state):
            if tuple(state.shape) != self.shape:
                raise ValueError(f"state: client_state has shape {tuple(state.shape)}, expected {self.shape}")
            state = {"ids": torch.arange(self.num_clients), "rows": state, "init": self.table[0].cpu(),
                     "num_clients": self.num_clients}
        if "file" in state:
            return self._load_file(state)
        ids, rows = state["ids"], state["rows"]
        if state.get("num_clients") != self.num_clients or rows.dim() != 2 or rows.shape[1] != self.cols or \
                tuple(ids.shape) != (rows.shape[0],):
            raise ValueError(f"state: client_state of {state.get('num_clients')} clients x {tuple(rows.shape[1:])} "
                             f"values, expected {self.num_clients} x ({self.cols},)")
        a = self._ids(ids)
        self._reset(state["init"])
        for s in range(0, len(a), 4096):  # through the store's own growth, in memory as it was checkpointed (a
            part = a[s:s + 4096]  # move to the file is the next scatter's: all processes of a group decide it)
            slots = self.allocate(part, spill=False)
            self.write(slots, rows[s:s + 4096].float())
            self.assign(part, slots)
        self.commit_seq = self.seq

    def _reset(self, init: Tensor) -> None:
        if self.file is not None:
            if self._tmp is None:  # the run's file is replaced by rows of this state (a new id: older
                self.file = RowFile.create(self.file.base, self.cols, self.dtype, 1)  # checkpoints are refused)
            self.file.stamps[0] = 0
            self.table = self.file.rows
        else:
            self.table = self._alloc(1)
        self.table[0] = init.to(self.store_device, self.dtype)
        self.slot_of[:] = 0
        self.used, self.seq, self.commit_seq, self._written = 1, 0, 0, 0
        self.free = self.pending = np.empty(0, dtype=np.int64)

    def _load_file(self, state: dict) -> None:
        if state.get("num_clients") != self.num_clients or state.get("cols") != self.cols or \
                state.get("dtype") != str(self.dtype).replace("torch.", ""):
            raise ValueError(f"state: client_state of {state.get('num_clients')} clients x {state.get('cols')} "
                             f"{state.get('dtype')} values, expected {self.num_clients} x {self.cols} "
                             f"{str(self.dtype).replace('torch.', '')}")
        if self.directory is None:
            raise ValueError(f"state: the checkpoint's per-client state is in the file {state['file']}.rows of its "
                             f"run directory: restore it with that directory as the store's directory "
                             f"(Simulation(..., state_dir=...))")
        self.name = state["file"]
        f = RowFile.open(os.path.join(self.directory, self.name), self.cols, self.dtype, state["uuid"])
        ids, slots = self._ids(state["ids"]), state["slots"].numpy().astype(np.int64)
        used = int(state["used"])
        if len(slots) and (slots.min() < 1 or slots.max() >= used or used > f.capacity):
            raise ValueError(f"{f.paths[0]}: holds {f.capacity} rows, the checkpoint refers to rows up to {used - 1}")
        stale = np.flatnonzero(np.asarray(f.stamps[slots]) != state["stamps"].numpy())
        if len(stale):
            raise ValueError(f"{f.paths[0]}: the rows of {len(stale)} client(s) (e.g. client {int(ids[stale[0]])}) "
                             f"were overwritten after this checkpoint was taken: only the run's newest checkpoint "
                             f"can be resumed")
        self._tmp = None
        self._use(f)
        self.slot_of[:] = 0
        self.slot_of[ids] = slots
        self.used, self.seq, self._written = used, int(state["seq"]), len(ids)
        self.commit_seq = self.seq
        taken = np.zeros(used, dtype=bool)
        taken[0] = True
        taken[slots] = True
        self.free, self.pending = np.flatnonzero(~taken).astype(np.int64), np.empty(0, dtype=np.int64)
