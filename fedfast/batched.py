"""A vmap-free batched forward: n clients' models over their own inputs at once, for any model whose forward is a
graph of the layers below (plain ``nn.Sequential``, a module wrapping one, residual ResNets).

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

Supported, as modules or functions: Conv2d (``padding_mode='zeros'``, numeric padding, depthwise/grouped), Linear,
the elementwise activations ReLU, ReLU6, Hardtanh, LeakyReLU, ELU, Tanh, Sigmoid, Hardsigmoid, Hardswish, SiLU,
Mish, GELU, Identity (modules, and ``torch.relu`` / ``torch.sigmoid`` / ``torch.tanh`` and ``F.relu``, ``F.relu6``,
``F.hardtanh``, ``F.sigmoid``, ``F.hardsigmoid``, ``F.hardswish``, ``F.silu``, ``F.mish``, ``F.gelu``, ``F.tanh``,
``F.leaky_relu``, ``F.elu`` with constant options), MaxPool2d, AvgPool2d, AdaptiveAvgPool2d (modules, and
``F.max_pool2d``, ``F.avg_pool2d``, ``F.adaptive_avg_pool2d`` with constant sizes), Flatten (from dim 1), Dropout,
GroupNorm, BatchNorm1d/2d (with or without running statistics), ``x + y`` (residual), ``x * y`` of two activations
(a squeeze-excitation gate, broadcast over the pixels), ``torch.flatten(x, 1)`` / ``x.flatten(1)`` /
``x.view(x.size(0), -1)``, ``x.mean((2, 3))`` (global average pooling) and torchvision's ``StochasticDepth``
(``mode`` "row": one draw per client and sample; "batch": one per client and minibatch). That covers torchvision's
ResNet-18/34/50, VGG-11-BN, MobileNetV2, MobileNetV3 and EfficientNet-B0 as their code builds them. Anything else
(attention, custom functions): :func:`plan` returns ``(None, reason)``, the reason naming the layer or function,
and the engine uses vmap, with a warning saying why. Results equal the per-client modules up to floating point
summation order (the engine checks this on a probe batch).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ops.client_batch_norm import client_batch_norm
from .ops.client_conv import client_conv2d
from .ops.conv_cpu import PointwiseConv2d, conv2d

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

    op: str  # "input", "module", "add", "mul", "relu", "unary", "pool", "flatten", "gap", "output"
    args: tuple = ()
    name: str = ""  # module path (parameter prefix)
    module: nn.Module | None = None
    call: tuple | None = None  # "unary" / "pool": (fn, const args, kwargs), called as fn(h, *const, **kwargs)


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
        cl = self.channels_last
        if cl is None:
            cl = x.device.type == "cpu" or self.conv == "triton"
        return batched_forward(self, params, x, training, features, cl, buffers=buffers, valid=valid, update=update)


def _module_ok(m: nn.Module) -> str:
    if _is_stochastic_depth(m):
        return ""
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
    elif (
        node.target is torch.flatten
        and a[0] is not None
        and tuple(node.args[1:]) in ((1,), (1, -1))
        and not node.kwargs
    ):
        step = Step("flatten", (a[0],))
    else:
        return f"the function {getattr(node.target, '__name__', node.target)} is not supported"
    return step


def _method_step(node, a0: int, rest: tuple, sizes: dict) -> Step | str:
    """The program step of a ``call_method`` node on step ``a0`` with the other arguments ``rest`` (``sizes``: the
    ``x.size(0)`` nodes seen), or why it is not supported."""
    if node.target == "relu" and not rest:
        step = Step("relu", (a0,))
    elif node.target in _UNARY_METHODS and not rest and not node.kwargs:
        step = Step("unary", (a0,), call=(getattr(torch, node.target), (), {}))
    elif node.target == "flatten" and rest in ((1,), (1, -1)):
        step = Step("flatten", (a0,))
    elif node.target in ("view", "reshape") and len(rest) == 2 and rest[1] == -1 and sizes.get(rest[0]) == a0:
        step = Step("flatten", (a0,))
    elif (
        node.target == "mean"
        and (rest in (((2, 3),), ((-2, -1),), ((-1, -2),), ((3, 2),)) or node.kwargs.get("dim") in ((2, 3), (-2, -1)))
        and not node.kwargs.get("keepdim", False)
    ):
        step = Step("gap", (a0,))
    else:
        return f"the method {node.target}{rest} is not supported"
    return step


def plan(module: nn.Module) -> tuple[Plan | None, str]:
    """``(program, "")`` if the executor supports ``module``, else ``(None, why not)``."""
    try:
        gm = torch.fx.GraphModule(module, _Tracer().trace(module))
    except Exception as e:  # noqa: BLE001 - data-dependent control flow, unsupported Python
        return None, f"torch.fx cannot trace its forward ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    mods = dict(gm.named_modules())
    prog, idx, sizes = Plan(), {}, {}
    for node in gm.graph.nodes:

        def ref(a):
            return idx.get(a) if isinstance(a, torch.fx.Node) else None

        if node.op == "placeholder":
            if any(s.op == "input" for s in prog):
                return None, "its forward takes more than one input"
            idx[node] = len(prog)
            prog.append(Step("input"))
        elif node.op == "call_module":
            m = mods[node.target]
            why = _module_ok(m)
            if why:
                return None, why
            if len(node.args) != 1 or node.kwargs or ref(node.args[0]) is None:
                return None, f"{node.target} is called with other than one tensor"
            idx[node] = len(prog)
            prog.append(Step("module", (ref(node.args[0]),), node.target, m))
        elif node.op == "call_function":
            step = _function_step(node, [ref(x) for x in node.args])
            if isinstance(step, str):
                return None, step
            idx[node] = len(prog)
            prog.append(step)
        elif node.op == "call_method":
            a0 = ref(node.args[0])
            rest = tuple(node.args[1:])
            if node.target == "size" and rest == (0,) and a0 is not None:
                sizes[node] = a0  # x.size(0): only as the batch dimension of a view/reshape below
                continue
            if a0 is None:
                return None, f"the method {node.target} on a non-tensor"
            step = _method_step(node, a0, rest, sizes)
            if isinstance(step, str):
                return None, step
            idx[node] = len(prog)
            prog.append(step)
        elif node.op == "output":
            if ref(node.args[0]) is None:
                return None, "it does not return one tensor"
            prog.append(Step("output", (ref(node.args[0]),)))
        else:
            return None, f"the graph node {node.op} {node.target} is not supported"
    if not any(s.op == "module" for s in prog):
        return None, "it has no layers"
    _pool_before_relu(prog)
    first = [s for s in prog if 0 in s.args]
    prog.dense_input = bool(first) and all(
        s.op == "flatten" or (s.op == "module" and isinstance(s.module, nn.Flatten)) for s in first
    )
    return prog, ""


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


def _apply_module(
    m: nn.Module,
    name: str,
    h: Tensor,
    grouped: bool,
    params: dict,
    n: int,
    B: int,
    training: bool,
    conv: str,
    cl: bool,
    dense,
    buffers: dict | None = None,
    valid: Tensor | None = None,
    update: bool = False,
):
    """One layer for all n clients at once, with each client's own parameters; returns (output, grouped)."""
    nhwc = torch.channels_last
    if isinstance(m, nn.Conv2d):
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
        if cl and not h.is_contiguous(memory_format=nhwc):
            h = h.contiguous(memory_format=nhwc)
    elif isinstance(m, nn.GroupNorm):
        w, b = params.get(f"{name}.weight"), params.get(f"{name}.bias")
        h = F.group_norm(
            h, n * m.num_groups, None if w is None else w.reshape(-1), None if b is None else b.reshape(-1), m.eps
        )
    elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):  # per client: its statistics, weights, running buffers
        run = {}
        if m.running_mean is not None:
            if buffers is None or f"{name}.running_mean" not in buffers:
                raise ValueError(f"model: BatchNorm {name!r} keeps running statistics; the forward needs its buffers")
            run = dict(
                running_mean=buffers[f"{name}.running_mean"],
                running_var=buffers[f"{name}.running_var"],
                num_batches_tracked=buffers.get(f"{name}.num_batches_tracked"),
            )
        kw = dict(
            valid=valid,
            use_batch_stats=training or not run,
            update=bool(update and training and run),
            momentum=m.momentum,
            eps=m.eps,
            **run,
        )
        w, b = params.get(f"{name}.weight"), params.get(f"{name}.bias")
        if grouped:
            h = client_batch_norm(h, n, w, b, **kw)
        else:  # [n, B, F] -> [B, n*F]
            Fd = h.shape[-1]
            h = client_batch_norm(h.transpose(0, 1).reshape(B, n * Fd), n, w, b, **kw)
            h = h.reshape(B, n, Fd).transpose(0, 1)
    elif isinstance(m, nn.Flatten):
        h, grouped = dense(h, grouped), False
    elif isinstance(m, nn.Linear):
        w = params[f"{name}.weight"]
        b = params.get(f"{name}.bias")
        if grouped:
            raise ValueError("model: a Linear layer on image activations needs a Flatten before it")
        h = _BatchedLinear.apply(h, w, b)
    elif isinstance(m, nn.Dropout):
        h = F.dropout(h, m.p, training)
    elif _is_stochastic_depth(m):
        h = _stochastic_depth(h, float(m.p), m.mode, training, grouped, n, B)
    else:  # elementwise and pooling act per channel: the grouped layout is already right
        h = m(h)
    return h, grouped


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
    n, B = x.shape[0], x.shape[1]
    feat = None
    # CPU: oneDNN convolution and pooling are much faster in NHWC (a 2x2 max-pool: ~10x); a convolution whose
    # output is not NHWC anyway (grouped weights) is converted.
    cl = channels_last if channels_last is not None else x.device.type == "cpu"
    conv = getattr(prog, "conv", "grouped")
    vals: list = [None] * len(prog)  # (tensor, grouped)

    def dense(h, grouped):
        """[B, n*C, H, W] (grouped) -> [n, B, C*H*W]; dense [n, B, ...] -> [n, B, F]."""
        if grouped:
            if cl and not h.is_contiguous():
                h = _NCHWForDense.apply(h)
            return h.reshape(B, n, -1).transpose(0, 1)
        return h.reshape(n, B, -1)

    out = None
    for i, s in enumerate(prog):
        if s.op == "input":
            vals[i] = _input_layout(x, prog.dense_input, cl)
            continue
        if s.op == "output":
            out = vals[s.args[0]]
            break
        h, grouped = vals[s.args[0]]
        if s.op == "add":
            h2, g2 = vals[s.args[1]]
            if g2 != grouped:
                raise ValueError("model: a residual addition of tensors in different layouts")
            vals[i] = (h + h2, grouped)
            continue
        if s.op == "mul":
            h2, g2 = vals[s.args[1]]
            if g2 != grouped:
                raise ValueError("model: a product of tensors in different layouts")
            vals[i] = (h * h2, grouped)
            continue
        if s.op == "relu":
            vals[i] = (torch.relu(h), grouped)
            continue
        if s.op in ("unary", "pool"):
            fn, const, kw = s.call
            if s.op == "pool" and not grouped:
                raise ValueError(f"model: {getattr(fn, '__name__', fn)} of a non-image tensor")
            vals[i] = (fn(h, *const, **kw), grouped)
            continue
        if s.op == "flatten":
            vals[i] = (dense(h, grouped), False)
            continue
        if s.op == "gap":  # x.mean((2, 3)): global average pooling to a vector
            if not grouped:
                raise ValueError("model: mean over spatial dims of a non-image tensor")
            vals[i] = (h.mean((2, 3)).reshape(B, n, -1).transpose(0, 1), False)
            continue
        m, name = s.module, s.name
        if m is features:
            feat = h if not grouped else h.reshape(B, n, -1).transpose(0, 1)
        h, grouped = _apply_module(m, name, h, grouped, params, n, B, training, conv, cl, dense, buffers, valid, update)
        vals[i] = (h, grouped)
    h, grouped = out
    if grouped:  # [B, n*C, H, W] -> [n, B, C, H, W]
        h = h.reshape(B, n, h.shape[1] // n, *h.shape[2:]).transpose(0, 1)
    return (feat, h) if features is not None else h
