"""Flat client state: N copies of a model's parameters in one contiguous buffer.

``ClientStack`` holds the parameters of N clients as one fp32 tensor ``[N, P]`` (and the floating-point
buffers, e.g. BatchNorm statistics, as ``[N, B]``), with zero-copy per-parameter views ``[N, *shape]``
that ``torch.func.functional_call`` + ``torch.func.vmap`` accept, so every whole-model operation of a
federated round (broadcast of the global model, a client step, aggregation) is one op over a flat buffer
instead of a Python loop over clients and ``state_dict`` entries (pfl-research keeps one model and
updates it in place; fedfast keeps one buffer for all clients).

Per-client state across rounds (FedDyn ``h_k``, SCAFFOLD ``c_k``, ...) is the store's, :mod:`fedfast.store`.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from ._deprecation import deprecated
from .batched import plan
from .ops.client_batch_norm_reference import client_batch_norm_reference
from .store import state as _store_state


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
            if b is not None and (
                b.is_floating_point()
                or (n == "num_batches_tracked" and isinstance(mod, nn.modules.batchnorm._NormBase))
            ):
                out.append((f"{mod_name}.{n}" if mod_name else n, b))
    return out


def has_running_stats(module: nn.Module) -> bool:
    """Whether the model has BatchNorm layers that keep running statistics (``track_running_stats=True``)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None for m in module.modules())


class FlatLayout:
    """Where each parameter (and float buffer) of a module lives inside a flat vector."""

    def __init__(self, module: nn.Module):
        self.params, self.P = _layout(module.named_parameters())
        self.buffers, self.B = _layout(_model_buffers(module))
        # the buffer slots that hold integers (num_batches_tracked): averaged, then rounded to the nearest integer
        self.integer_buffers = [
            s for s, (_, b) in zip(self.buffers, _model_buffers(module), strict=True) if not b.is_floating_point()
        ]

    @staticmethod
    def _views(flat: Tensor, slots: list[_Slot]) -> "OrderedDict[str, Tensor]":
        lead = flat.shape[:-1]
        return OrderedDict(
            (s.name, flat[..., s.offset : s.offset + s.numel].view(tuple(lead) + tuple(s.shape))) for s in slots
        )

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
            m[s.offset : s.offset + s.numel] = True
        return m

    def load_buffers(self, module: nn.Module, flat: Tensor) -> None:
        """The module's buffers set to ``flat`` [B] (integers rounded to the nearest)."""
        with torch.no_grad():
            for (_, b), v in zip(_model_buffers(module), self.buffer_views(flat).values(), strict=True):
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
        if names != [s.name for s in self.params] or [p.shape for _, p in module.named_parameters()] != [
            s.shape for s in self.params
        ]:
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

    def __init__(
        self,
        module: nn.Module,
        num_clients: int,
        *,
        device=None,
        dtype: torch.dtype = torch.float32,
        use_executor: bool = True,
    ):
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
        gs = [
            g.reshape(n, -1) if g is not None else torch.zeros(n, lf.numel() // n, device=lf.device)
            for g, lf in zip(gs, leaves.values(), strict=True)
        ]
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
            for (_name, p), v in zip(
                module.named_parameters(), self.param_views(slice(k, k + 1)).values(), strict=True
            ):
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
    def vmap_forward(
        self,
        x: Tensor,
        rows: slice | None = None,
        *,
        params: dict | None = None,
        features: nn.Module | None = None,
        buffers: dict | None = None,
        valid: Tensor | None = None,
        update: bool = False,
    ):
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
            try:
                return vmap(f, in_dims=(0, 0, 0, None if valid is None else 0), randomness="different")(p, b, x, valid)
            except RuntimeError as e:
                if "inplace randomness on an unbatched tensor" not in str(e):
                    raise
                raise ValueError(
                    "model: torch.func.vmap cannot run a layer of it that draws random numbers in place into a "
                    "tensor of its own (e.g. torchvision's StochasticDepth: torch.empty(...).bernoulli_()), so each "
                    "client cannot get its own draw; fedfast.batched runs StochasticDepth (executor = 'auto', and "
                    "a model whose every layer the traced program covers), or draw with torch.bernoulli on a tensor "
                    "shaped like the input"
                ) from None


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
        input,
        1,
        one(self.weight),
        one(self.bias),
        valid=one(valid),
        running_mean=one(self.running_mean),
        running_var=one(self.running_var),
        num_batches_tracked=one(self.num_batches_tracked) if tracks else None,
        use_batch_stats=self.training or not tracks,
        update=bool(update and self.training and tracks),
        momentum=self.momentum,
        eps=self.eps,
    )


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
            raise ValueError(
                f"features_layer: {name!r} is a {type(mods[name]).__name__} with no nn.Linear in it; "
                f"the classifier is an nn.Linear ({known})"
            )
    if probe is None:
        inside = [n for n in linears if not scope or n.startswith(scope + ".")]
        if not inside:
            raise ValueError(f"model: has no nn.Linear layer to take the representation from ({known})")
        return inside[-1]
    calls: list[tuple[str, Tensor]] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out, n=n: calls.append((n, out)))
        for n, m in mods.items()
        if isinstance(m, nn.Linear) and (not scope or n.startswith(scope + "."))
    ]
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
        raise ValueError(
            f"{'features_layer' if scope else 'model'}: no nn.Linear runs {where}, so there is no "
            f"classifier to take the features from ({known})"
        )
    last, y = calls[-1]
    runs = sum(1 for n, _ in calls if n == last)
    fix = (
        f'name the classifier: features_layer = "<layer>" in the run config (SimConfig(features_layer=...)), '
        f"or a features_layer attribute on the model ({known})"
    )
    if runs > 1:
        raise ValueError(
            f"model: its last nn.Linear to run, {last!r}, runs {runs} times in one forward, so which "
            f"call is the classifier is ambiguous; {fix}"
        )
    same = out is y or (torch.is_tensor(out) and out.numel() == y.numel() and out.data_ptr() == y.data_ptr())
    if not scope and not same:  # the output, or a view of it (a reshape), else something follows the layer
        raise ValueError(
            f"model: its output is not the output of the last nn.Linear to run ({last!r}): something "
            f"follows it, so the classifier is ambiguous; {fix}"
        )
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


def __getattr__(name: str):
    """``fedfast.flat.ClientState``: moved to :mod:`fedfast.store` (issue 50); the old address works for one release,
    with a DeprecationWarning naming the new one."""
    if name == "ClientState":
        deprecated(
            "fedfast.flat.ClientState moved to fedfast.store.ClientState; the old address goes in the next release"
        )
        return _store_state.ClientState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
