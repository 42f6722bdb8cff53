"""The batched program: n clients' models over their own inputs at once, for any model torch.fx can trace, its
layers below run batched (plain ``nn.Sequential``, residual ResNets, torchvision's families), anything else per
client inside the program.

``torch.func.vmap`` of ``functional_call`` turns a convolution with per-client weights into a grouped
convolution, but moves the client dimension between layers with copies and builds the flat gradient of
per-parameter slices with a full-size zero fill per parameter. This executor traces the model once with
``torch.fx`` into a small program and runs it with the activations in the grouped layout ``[B, n*C, H, W]`` for
the convolutional part (convolution = one grouped ``conv2d``, or batched GEMMs: ``Plan.conv``; GroupNorm = one
GroupNorm with ``n*G`` groups; BatchNorm = :func:`fedfast.ops.client_batch_norm` over ``n*C`` channels, i.e.
each client's own statistics over its valid rows (not the padding of a partial minibatch), each client's running
buffers read in eval mode and updated by a local step's forward; ReLU, pooling, dropout and residual additions
elementwise on that layout) and ``[n, B, F]`` for the dense part (Linear = one ``baddbmm``), so the only layout changes
are at the input and where the model flattens or
average-pools to a vector.

Batched, as modules or functions: Conv2d (``padding_mode='zeros'``, numeric padding, depthwise/grouped), Linear
(on any per-client shape ``[..., in]``), the elementwise activations ReLU, ReLU6, Hardtanh, LeakyReLU, ELU, Tanh,
Sigmoid, Hardsigmoid, Hardswish, SiLU, Mish, GELU, Identity (modules, and ``torch.relu`` / ``torch.sigmoid`` /
``torch.tanh`` and ``F.relu``, ``F.relu6``, ``F.hardtanh``, ``F.sigmoid``, ``F.hardsigmoid``, ``F.hardswish``,
``F.silu``, ``F.mish``, ``F.gelu``, ``F.tanh``, ``F.leaky_relu``, ``F.elu`` with constant options), MaxPool2d,
AvgPool2d, AdaptiveAvgPool2d (modules, and ``F.max_pool2d``, ``F.avg_pool2d``, ``F.adaptive_avg_pool2d`` with
constant sizes), Flatten (from dim 1), Dropout, GroupNorm, BatchNorm1d/2d (with or without running statistics),
``x + y`` and ``x * y`` of two per-client values (each client's broadcasting), ``torch.cat`` of per-client values
(the channels of images stay grouped), ``torch.flatten(x, 1)`` / ``x.flatten(1)`` / ``x.flatten(start_dim=1)`` /
``x.view(x.size(0), -1)``, ``x.mean((2, 3))`` / ``x.mean([2, 3])`` (global average pooling) and torchvision's
``StochasticDepth`` (``mode`` "row": one draw per client and sample; "batch": one per client and minibatch).

Everything else the forward does (``permute``, ``reshape``, LayerNorm, attention, a user's function, a module
without a batched form) runs per client inside the program: that node alone through ``torch.func.vmap``
(:mod:`fedfast.batched.per_client`), the rest batched; ``Plan.per_client`` names those nodes with the model's file
and line. Shape queries (``x.shape``, ``x.size(1)``) are answered per client. That covers every classification
family of torchvision 0.28 as its builders make them (``tests/test_torchvision_builders.py``). Only a forward that
torch.fx cannot trace (a Python branch on a tensor's value), or that takes more than one tensor, makes :func:`plan`
return ``(None, reason)``; the engine then uses vmap for the whole model, with a warning saying why. Results equal
the per-client modules up to floating point summation order (the engine checks this on a probe batch).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.client_batch_norm import client_batch_norm
from ..ops.client_conv import client_conv2d
from ..ops.conv_cpu import PointwiseConv2d, conv2d
from .per_client import PerClient, Ref, carried, client_major, is_meta_node, refs_of

_ELEMENTWISE = (
    nn.ReLU,
    nn.ReLU6,
    nn.Hardtanh,
    nn.LeakyReLU,
    nn.ELU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Hardsigmoid,
    nn.Hardswish,
    nn.SiLU,
    nn.Mish,
    nn.GELU,
    nn.Identity,
)
_POOL = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d)
# elementwise functions (one tensor, the rest constants): the same call on the grouped or dense layout
_UNARY = {
    torch.relu,
    torch.sigmoid,
    torch.tanh,
    F.relu,
    F.relu6,
    F.hardtanh,
    F.sigmoid,
    F.tanh,
    F.hardsigmoid,
    F.hardswish,
    F.silu,
    F.mish,
    F.gelu,
    F.leaky_relu,
    F.elu,
}
_UNARY_METHODS = ("relu", "sigmoid", "tanh")
# per-channel pooling functions (constant sizes): the same call on the grouped layout [B, n*C, H, W]
_POOL_FN = {F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d}


def _is_stochastic_depth(m: nn.Module) -> bool:
    """torchvision.ops.StochasticDepth (or a module of that name and layout: ``p``, ``mode``)."""
    return type(m).__name__ == "StochasticDepth" and hasattr(m, "p") and getattr(m, "mode", None) in ("row", "batch")


_MODULES = (
    (nn.Conv2d, nn.Linear, nn.Flatten, nn.Dropout, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d) + _ELEMENTWISE + _POOL
)


@dataclass
class Step:
    """One node of the program: ``op`` on the values at ``args`` (indices of earlier steps)."""

    # "input", "module", "add", "mul", "relu", "unary", "pool", "flatten", "gap", "cat", "output"; "attr" (a
    # parameter or buffer of the clients), "const" (a value shared by the clients), "call" (a node run per client)
    op: str
    args: tuple = ()
    name: str = ""  # module path (parameter prefix)
    module: nn.Module | None = None
    # "unary" / "pool": (fn, const args, kwargs), called as fn(h, *const, **kwargs); "cat": the dim; "const": the
    # value; "call": its :class:`~fedfast.batched.per_client.PerClient`
    call: object = None


class Plan(list):
    """The traced program (a list of :class:`Step`). ``dense_input``: the input is only flattened (an MLP), so
    images enter as ``[n, B, C*H*W]`` directly, without the grouped image layout and back. ``conv``: how a
    convolution with per-client weights runs (:func:`fedfast.ops.client_conv.client_conv2d`: ``"grouped"``,
    ``"gemm"``, ``"triton"`` or ``"hybrid"``; layers with ``groups > 1`` always run grouped). ``channels_last``: the
    image layout (None: NHWC on a CPU, where oneDNN wants it, and for Triton convolutions, whose channel loads it makes
    contiguous; NCHW otherwise, ``"hybrid"`` included: cuDNN's grouped gradients run faster in NCHW)."""

    dense_input = False
    conv = "grouped"
    channels_last: bool | None = None
    per_client: list = []  # the nodes that run per client (vmap of the node alone), each with the model's line
    aliases: tuple = ()  # (name, the name it shares its tensor with): tied weights, one flat row under the first name

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
        """:func:`batched_forward` of this program (the executors' common call, as
        :meth:`fedfast.grouped.GroupedPlan.forward`)."""
        if self.aliases:  # a tied weight: every name that reads it gets the one leaf, whose gradient sums the uses
            params = {**params, **{a: params[c] for a, c in self.aliases if c in params}}
            if buffers is not None:
                buffers = {**buffers, **{a: buffers[c] for a, c in self.aliases if c in buffers}}
        cl = self.channels_last
        if cl is None:
            cl = x.device.type == "cpu" or self.conv == "triton"
        return batched_forward(self, params, x, training, features, cl, buffers=buffers, valid=valid, update=update)


def _module_ok(m: nn.Module) -> str:
    if _is_stochastic_depth(m):
        return ""
    if torch.nn.utils.parametrize.is_parametrized(m) or m._forward_pre_hooks or m._forward_hooks:
        return f"{type(m).__name__} has parametrizations or forward hooks (weight_norm, spectral_norm)"
    if not isinstance(m, _MODULES):
        return f"{type(m).__name__} is not a supported layer"
    if isinstance(m, nn.Conv2d) and (m.padding_mode != "zeros" or isinstance(m.padding, str)):
        return "a Conv2d with non-zero or string padding"
    if isinstance(m, nn.Flatten) and (m.start_dim != 1 or m.end_dim != -1):
        return "a Flatten that is not from dim 1"
    return ""


def _const(v) -> bool:
    return isinstance(v, (int, tuple, list)) and not isinstance(v, bool)


class _Tracer(torch.fx.Tracer):
    """torch.fx's tracer, with fedfast's :class:`~fedfast.ops.conv_cpu.PointwiseConv2d` (an ``nn.Conv2d`` whose CPU
    forward subsamples) a leaf like ``nn.Conv2d``: the program runs it as a convolution, subsampled on the CPU."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return type(m) is PointwiseConv2d or _is_stochastic_depth(m) or super().is_leaf_module(m, qualname)


def _function_step(node, a: list) -> Step | str:
    """The program step of a ``call_function`` node (``a``: its arguments' step indices, None for constants), or
    why it is not supported."""
    if (
        node.target in (operator.add, torch.add, operator.iadd)
        and len(node.args) == 2
        and None not in a
        and not node.kwargs
    ):
        step = Step("add", tuple(a))
    elif (
        node.target in (operator.mul, torch.mul, operator.imul)
        and len(node.args) == 2
        and None not in a
        and not node.kwargs
    ):
        step = Step("mul", tuple(a))  # a gate: sigmoid(fc(pool(x))) * x
    elif node.target in (torch.relu, F.relu) and a and a[0] is not None and not node.kwargs:
        step = Step("relu", (a[0],))
    elif (
        node.target in _UNARY
        and a
        and a[0] is not None
        and all(x is None for x in a[1:])
        and not any(isinstance(v, torch.fx.Node) for v in node.kwargs.values())
    ):
        step = Step("unary", (a[0],), call=(node.target, tuple(node.args[1:]), dict(node.kwargs)))
    elif (
        node.target in _POOL_FN
        and a
        and a[0] is not None
        and all(_const(v) or v is None or isinstance(v, bool) for v in node.args[1:])
        and not any(isinstance(v, torch.fx.Node) for v in node.kwargs.values())
        and not node.kwargs.get("return_indices", False)
    ):
        step = Step("pool", (a[0],), call=(node.target, tuple(node.args[1:]), dict(node.kwargs)))
    elif node.target is torch.flatten and a and a[0] is not None and _flatten_from_1(node.args[1:], node.kwargs):
        step = Step("flatten", (a[0],))
    elif node.target is torch.mean and a and a[0] is not None and _is_gap(node.args[1:], node.kwargs):
        step = Step("gap", (a[0],))
    else:
        return f"the function {getattr(node.target, '__name__', node.target)} has no batched form"
    return step


def _cat_args(node):
    """``(tensors, dim)`` of a ``torch.cat`` node with a constant dim, else None."""
    seq = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if node.target is not torch.cat or set(node.kwargs) - {"tensors", "dim"} or not isinstance(dim, int):
        return None
    if not isinstance(seq, (list, tuple)) or not seq:
        return None
    return seq, dim


def _dims(v):
    """A dims argument as a tuple (``[2, 3]`` and ``(2, 3)`` alike)."""
    return tuple(v) if isinstance(v, (list, tuple)) else v


def _flatten_from_1(args: tuple, kwargs: dict) -> bool:
    """``flatten`` of ``(x, *args, **kwargs)`` is from dim 1 to the end."""
    bound = dict(zip(("start_dim", "end_dim"), args, strict=False)) | dict(kwargs)
    return set(bound) <= {"start_dim", "end_dim"} and bound.get("start_dim", 0) == 1 and bound.get("end_dim", -1) == -1


def _is_gap(args: tuple, kwargs: dict) -> bool:
    """``mean`` of ``(x, *args, **kwargs)`` is over the two spatial dims of an image, without keepdim."""
    bound = dict(zip(("dim", "keepdim"), args, strict=False)) | dict(kwargs)
    spatial = {(2, 3), (-2, -1), (-1, -2), (3, 2)}
    return set(bound) <= {"dim", "keepdim"} and _dims(bound.get("dim")) in spatial and not bound.get("keepdim")


def _method_step(node, a0: int, rest: tuple) -> Step | str:
    """The program step of a ``call_method`` node on step ``a0`` with the other arguments ``rest`` (constants), or
    why it has none (it then runs per client)."""
    if node.target == "relu" and not rest and not node.kwargs:
        step = Step("relu", (a0,))
    elif node.target in _UNARY_METHODS and not rest and not node.kwargs:
        step = Step("unary", (a0,), call=(getattr(torch, node.target), (), {}))
    elif node.target == "flatten" and _flatten_from_1(rest, node.kwargs):
        step = Step("flatten", (a0,))
    elif node.target == "mean" and _is_gap(rest, node.kwargs):
        step = Step("gap", (a0,))
    else:
        return f"the method {node.target}{rest} has no batched form"
    return step


def _trace(module: nn.Module):
    """torch.fx's graph of ``module`` (with each node's stack trace: errors name the model's line)."""
    tracer = _Tracer()
    tracer.record_stack_traces = True
    return torch.fx.GraphModule(module, tracer.trace(module))


class _Planner:
    """The program under construction: ``idx`` (fx node -> step), ``client`` (the steps whose value is per client),
    ``sizes`` (the ``x.size(0)`` nodes seen), ``owned`` (the model's parameter and buffer names)."""

    def __init__(self, module: nn.Module, gm):
        self.mods = dict(gm.named_modules())
        self.gm = gm
        self.owned = {k for k, _ in module.named_parameters()} | {k for k, b in module.named_buffers() if carried(k, b)}
        self.prog, self.idx, self.sizes, self.client = Plan(), {}, {}, set()

    def ref(self, a):
        """A node argument's step if it is a per-client program value, else None."""
        i = self.idx.get(a) if isinstance(a, torch.fx.Node) else None
        return i if i in self.client else None

    def shared_args(self, node) -> bool:
        """Whether a node argument is a value shared by the clients (a shape, a constant tensor)."""
        found = []
        torch.fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(self.idx[a] not in self.client))
        return any(found)

    def add(self, node, step: Step, client: bool = True) -> None:
        self.idx[node] = len(self.prog)
        if client:
            self.client.add(len(self.prog))
        self.prog.append(step)

    def per_client(self, node, module: nn.Module | None = None) -> None:
        """The node as a per-client call (vmap of the node alone), or a shared value where nothing in it is per
        client (a shape query, arithmetic on shapes, a constant)."""
        tmpl = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: Ref(self.idx[a]))
        refs = tuple(dict.fromkeys(refs_of(tmpl)))
        meta = is_meta_node(node)
        own = module is not None and any(True for _ in [*module.parameters(), *module.buffers()])
        client = not meta and (own or any(r in self.client for r in refs))
        call = PerClient(node, tmpl[0], tmpl[1], module=module, meta=meta)
        call.shared = not client
        self.add(node, Step("call", refs, node.target if module is not None else "", module, call=call), client)

    def node(self, node) -> str:
        """Adds the node's step; returns why the program cannot be made ("" when it can)."""
        if node.op == "placeholder":
            if not any(s.op == "input" for s in self.prog):
                self.add(node, Step("input"))
            elif node.args:  # an optional argument left at its default
                self.add(node, Step("const", call=node.args[0]), client=False)
            else:
                return "its forward takes more than one input"
        elif node.op == "get_attr":
            if node.target in self.owned:
                self.add(node, Step("attr", name=node.target))
            else:
                self.add(node, Step("const", call=_fetch_attr(self.gm, node.target)), client=False)
        elif node.op == "call_module":
            self.module_node(node)
        elif node.op in ("call_function", "call_method"):
            self.function_node(node)
        elif node.op == "output":
            if self.ref(node.args[0]) is None:
                return "it does not return one tensor computed from its input"
            self.prog.append(Step("output", (self.ref(node.args[0]),)))
        else:
            return f"the graph node {node.op} {node.target} is not supported"
        return ""

    def module_node(self, node) -> None:
        m = self.mods[node.target]
        one = len(node.args) == 1 and not node.kwargs and self.ref(node.args[0]) is not None
        if _module_ok(m) or not one:
            self.per_client(node, m)
        else:
            self.add(node, Step("module", (self.ref(node.args[0]),), node.target, m))

    def function_node(self, node) -> None:
        if node.op == "call_method" and node.target == "size" and tuple(node.args[1:]) == (0,):
            if self.ref(node.args[0]) is not None:
                self.sizes[node] = self.ref(node.args[0])  # x.size(0): the batch dimension of a view below
        if node.op == "call_method" and node.target in ("view", "reshape") and len(node.args) == 3:
            a0, size, last = node.args
            if self.ref(a0) is not None and self.sizes.get(size) == self.ref(a0) and last == -1:
                return self.add(node, Step("flatten", (self.ref(a0),)))
        step = None
        cat = _cat_args(node) if node.op == "call_function" else None
        if cat is not None and all(self.ref(v) is not None for v in cat[0]):
            return self.add(node, Step("cat", tuple(self.ref(v) for v in cat[0]), call=cat[1]))
        if not self.shared_args(node) and not is_meta_node(node):
            if node.op == "call_function":
                step = _function_step(node, [self.ref(x) for x in node.args])
            elif self.ref(node.args[0]) is not None:
                step = _method_step(node, self.ref(node.args[0]), tuple(node.args[1:]))
        if isinstance(step, Step):
            self.add(node, step)
        else:
            self.per_client(node)


