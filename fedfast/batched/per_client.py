"""The traced program's steps for what it has no batched form of: each such node of the model's graph runs per client
inside the program, through ``torch.func.vmap`` of that node alone, while the rest of the program stays batched.

A node's arguments are kept as a template (:class:`Ref` where a program value goes). At run time a per-client
value enters ``vmap`` client-major (``[n, *per-client shape]``; the grouped image layout ``[B, n*C, ...]`` is viewed
as ``[n, B, C, ...]``), a value that is the same for every client (a constant, a shape) enters as it is, and a
module's own parameters and buffers enter as the clients' ``[n, *shape]`` rows through ``functional_call``. Shape
queries (``x.shape``, ``x.size()``, ``x.dim()``, ...) are answered from client 0's slice: every client's tensors have
the same shapes, so the answer is each client's. Random functions draw per client (``randomness="different"``).

A node that cannot run per client (``.item()``, NumPy, a Python branch on a tensor's value) raises a ValueError
naming the model's file and line (``torch.fx``'s recorded stack trace)."""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_unflatten

# attributes and methods whose answer is about a tensor's shape or kind, not its values: answered per client from
# client 0's slice, without vmap
META_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "layout", "requires_grad", "is_sparse"})
META_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "get_device", "is_floating_point"})


class Ref:
    """Where a program value goes in a node's argument template: the index of the step that makes it."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __repr__(self):
        return f"Ref({self.i})"


_TENSOR = object()  # where a per-client call's output has a tensor


class _Slot:
    """The k-th tensor handed to vmap."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k


def map_template(obj, fn):
    """``obj`` with every :class:`Ref` / slot replaced by ``fn(it)``, through tuples (named ones too), lists, dicts
    and slices."""
    if isinstance(obj, (Ref, _Slot)):
        return fn(obj)
    if isinstance(obj, tuple):
        vals = [map_template(v, fn) for v in obj]
        return type(obj)(*vals) if hasattr(obj, "_fields") else tuple(vals)
    if isinstance(obj, list):
        return [map_template(v, fn) for v in obj]
    if isinstance(obj, dict):
        return {k: map_template(v, fn) for k, v in obj.items()}
    if isinstance(obj, slice):
        return slice(map_template(obj.start, fn), map_template(obj.stop, fn), map_template(obj.step, fn))
    return obj


def refs_of(obj) -> list[int]:
    """The step indices a template refers to."""
    out: list[int] = []
    map_template(obj, lambda r: out.append(r.i))
    return out


def where(node) -> str:
    """``"<op target> (file:line: code)"`` of a traced node: the model's line from fx's recorded stack trace."""
    what = f"{node.op} {getattr(node.target, '__name__', node.target)}"
    trace = (getattr(node, "stack_trace", None) or "").strip().splitlines()
    torch_dir = os.path.dirname(torch.__file__)
    files = [i for i, line in enumerate(trace) if line.strip().startswith("File ") and torch_dir + os.sep not in line]
    if not files:
        return what
    i = files[-1]
    loc = trace[i].strip()[5:].replace('"', "")
    code = trace[i + 1].strip() if i + 1 < len(trace) else ""
    return f"{what} ({loc}: {code})" if code else f"{what} ({loc})"


