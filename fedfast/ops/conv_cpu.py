"""``conv2d`` on the CPU with a way round a oneDNN bug in torch 2.13: a strided 1 x 1 convolution, computed exactly
as a subsample followed by a stride-1 1 x 1 convolution.

The bug (torch 2.13.0+cpu, oneDNN's AVX2 kernels: CPUs without AVX-512, or any x86 CPU with
``ONEDNN_MAX_CPU_ISA=AVX2``): the weight gradient of a 1 x 1, stride-2, ``groups = 1`` convolution of a float32
``channels_last`` input with few input channels (seen with 2 to 5) writes out of bounds. At 1 intra-op thread
the process usually aborts on glibc's heap check ("corrupted size vs. prev_size", "free(): invalid next size");
at 2 threads the weight gradient is silently wrong (relative error 0.2 to 1.1). Pure PyTorch, no fedfast::

    ONEDNN_MAX_CPU_ISA=AVX2 python -c "
    import torch; torch.set_num_threads(1)
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(4, 3, 1, 1, requires_grad=True)
    torch.nn.functional.conv2d(x, w, stride=2).sum().backward()"

A 1 x 1 kernel with stride ``s`` and zero padding ``p`` reads only the pixels ``(s i - p, s j - p)``, so
``conv2d(x, w, b, s, p) == conv2d(pad(x, p)[..., ::s, ::s], w, b)`` exactly (the same products, summed over the
same input channels); dilation does not apply to a 1 x 1 kernel. fedfast takes that path for every strided
1 x 1 convolution on the CPU, in any layout and dtype: the grouped client convolution
(:func:`fedfast.ops.client_conv.client_conv2d`), the batched executor (:mod:`fedfast.batched`) and the models'
strided shortcuts (:class:`PointwiseConv2d`, which the ResNets use, so a plain per-client loop is safe too).
``tests/test_conv_cpu.py`` runs the crashing shapes in subprocesses at 1 and 2 threads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _pair


def takes_subsample(x: Tensor, w: Tensor, stride) -> bool:
    """Whether :func:`conv2d` takes the subsample path: a CPU tensor, a 1 x 1 kernel and a stride other than 1."""
    return x.device.type == "cpu" and tuple(w.shape[-2:]) == (1, 1) and _pair(stride) != (1, 1)


def conv2d(x: Tensor, w: Tensor, b: Tensor | None = None, stride=1, padding=0, dilation=1, groups: int = 1) -> Tensor:
    """``F.conv2d`` with the same arguments; a strided 1 x 1 convolution on the CPU runs as a subsample and a
    stride-1 convolution (the same values; see the module docstring)."""
    if not takes_subsample(x, w, stride) or isinstance(padding, str):  # "same"/"valid": no stride allowed/needed
        return F.conv2d(x, w, b, stride, padding, dilation, groups)
    (sh, sw), (ph, pw) = _pair(stride), _pair(padding)
    channels_last = _is_channels_last(x)
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    x = x[..., ::sh, ::sw]
    if channels_last:  # keep the caller's layout (oneDNN answers in the input's layout)
        x = x.contiguous(memory_format=torch.channels_last)
    return F.conv2d(x, w, b, 1, 0, 1, groups)


def _is_channels_last(x: Tensor) -> bool:
    try:
        return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    except RuntimeError:  # a tensor under torch.func.vmap has no strides to ask: its layout is the default one
        return False


class PointwiseConv2d(nn.Conv2d):
    """``nn.Conv2d`` (same parameters, ``state_dict`` and ``isinstance``) whose CPU forward takes :func:`conv2d`:
    the models' strided 1 x 1 shortcuts."""

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if self.padding_mode != "zeros":
            return super()._conv_forward(input, weight, bias)
        return conv2d(input, weight, bias, self.stride, self.padding, self.dilation, self.groups)


__all__ = ["conv2d", "takes_subsample", "PointwiseConv2d"]