def _fetch_attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def plan(module: nn.Module) -> tuple[Plan | None, str]:
    """``(program, "")`` if the executor can run ``module``, else ``(None, why not)``: the forward must trace with
    torch.fx, take one tensor and return one. Nodes without a batched form run per client inside the program
    (:mod:`fedfast.batched.per_client`); ``Plan.per_client`` names them."""
    try:
        gm = _trace(module)
    except Exception as e:  # noqa: BLE001 - data-dependent control flow, unsupported Python
        return None, f"torch.fx cannot trace its forward ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    pl = _Planner(module, gm)
    for node in gm.graph.nodes:
        why = pl.node(node)
        if why:
            return None, why
    prog = pl.prog
    if not any(s.op in ("module", "attr") or (s.op == "call" and s.module is not None) for s in prog):
        return None, "it has no layers"
    _pool_before_relu(prog)
    first = [s for s in prog if 0 in s.args]
    prog.dense_input = bool(first) and all(
        s.op == "flatten" or (s.op == "module" and isinstance(s.module, nn.Flatten)) for s in first
    )
    prog.per_client = [s.call.where for s in prog if s.op == "call" and not s.call.shared]
    prog.aliases = tied_names(module)
    return prog, ""


def tied_names(module: nn.Module) -> tuple:
    """``((name, first name), ...)``: each parameter or buffer reachable under more than one name (tied weights),
    with the name ``named_parameters()`` / ``named_buffers()`` keep for it."""
    out = []
    for items in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        first: dict = {}
        for name, t in items:
            if id(t) in first:
                out.append((name, first[id(t)]))
            else:
                first[id(t)] = name
    return tuple(out)