def client_major(h: Tensor, grouped: bool, n: int, B: int) -> Tensor:
    """A program value as ``[n, *per-client shape]``: grouped ``[B, n*C, ...]`` viewed as ``[n, B, C, ...]``."""
    if not grouped:
        return h
    return h.reshape(B, n, h.shape[1] // n, *h.shape[2:]).transpose(0, 1)


def call_target(kind: str, target):
    """The callable of a ``call_function`` / ``call_method`` / ``get``-style node."""
    if kind == "call_method":

        def method(self, *a, **kw):
            return getattr(self, target)(*a, **kw)

        return method
    return target


class PerClient:
    """How one node runs per client: ``kind`` (fx's ``call_function`` / ``call_method`` / ``call_module``),
    ``fn`` (the callable; None for a module), ``module`` and its parameter and buffer names (``prefix``: its path),
    the argument templates, ``meta`` (a shape query: answered from client 0's slice) and ``where`` (the model's
    line, for errors)."""

    def __init__(self, node, args, kwargs, *, module: nn.Module | None = None, meta: bool = False):
        self.kind, self.module, self.meta = node.op, module, meta
        self.shared = meta  # the value is the same for every client (set by the planner)
        self.fn = None if module is not None else call_target(node.op, node.target)
        self.args, self.kwargs = args, kwargs
        self.prefix = node.target if module is not None else ""
        self.params = [k for k, _ in module.named_parameters()] if module is not None else []
        self.buffers = [k for k, b in module.named_buffers() if carried(k, b)] if module is not None else []
        self.where = where(node)
        if module is not None and not self.params and not self.buffers:
            self.module, self.fn = None, module  # a module of no weights: a function

    def __call__(self, vals: list, params: dict, buffers: dict | None, n: int, B: int):
        """``(value, grouped)``: the node's value for every client (client-major, ``grouped`` False), or ``(value,
        None)`` for a value that is the same for every client (a constant, a shape)."""
        leaves: list[Tensor] = []

        def enter(v):
            if torch.is_tensor(v):
                leaves.append(v)
                return _Slot(len(leaves) - 1)
            if isinstance(v, (tuple, list)):
                return type(v)(enter(x) for x in v) if not hasattr(v, "_fields") else type(v)(*map(enter, v))
            return v

        def fill(r: Ref):
            v, grouped = vals[r.i]
            return v if grouped is None else enter(client_major(v, grouped, n, B) if torch.is_tensor(v) else v)

        try:
            args, kwargs = map_template(self.args, fill), map_template(self.kwargs, fill)
            if self.meta or (not leaves and self.module is None):
                first = lambda s: leaves[s.k][0]  # noqa: E731 - client 0's slice answers a shape query
                return self.fn(*map_template(args, first), **map_template(kwargs, first)), None
            own = self._own(leaves, params, buffers)
            shape: dict = {}
            out = torch.vmap(self._per_client(args, kwargs, own, shape), randomness="different")(*leaves)
            out = _rebuild(out, shape)
        except Exception as e:  # noqa: BLE001 - any failure is the model's line's, named
            raise ValueError(
                f"model: {self.where} cannot run per client inside fedfast's batched program "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
            ) from e
        return out, False

    def _own(self, leaves: list, params: dict, buffers: dict | None) -> dict:
        """The module's own parameters and buffers, entered as leaves: ``{local name: slot}``."""
        own = {}
        for names, src in ((self.params, params), (self.buffers, buffers or {})):
            for k in names:
                full = f"{self.prefix}.{k}"
                if full not in src:
                    raise KeyError(f"{full!r} is not among the clients' parameters and buffers")
                leaves.append(src[full])
                own[k] = _Slot(len(leaves) - 1)
        return own

    def _per_client(self, args, kwargs, own: dict, shape: dict):
        """One client's call, from the tensors vmap hands it; returns the output's tensors (vmap returns tensors
        only), the rest of its structure (``None`` where MultiheadAttention gives no weights) kept in ``shape``."""
        module, fn = self.module, self.fn

        def one(*ts):
            def get(s):
                return ts[s.k]

            a, kw = map_template(args, get), map_template(kwargs, get)
            if module is not None:
                out = functional_call(module, {k: ts[s.k] for k, s in own.items()}, tuple(a), kw)
            else:
                out = fn(*a, **kw)
            flat, spec = tree_flatten(out)
            shape["spec"], shape["flat"] = spec, [_TENSOR if torch.is_tensor(v) else v for v in flat]
            return tuple(v for v in flat if torch.is_tensor(v))

        return one


def _rebuild(tensors: tuple, shape: dict):
    """The per-client call's output from vmap's tensors and the structure :meth:`PerClient._per_client` kept."""
    it = iter(tensors)
    flat = [next(it) if v is _TENSOR else v for v in shape["flat"]]
    return tree_unflatten(flat, shape["spec"])


def carried(name: str, b: Tensor) -> bool:
    """Whether a buffer is carried per client (the engine's buffer rows: floating-point buffers and BatchNorm's
    ``num_batches_tracked``); other integer and boolean buffers (index tables, masks) are constants of the
    architecture, read from the module."""
    return b.is_floating_point() or name.rsplit(".", 1)[-1] == "num_batches_tracked"


def is_meta_node(node) -> bool:
    """A shape query: ``getattr(x, "shape")`` and its kin, ``x.size()`` and its kin."""
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2:
        return node.args[1] in META_ATTRS
    return node.op == "call_method" and node.target in META_METHODS
