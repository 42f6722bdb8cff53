"""The grouped-module executor: n clients' copies of a per-sample model (a transformer) in one forward, without vmap.

For models ``torch.fx`` cannot trace (Hugging Face transformers: keyword inputs, attention masks, config-driven
control flow) the engine has two ways to run n clients at once: ``torch.func.vmap`` over ``functional_call``, or
this executor. It runs a copy of the model once on the n clients' batches stacked client-major, ``[n*B, ...]``,
with every parameter-holding layer replaced by a grouped layer that applies client k's weights to client k's rows:

* ``nn.Linear``: one ``bmm`` over ``[n, rows, in]`` (the gradient formed in the weight's own layout, as in
  :mod:`fedfast.batched`);
* ``nn.LayerNorm``: the normalisation over all rows at once, then each client's affine;
* ``nn.Embedding``: one gather from the ``[n*V, d]`` table (token ids offset by ``k*V``), ``padding_idx`` rows
  getting no gradient; an index tensor with batch dimension 1 (position ids) is looked up per client and
  broadcast over that client's rows.

Everything else (attention, activations, dropout, reshapes) already acts on each sample alone, so it runs
unchanged on the stacked rows: attention of all n*B sequences is one batched matmul or SDPA call (vmap runs CPU
SDPA per client: it has no batching rule). One FedGKD round on the 2-core CPU VM (``benchmarks/bench_engine.py::
test_transformer_round``, two runs): DistilBERT-base dimensions, 4 clients x 32 sequences (one client per chunk
on a CPU, whose chunks hold <= 128 MiB of parameters): per-client loop 33.8 /
33.3 s, vmap 26.1 / 27.0 s, this executor 25.0 / 26.7 s; a 5.4M-parameter model, 4 x 128 sequences: 11.5 / 10.2,
10.4 / 9.5, 9.8 / 9.6 s (compute-bound: the executors are equal within noise there; docs/benchmarks.md).

A model qualifies when every parameter belongs to one of those layers (as the layer's own ``weight`` / ``bias``)
and no layer couples samples (BatchNorm is refused); :func:`plan` says why not otherwise. The engine checks the
result against each client's own ``functional_call`` forward on a probe batch of two clients with different
weights before it uses this path (a model that mixes rows of a batch fails that check), else it uses vmap.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .batched import _BatchedLinear


class _Ctx:
    """The current call: per-client parameter views ``[n, *shape]`` by name, and n, B."""

    params: dict = {}
    n: int = 1
    B: int = 1


def _rows(h: Tensor, n: int) -> Tensor:
    """``[n*B, ..., F]`` -> ``[n, B*..., F]`` (client-major rows)."""
    return h.reshape(n, -1, h.shape[-1])


class _GLinear(nn.Module):
    def __init__(self, name: str, has_bias: bool, ctx: _Ctx):
        super().__init__()
        self.name, self.has_bias, self.ctx = name, has_bias, ctx

    def forward(self, h: Tensor) -> Tensor:
        c = self.ctx
        w = c.params[f"{self.name}.weight"]
        b = c.params[f"{self.name}.bias"] if self.has_bias else None
        out = _BatchedLinear.apply(_rows(h, c.n), w, b)
        return out.reshape(*h.shape[:-1], w.shape[1])


class _GLayerNorm(nn.Module):
    def __init__(self, name: str, m: nn.LayerNorm, ctx: _Ctx):
        super().__init__()
        if len(m.normalized_shape) != 1:
            raise ValueError("a LayerNorm over more than the last dimension")
        self.name, self.eps, self.ctx = name, m.eps, ctx
        self.has_w, self.has_b = m.weight is not None, getattr(m, "bias", None) is not None

    def forward(self, h: Tensor) -> Tensor:
        c = self.ctx
        y = F.layer_norm(h, h.shape[-1:], None, None, self.eps)
        if not (self.has_w or self.has_b):
            return y
        y = _rows(y, c.n)
        if self.has_w and self.has_b:
            y = torch.addcmul(c.params[f"{self.name}.bias"][:, None], y, c.params[f"{self.name}.weight"][:, None])
        elif self.has_w:
            y = y * c.params[f"{self.name}.weight"][:, None]
        else:
            y = y + c.params[f"{self.name}.bias"][:, None]
        return y.reshape(h.shape)


class _GroupedLookup(torch.autograd.Function):
    """``table[ids]`` for ids into a ``[n*V, d]`` table; the gradient is a dense ``[n*V, d]`` table (as
    ``nn.Embedding``'s) without the contributions of the rows where ``keep`` is False (padding_idx tokens)."""

    @staticmethod
    def forward(ctx, table, ids, keep):
        ctx.save_for_backward(ids, keep)
        ctx.rows = table.shape[0]
        return F.embedding(ids, table)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        ids, keep = ctx.saved_tensors
        g = g.reshape(-1, g.shape[-1])
        if keep is not None:
            g = g * keep.reshape(-1, 1).to(g.dtype)
        out = g.new_zeros(ctx.rows, g.shape[1])
        out.index_add_(0, ids.reshape(-1), g)
        return out, None, None


class _GEmbedding(nn.Module):
    def __init__(self, name: str, m: nn.Embedding, ctx: _Ctx):
        super().__init__()
        if m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
            raise ValueError("an Embedding with max_norm, scale_grad_by_freq or sparse gradients")
        self.name, self.pad, self.ctx = name, m.padding_idx, ctx

    def forward(self, ids: Tensor) -> Tensor:
        c = self.ctx
        w = c.params[f"{self.name}.weight"]  # [n, V, d]
        n, V, d = w.shape
        table = w.reshape(n * V, d)
        if ids.shape[0] == 1 and c.n * c.B != 1:  # shared ids (position ids): per client, then over its rows
            off = torch.arange(n, device=ids.device).view(n, *([1] * (ids.dim() - 1))) * V
            gid = ids + off  # [n, ...]
            keep = None if self.pad is None else ids.ne(self.pad).expand_as(gid)
            out = _GroupedLookup.apply(table, gid, keep)  # [n, ..., d]
            return out.unsqueeze(1).expand(n, c.B, *out.shape[1:]).reshape(n * c.B, *out.shape[1:])
        if ids.shape[0] != c.n * c.B:
            raise ValueError(f"an Embedding called on {ids.shape[0]} rows, not the batch's {c.n * c.B} or 1")
        off = torch.arange(n, device=ids.device).repeat_interleave(c.B).view(-1, *([1] * (ids.dim() - 1))) * V
        keep = None if self.pad is None else ids.ne(self.pad)
        return _GroupedLookup.apply(table, ids + off, keep)


_GROUPED = (nn.Linear, nn.LayerNorm, nn.Embedding)


class GroupedPlan:
    """A copy of the model with grouped layers (:func:`plan`); ``forward(params, x, training, features)``."""

    def __init__(self, model: nn.Module, ctx: _Ctx, names: dict):
        self.model, self.ctx, self.names = model, ctx, names  # names: id(original layer) -> its grouped copy

    def forward(
        self,
        params: dict,
        x: Tensor,
        training: bool,
        features: nn.Module | None = None,
        *,
        buffers: dict | None = None,
        valid: Tensor | None = None,
        update: bool = False,
    ):
        """``params[name]`` ``[n, *shape]``, ``x`` ``[n, B, ...]`` -> ``[n, B, out]`` (or ``(input of
        features [n, B, d], out)``; ``features`` is a module of the original model). ``buffers``, ``valid`` and
        ``update`` (the executors' common call) change nothing here: no layer of a grouped copy couples the rows
        of a batch or updates a buffer (BatchNorm is refused), so its buffers are the model's constants."""
        n, B = x.shape[0], x.shape[1]
        c = self.ctx
        c.params, c.n, c.B = params, n, B
        self.model.train(training)
        got, hook = [], None
        if features is not None:
            target = self.names.get(id(features))
            if target is None:
                raise ValueError("features: not a layer of this model")
            hook = target.register_forward_pre_hook(lambda _m, inp: got.append(inp[0]))
        try:
            out = self.model(x.reshape(n * B, *x.shape[2:]))
        finally:
            c.params = {}
            if hook is not None:
                hook.remove()
        out = out.reshape(n, B, *out.shape[1:])
        if features is not None:
            return got[-1].reshape(n, B, -1), out
        return out


def plan(model: nn.Module) -> tuple[GroupedPlan | None, str]:
    """``(GroupedPlan, "")`` if every parameter of ``model`` belongs to a Linear, LayerNorm or Embedding and no
    layer normalises over the batch, else ``(None, why not)``."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            return None, f"{name} ({type(m).__name__}) normalises over the batch"
    params = {pn for pn, _ in model.named_parameters()}  # a parameter shared by two layers is listed once
    owned = set()
    for name, m in model.named_modules():
        if isinstance(m, _GROUPED):
            for pn, _ in m.named_parameters(recurse=False):
                full = f"{name}.{pn}" if name else pn
                if full not in params:
                    return None, f"the parameter {full} is shared with another layer (tied weights)"
                owned.add(full)
    missing = sorted(params - owned)
    if missing:
        return None, f"the parameter {missing[0]} is not the weight or bias of a Linear, LayerNorm or Embedding"
    ctx = _Ctx()
    twin = copy.deepcopy(model, {id(p): None for p in model.parameters()})  # the layers without their weights
    names, originals = {}, dict(model.named_modules())
    try:
        for name, m in list(twin.named_modules()):
            if not isinstance(m, _GROUPED) or not name:
                continue
            orig = originals[name]  # the copy's weights are None: which exist is read from the original
            if isinstance(m, nn.Linear):
                g = _GLinear(name, orig.bias is not None, ctx)
            elif isinstance(m, nn.LayerNorm):
                g = _GLayerNorm(name, orig, ctx)
            else:
                g = _GEmbedding(name, orig, ctx)
            parent, _, leaf = name.rpartition(".")
            setattr(twin.get_submodule(parent) if parent else twin, leaf, g)
            names[id(orig)] = g
    except ValueError as e:
        return None, str(e)
    return GroupedPlan(twin, ctx, names), ""