def _pool_before_relu(prog: Plan) -> None:
    """ReLU then MaxPool2d == MaxPool2d then ReLU (max commutes with a non-decreasing map, and both orders send the
    gradient to the window's first maximum when it is positive, nowhere otherwise): pooling first runs the ReLU and
    its backward on a 4x smaller tensor. Applied where the ReLU's only consumer is the pooling."""
    users: dict[int, list[int]] = {}
    for i, s in enumerate(prog):
        for a in s.args:
            users.setdefault(a, []).append(i)
    for i, s in enumerate(prog):
        is_relu = (s.op == "module" and type(s.module) is nn.ReLU) or s.op == "relu"
        if not is_relu or users.get(i, []) == [] or len(users[i]) != 1:
            continue
        j = users[i][0]
        p = prog[j]
        if p.op == "module" and type(p.module) is nn.MaxPool2d:
            # pool reads the ReLU's input; the ReLU reads the pool's output; the pool's users read the ReLU
            src = s.args[0]
            prog[i], prog[j] = Step("module", (src,), p.name, p.module), Step("relu", (i,))  # j's users: relu(pool)


class _BatchedLinear(torch.autograd.Function):
    """``y_k = x_k w_k^T + b_k`` for n clients (x ``[n, B, in]``, w ``[n, out, in]``, b ``[n, out]``).

    Autograd of ``baddbmm(b, x, w.transpose(1, 2))`` forms d w as ``x^T g`` in the transposed ``[n, in, out]``
    layout and the flat gradient then copies it back with a transpose (for the FedAvg CNN's 3136x512 layer on
    2 CPU cores: a 64 MB strided copy, ~55 ms per step, plus a ~35 ms gemm on a transposed operand). Here
    the backward forms ``g^T x`` directly in w's own layout (~15 ms)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        wt = w.transpose(1, 2)
        return torch.bmm(x, wt) if b is None else torch.baddbmm(b[:, None, :], x, wt)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = torch.bmm(g, w) if ctx.needs_input_grad[0] else None
        gw = torch.bmm(g.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        gb = g.sum(1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


class _NCHWForDense(torch.autograd.Function):
    """NHWC activations -> NCHW order for the Flatten before a Linear (its weights index C*H*W), with the
    gradient handed back in NHWC: otherwise the pooling backward before it receives an NCHW gradient and
    converts its 4x larger input and output instead (measured: ~15 ms per step for the FedAvg CNN)."""

    @staticmethod
    def forward(ctx, h):
        return h.contiguous()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        return g.contiguous(memory_format=torch.channels_last)


def _input_layout(x: Tensor, dense_input: bool, cl: bool):
    """The program's input: images [n, B, C, H, W] in the grouped layout [B, n*C, H, W] (NHWC on CPU), or only
    flattened for a dense first layer; anything else as it is. Returns (tensor, grouped)."""
    n, B = x.shape[0], x.shape[1]
    if x.dim() == 5 and dense_input:  # only flattened: [n, B, C*H*W] (flatten below is a no-op)
        return x.reshape(n, B, -1), False
    if x.dim() == 5:  # images: the grouped layout [B, n*C, H, W]
        h = x.transpose(0, 1).reshape(B, n * x.shape[2], x.shape[3], x.shape[4])
        if cl:
            h = h.contiguous(memory_format=torch.channels_last)
            if h.shape[1] == 1:  # one channel: NCHW strides pass as NHWC and oneDNN would answer in NCHW
                h = h.as_strided(h.shape, (h.stride(0), 1, h.stride(2), 1))
        return h, True
    return x, False


def _apply_module(m: nn.Module, name: str, h: Tensor, grouped: bool, run: "_Run"):
    """One layer for all n clients at once, with each client's own parameters; returns (output, grouped)."""
    params, n, B, training = run.params, run.n, run.B, run.training
    if isinstance(m, nn.Conv2d):
        h = _conv(m, name, run.grouped(h, grouped), params, n, run.conv, run.cl)
        grouped = True
    elif isinstance(m, nn.GroupNorm):
        w, b = params.get(f"{name}.weight"), params.get(f"{name}.bias")
        h = F.group_norm(
            run.grouped(h, grouped),
            n * m.num_groups,
            None if w is None else w.reshape(-1),
            None if b is None else b.reshape(-1),
            m.eps,
        )
        grouped = True
    elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
        h, grouped = _batch_norm(m, name, h, grouped, run)
    elif isinstance(m, nn.Flatten):
        h, grouped = run.dense(h, grouped), False
    elif isinstance(m, nn.Linear):
        w = params[f"{name}.weight"]
        b = params.get(f"{name}.bias")
        h = client_major(h, grouped, n, B)
        lead = h.shape[1:-1]
        h = _BatchedLinear.apply(h.reshape(n, -1, h.shape[-1]), w, b).reshape(n, *lead, w.shape[1])
        grouped = False
    elif isinstance(m, nn.Dropout):
        h = F.dropout(h, m.p, training)
    elif _is_stochastic_depth(m):
        h = _stochastic_depth(h, float(m.p), m.mode, training, grouped, n, B)  # client-major: the dense branch
    elif isinstance(m, _POOL):  # per channel: the grouped layout is already right
        h, grouped = m(run.grouped(h, grouped)), True
    else:  # elementwise: any layout
        h = m(h)
    return h, grouped


