"""Training FLOPs of a model, counted from its layers, so that a timing converts to FLOP/s.

The count (one multiply-add = 2 FLOPs), per sample:

* ``nn.Conv2d``: forward ``2 * C_out * (C_in / groups) * k_h * k_w * H_out * W_out``;
* ``nn.Linear``: forward ``2 * in * out`` per input row (a ``[..., in]`` input has ``prod(...)`` rows);
* backward: the weight gradient costs the forward's FLOPs again, and the input gradient once more, except
  where the layer's input needs no gradient (the first layer, whose input is the data): a training step is
  ``3 x forward`` minus the first layer's input gradient.

Everything else (biases, normalisation, activations, pooling, the loss, the optimizer step) is not counted: for
the convolutional and dense models of the papers it is well under 1 % of the count. The counts equal
``torch.utils.flop_counter.FlopCounterMode`` on one training step of these models (``tests/test_flops.py``),
without running the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LayerFlops:
    """One Conv2d / Linear layer's FLOPs per sample: ``forward``, and ``backward`` (weight gradient + input
    gradient where the input needs one)."""

    name: str
    kind: str
    forward: int
    backward: int


def layer_flops(model: nn.Module, sample: torch.Tensor) -> list[LayerFlops]:
    """Per-sample FLOPs of each Conv2d / Linear call of ``model`` on ``sample`` (one input row, ``[1, ...]``, or
    a batch: the counts are divided by its size), in call order."""
    if not torch.is_tensor(sample) or sample.dim() < 1 or sample.shape[0] < 1:
        raise ValueError("sample: expected an input batch [N, ...] with N >= 1")
    n = sample.shape[0]
    out: list[LayerFlops] = []
    names = {m: k for k, m in model.named_modules()}

    def hook(m, inp, o):
        x = inp[0]
        if isinstance(m, nn.Conv2d):
            cin = m.in_channels // m.groups
            fwd = (
                2
                * m.out_channels
                * cin
                * m.kernel_size[0]
                * m.kernel_size[1]
                * o.shape[-2]
                * o.shape[-1]
                * (o.numel() // (o.shape[-3] * o.shape[-2] * o.shape[-1]))
            )
        else:
            fwd = 2 * m.in_features * m.out_features * (x.numel() // m.in_features)
        fwd //= n
        out.append(
            LayerFlops(names.get(m, type(m).__name__), type(m).__name__, fwd, fwd * (2 if x.requires_grad else 1))
        )

    hooks = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    was = model.training
    try:
        with torch.enable_grad():  # the input of a later layer requires grad only while autograd records
            model.train(was)
            model(sample)
    finally:
        for h in hooks:
            h.remove()
    return out


def training_flops(model: nn.Module, sample: torch.Tensor) -> tuple[int, int]:
    """``(forward, training step)`` FLOPs per sample: the forward alone (a teacher's or an evaluation's) and
    forward + backward of one training step (see the module docstring for what is counted)."""
    layers = layer_flops(model, sample)
    fwd = sum(l.forward for l in layers)
    return fwd, fwd + sum(l.backward for l in layers)


def round_flops(model: nn.Module, sample: torch.Tensor, client_samples: int, *, teacher_forwards: int = 0) -> int:
    """FLOPs of a round's local training: ``client_samples`` training samples (each client's samples times its
    local epochs, summed over the round's clients; padded rows not counted) plus ``teacher_forwards`` samples
    through a teacher's forward (a per-step teacher: as many as the training samples; a cached one: once per
    row per round)."""
    fwd, step = training_flops(model, sample)
    return int(client_samples) * step + int(teacher_forwards) * fwd


def describe(model: nn.Module, sample: torch.Tensor) -> str:
    """A short statement of the count for benchmark records: layers, forward and step MFLOP per sample."""
    layers = layer_flops(model, sample)
    fwd, step = sum(l.forward for l in layers), sum(l.forward + l.backward for l in layers)
    kinds = sorted({l.kind for l in layers})
    return (
        f"{len(layers)} {'/'.join(kinds)} layers: {fwd / 1e6:.3f} MFLOP forward, {step / 1e6:.3f} MFLOP per "
        f"training sample (2 per multiply-add; weight and input gradients; norms, activations, pooling, loss "
        f"and optimizer not counted)"
    )


__all__ = ["LayerFlops", "layer_flops", "training_flops", "round_flops", "describe"]
