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

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from .batched import plan



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


def _float_buffers(module: nn.Module):
    """Floating-point buffers (BatchNorm running statistics, ...); integer ones (num_batches_tracked) are
    model bookkeeping, not state to average, and stay in the module."""
    return [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]


class FlatLayout:
    """Where each parameter (and float buffer) of a module lives inside a flat vector."""

    def __init__(self, module: nn.Module):
        self.params, self.P = _layout(module.named_parameters())
        self.buffers, self.B = _layout(_float_buffers(module))

    @staticmethod
    def _views(flat: Tensor, slots: list[_Slot]) -> "OrderedDict[str, Tensor]":
        lead = flat.shape[:-1]
        return OrderedDict((s.name, flat[..., s.offset:s.offset + s.numel].view(*lead, *s.shape)) for s in slots)

    def param_views(self, flat: Tensor) -> "OrderedDict[str, Tensor]":
        """Zero-copy views ``[*lead, *shape]`` of a ``[*lead, P]`` parameter buffer."""
        return self._views(flat, self.params)

    def buffer_views(self, flat: Tensor) -> "OrderedDict[str, Tensor]":
        return self._views(flat, self.buffers)

    def flatten_params(self, module: nn.Module, out: Tensor | None = None) -> Tensor:
        """The module's parameters as one ``[P]`` vector (exact copy)."""
        return self._flatten([p for _, p in module.named_parameters()], self.P, out)

    def flatten_buffers(self, module: nn.Module, out: Tensor | None = None) -> Tensor:
        return self._flatten([b for _, b in _float_buffers(module)], self.B, out)

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
            for (name, b), v in zip(_float_buffers(module), self.buffer_views(slice(k, k + 1)).values()):
                b.copy_(v[0])
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
                     features: nn.Module | None = None):
        """``f(theta_k, x_k)`` for every row k at once: ``x`` is ``[n, batch, ...]``, returns ``[n, batch, ...]``.

        ``params`` (default: this stack's views) lets autograd-tracked tensors be substituted. ``features``:
        a submodule of the model whose *input* is returned too, ``(features [n, batch, d], out)`` (MOON's
        representation: the classifier's input, see :func:`classifier_of`)."""
        p = self.param_views(rows) if params is None else params
        if self.plan is not None:  # a vmap-free executor: fedfast.batched (traced graph) or fedfast.grouped
            return self.plan.forward(p, x, self.module.training, features)
        b = self.buffer_views(rows)
        f = functional_forward(self.module, features)
        return vmap(f, in_dims=(0, 0, 0), randomness="different")(p, b, x)  # dropout: independent per client


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


def functional_forward(module: nn.Module, features: nn.Module | None = None):
    """``f(params, buffers, x)`` -> ``out`` (or ``(input of features, out)``) with ``functional_call``."""
    if features is None:
        def f(pp, bb, xx):
            return functional_call(module, {**pp, **bb}, (xx,))
        return f

    def g(pp, bb, xx):
        got = []
        h = features.register_forward_pre_hook(lambda _m, inp: got.append(inp[0]))
        try:
            out = functional_call(module, {**pp, **bb}, (xx,))
        finally:
            h.remove()
        return got[-1], out
    return g