def _conv(m: nn.Conv2d, name: str, h: Tensor, params: dict, n: int, conv: str, cl: bool) -> Tensor:
    """A Conv2d for n clients on the grouped layout, each with its own weights."""
    w = params[f"{name}.weight"]
    b = params.get(f"{name}.bias")
    if m.groups == 1 and conv != "grouped":
        h = client_conv2d(h, w, b, m.stride, m.padding, m.dilation, impl=conv)
    else:
        h = conv2d(
            h,
            w.reshape(n * w.shape[1], *w.shape[2:]),
            None if b is None else b.reshape(-1),
            m.stride,
            m.padding,
            m.dilation,
            n * m.groups,
        )  # a strided 1x1 on the CPU: subsampled
    if cl and h.dim() == 4 and not h.is_contiguous(memory_format=torch.channels_last):
        h = h.contiguous(memory_format=torch.channels_last)
    return h


def _batch_norm(m: nn.Module, name: str, h: Tensor, grouped: bool, run: "_Run"):
    """BatchNorm per client: its statistics over its valid rows, its weights, its running buffers."""
    buffers, n, B, training = run.buffers, run.n, run.B, run.training
    r = {}
    if m.running_mean is not None:
        if buffers is None or f"{name}.running_mean" not in buffers:
            raise ValueError(f"model: BatchNorm {name!r} keeps running statistics; the forward needs its buffers")
        r = dict(
            running_mean=buffers[f"{name}.running_mean"],
            running_var=buffers[f"{name}.running_var"],
            num_batches_tracked=buffers.get(f"{name}.num_batches_tracked"),
        )
    kw = dict(
        valid=run.valid,
        use_batch_stats=training or not r,
        update=bool(run.update and training and r),
        momentum=m.momentum,
        eps=m.eps,
        **r,
    )
    w, b = run.params.get(f"{name}.weight"), run.params.get(f"{name}.bias")
    if not grouped and h.dim() == 3:  # [n, B, F] -> [B, n*F]
        Fd = h.shape[-1]
        h = client_batch_norm(h.transpose(0, 1).reshape(B, n * Fd), n, w, b, **kw)
        return h.reshape(B, n, Fd).transpose(0, 1), False
    return client_batch_norm(run.grouped(h, grouped), n, w, b, **kw), True