class ClientState:
    """Per-client state of K clients (FedDyn h_k, SCAFFOLD c_k, MOON's previous model), ``cols`` values each,
    stored for the clients that were written only: a client never written reads as ``fill`` (its initial
    value), so memory grows with the clients a run trains (at most rounds x cohort), not with K.

    Rows live in one table ``[1 + written, cols]`` (row 0: the initial value) that doubles as it fills; the
    client -> row map is a host int64 array [K] (8 bytes a client, no Python object per client); a gather and a
    scatter are one ``index_select`` / ``index_copy_`` each. ``dtype`` fp32 or bf16 (storage; gathered rows are
    fp32), ``pin_memory=True`` keeps the table in pinned host memory (rows copied to ``device``). Rows are
    addressed by client id (a tensor, array or list; a device tensor is read to the host once per call)."""

    def __init__(self, num_clients: int, P: int, *, device=None, dtype: torch.dtype = torch.float32,
                 pin_memory: bool = False, fill=0.0):
        if dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"dtype: per-client state is fp32 or bf16, got {dtype}")
        if int(num_clients) < 1 or int(P) < 1:
            raise ValueError(f"num_clients and P: must be >= 1, got {num_clients}, {P}")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.pin = pin_memory and torch.cuda.is_available()
        self.store_device = torch.device("cpu") if pin_memory else self.device
        self.dtype, self.cols, self.num_clients = dtype, int(P), int(num_clients)
        init = torch.as_tensor(fill, dtype=torch.float32).reshape(-1)
        if init.numel() not in (1, self.cols):
            raise ValueError(f"fill: a number or {self.cols} values (a client's initial row), got {init.numel()}")
        self.table = self._alloc(1)
        self.table[0] = init.expand(self.cols).to(self.store_device, dtype)
        self.slot_of = np.zeros(self.num_clients, dtype=np.int64)  # 0: never written (reads the initial row)
        self.used = 1

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
        return self.used - 1

    @property
    def nbytes(self) -> int:
        """Bytes held: the table as allocated and the client -> row map."""
        return self.table.numel() * self.table.element_size() + self.slot_of.nbytes

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
        rows = rows.to(self.device, non_blocking=True).float()
        if out is not None:
            out.copy_(rows)
            return out
        return rows

    def scatter_(self, ids, rows: Tensor) -> None:
        """Write fp32 rows ``[n, cols]`` for clients ``ids`` (rounded to the storage dtype); a client written for
        the first time gets a row of its own (the table doubles when full)."""
        a = self._ids(ids)
        if rows.shape != (len(a), self.cols):
            raise ValueError(f"rows: expected shape ({len(a)}, {self.cols}), got {tuple(rows.shape)}")
        if len(np.unique(a)) != len(a):
            raise ValueError("ids: a client written twice in one scatter")
        new = a[self.slot_of[a] == 0]
        if len(new):
            need = self.used + len(new)
            if need > self.table.shape[0]:
                grown = self._alloc(max(need, 2 * self.table.shape[0]))
                grown[:self.used] = self.table[:self.used]
                self.table = grown
            self.slot_of[new] = np.arange(self.used, need)
            self.used = need
        self.table.index_copy_(0, self._slots(self.slot_of[a]), rows.to(self.store_device, self.dtype))

    def mean(self) -> Tensor:
        """Mean over all K clients in fp32 (FedDyn's server correction): the written rows' sum and the initial
        row for every client never written."""
        total = self.table[1:self.used].float().sum(0) + (self.num_clients - self.written) * self.table[0].float()
        return (total / self.num_clients).to(self.device)

    def dense(self) -> Tensor:
        """Every client's row, ``[K, cols]`` fp32 on the storage device (K rows: small populations and tests)."""
        return self.table.index_select(0, self._slots(self.slot_of)).float()

    def state_dict(self) -> dict:
        """Plain data for a checkpoint: the written clients' ids and rows (storage dtype) and the initial row."""
        ids = np.flatnonzero(self.slot_of)
        rows = self.table.index_select(0, self._slots(self.slot_of[ids])).cpu()
        return {"ids": torch.from_numpy(ids), "rows": rows, "init": self.table[0].cpu(), "num_clients": self.num_clients}

    def load_state_dict(self, state) -> None:
        """Back to :meth:`state_dict`'s state (or a dense ``[K, cols]`` tensor, as fedfast 0.1 checkpointed it:
        every client then has a row); ValueError naming what does not fit."""
        if torch.is_tensor(state):
            if tuple(state.shape) != self.shape:
                raise ValueError(f"state: client_state has shape {tuple(state.shape)}, expected {self.shape}")
            state = {"ids": torch.arange(self.num_clients), "rows": state, "init": self.table[0].cpu(),
                     "num_clients": self.num_clients}
        ids, rows = state["ids"], state["rows"]
        if state.get("num_clients") != self.num_clients or rows.dim() != 2 or rows.shape[1] != self.cols or \
                tuple(ids.shape) != (rows.shape[0],):
            raise ValueError(f"state: client_state of {state.get('num_clients')} clients x {tuple(rows.shape[1:])} "
                             f"values, expected {self.num_clients} x ({self.cols},)")
        n = rows.shape[0]
        table = self._alloc(1 + n)
        table[0] = state["init"].to(self.store_device, self.dtype)
        table[1:] = rows.to(self.store_device, self.dtype)
        slot_of = np.zeros(self.num_clients, dtype=np.int64)
        slot_of[self._ids(ids)] = np.arange(1, 1 + n)
        self.table, self.slot_of, self.used = table, slot_of, 1 + n