def _stochastic_depth(h: Tensor, p: float, mode: str, training: bool, grouped: bool, n: int, B: int) -> Tensor:
    """torchvision's ``stochastic_depth`` for n clients at once: in training, each client's sample ("row") or each
    client's whole minibatch ("batch") is kept with probability 1 - p and then scaled by 1 / (1 - p), else zeroed
    (the residual branch dropped); the identity in eval mode or at p = 0. Grouped ``[B, n*C, H, W]``: the noise is
    ``[B or 1, n, 1, 1, 1]``; dense ``[n, B, F]``: ``[n, B or 1, 1]``."""
    if not training or p == 0.0:
        return h
    keep = 1.0 - p
    if grouped:
        shape = (B if mode == "row" else 1, n) + (1,) * (h.dim() - 1)
        noise = torch.empty(shape, dtype=h.dtype, device=h.device).bernoulli_(keep)
        if keep > 0:
            noise.div_(keep)
        return (h.reshape(B, n, -1, *h.shape[2:]) * noise).reshape(h.shape)
    shape = (n, B if mode == "row" else 1) + (1,) * (h.dim() - 2)
    noise = torch.empty(shape, dtype=h.dtype, device=h.device).bernoulli_(keep)
    if keep > 0:
        noise.div_(keep)
    return h * noise


def batched_forward(
    prog: Plan,
    params: dict,
    x: Tensor,
    training: bool,
    features: nn.Module | None = None,
    channels_last: bool | None = None,
    *,
    buffers: dict | None = None,
    valid: Tensor | None = None,
    update: bool = False,
):
    """Run the program from :func:`plan` for n clients: ``params[name.weight]`` is ``[n, *shape]``, ``x`` is
    ``[n, B, ...]``. Returns ``[n, B, out]`` (or ``(input of features [n, B, d], out)``). ``buffers``:
    ``{name: [n, *shape]}`` (BatchNorm's running statistics); ``valid`` [n, B]: the rows that enter BatchNorm's
    batch statistics (None: all); ``update``: a training forward updates the running buffers in place."""
    # CPU: oneDNN convolution and pooling are much faster in NHWC (a 2x2 max-pool: ~10x); a convolution whose
    # output is not NHWC anyway (grouped weights) is converted.
    cl = channels_last if channels_last is not None else x.device.type == "cpu"
    run = _Run(prog, params, x, training, features, cl, buffers, valid, update)
    h, grouped = run.all()
    if not torch.is_tensor(h):
        raise ValueError(f"model: must return one tensor of logits, got {type(h).__name__}")
    if grouped is None:
        raise ValueError("model: its output is the same for every client (it does not depend on the input)")
    if grouped:  # [B, n*C, H, W] -> [n, B, C, H, W]
        h = client_major(h, True, run.n, run.B)
    return (run.feat, h) if features is not None else h


class _Run:
    """One run of a program: ``vals[i]`` is step i's ``(value, layout)``, the layout True for the grouped image
    layout ``[B, n*C, ...]``, False for client-major ``[n, ...]``, None for a value shared by every client."""

    def __init__(self, prog, params, x, training, features, cl, buffers, valid, update):
        self.prog, self.params, self.x, self.training, self.features = prog, params, x, training, features
        self.cl, self.buffers, self.valid, self.update = cl, buffers, valid, update
        self.n, self.B = x.shape[0], x.shape[1]
        self.conv = getattr(prog, "conv", "grouped")
        self.vals: list = [None] * len(prog)
        self.feat = None

    def dense(self, h, grouped):
        """[B, n*C, H, W] (grouped) -> [n, B, C*H*W]; client-major [n, B, ...] -> [n, B, F]."""
        n, B = self.n, self.B
        if grouped:
            if self.cl and not h.is_contiguous():
                h = _NCHWForDense.apply(h)
            return h.reshape(B, n, -1).transpose(0, 1)
        return h.reshape(n, B, -1)

    def grouped(self, h, grouped):
        """A value in the grouped layout ``[B, n*C, ...]`` (from client-major ``[n, B, C, ...]``)."""
        if grouped:
            return h
        if h.dim() < 3:
            raise ValueError(f"model: a per-channel layer on a tensor of per-client shape {tuple(h.shape[1:])}")
        n, B = self.n, self.B
        h = h.transpose(0, 1).reshape(B, n * h.shape[2], *h.shape[3:])
        if self.cl and h.dim() == 4:
            h = h.contiguous(memory_format=torch.channels_last)
        return h

    def all(self):
        for i, s in enumerate(self.prog):
            if s.op == "output":
                return self.vals[s.args[0]]
            self.vals[i] = self.step(s)
        raise ValueError("model: the program has no output")

    def step(self, s: Step):
        op = s.op
        if op == "input":
            return _input_layout(self.x, self.prog.dense_input, self.cl)
        if op == "attr":
            src = self.params if s.name in self.params else (self.buffers or {})
            if s.name not in src:
                raise ValueError(f"model: {s.name!r} is not among the clients' parameters and buffers")
            return src[s.name], False
        if op == "const":
            return s.call, None
        if op == "call":
            return s.call(self.vals, self.params, self.buffers, self.n, self.B)
        if op == "cat":
            return self.cat([self.vals[a] for a in s.args], s.call)
        h, grouped = self.vals[s.args[0]]
        if op in ("add", "mul"):
            return self.binary(operator.add if op == "add" else operator.mul, (h, grouped), self.vals[s.args[1]])
        if op == "relu":
            return torch.relu(h), grouped
        if op == "unary":
            fn, const, kw = s.call
            return fn(h, *const, **kw), grouped
        if op == "pool":
            fn, const, kw = s.call
            return fn(self.grouped(h, grouped), *const, **kw), True
        if op == "flatten":
            return self.dense(h, grouped), False
        if op == "gap":  # x.mean((2, 3)): global average pooling to a vector
            if grouped:
                return h.mean((2, 3)).reshape(self.B, self.n, -1).transpose(0, 1), False
            return h.mean((3, 4)), False
        if s.module is self.features and self.features is not None:
            self.feat = h if not grouped else h.reshape(self.B, self.n, -1).transpose(0, 1)
        return _apply_module(s.module, s.name, h, grouped, self)

    def binary(self, op, a, b):
        """``op`` of two per-client values with each client's broadcasting: in the grouped layout when both are;
        else client-major, the lower-rank value's dims inserted after the client dim."""
        (h1, g1), (h2, g2) = a, b
        if g1 and g2:
            return op(h1, h2), True
        h1, h2 = client_major(h1, g1, self.n, self.B), client_major(h2, g2, self.n, self.B)
        if h1.dim() != h2.dim():
            lo, hi = (h1, h2) if h1.dim() < h2.dim() else (h2, h1)
            lo = lo.reshape(lo.shape[0], *([1] * (hi.dim() - lo.dim())), *lo.shape[1:])
            h1, h2 = (lo, hi) if h1.dim() < h2.dim() else (hi, lo)
        return op(h1, h2), False

    def cat(self, parts: list, dim: int):
        """``torch.cat`` of per-client values along each client's ``dim``: the grouped layout's channels stay
        grouped (each client's channels side by side); otherwise client-major."""
        n, B = self.n, self.B
        if all(g for _, g in parts) and dim in (1, 1 - parts[0][0].dim()):
            hs = [h.reshape(B, n, h.shape[1] // n, *h.shape[2:]) for h, _ in parts]
            out = torch.cat(hs, 2)
            out = out.reshape(B, -1, *out.shape[3:])
            if self.cl and out.dim() == 4:
                out = out.contiguous(memory_format=torch.channels_last)
            return out, True
        hs = [client_major(h, g, n, B) for h, g in parts]
        return torch.cat(hs, dim + 1 if dim >= 0 else dim), False
