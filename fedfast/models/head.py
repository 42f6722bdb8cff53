"""The projection head of MOON (Li, He and Song, CVPR 2021) and FedGKD+ (Yao et al., §5.1): a 2-layer MLP between
the feature extractor and the classifier.

:func:`with_projection_head` returns a copy of a model whose classifier (its last ``nn.Linear``, F -> C) is
replaced by ``Linear(F, F) -> ReLU -> Linear(F, dim) -> Linear(dim, C)``, as MOON's code builds it (``l1``,
``l2``, ``l3`` in its ``ModelFedCon``; out_dim 256) and FedGKD's (``projection_layer`` + ``classifier`` in
``pcode/models/resnet.py``). The representation MOON contrasts is then the projection's output (the input of the
new classifier, the model's last ``nn.Linear``). The new layers are initialised as PyTorch's ``nn.Linear`` under
``torch.manual_seed(seed)``, without touching the caller's random state; the rest of the model is copied as is.
"""
from __future__ import annotations

import copy

import torch
from torch import nn


class ProjectionClassifier(nn.Sequential):
    """``Linear(F, F) -> ReLU -> Linear(F, dim) -> Linear(dim, C)``: the projection head and the new classifier."""

    def __init__(self, features: int, dim: int, classes: int):
        super().__init__(nn.Linear(features, features), nn.ReLU(), nn.Linear(features, dim), nn.Linear(dim, classes))


def with_projection_head(model: nn.Module, dim: int = 256, seed: int = 0) -> nn.Module:
    """A copy of ``model`` with a projection head of output ``dim`` before a new classifier (see the module)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not (isinstance(dim, int) and dim >= 1):
        raise ValueError(f"dim: the projection's output size must be a positive integer, got {dim!r}")
    if any(isinstance(m, ProjectionClassifier) for m in model.modules()):
        raise ValueError("model: already has a projection head (fedfast.models.with_projection_head)")
    out = copy.deepcopy(model)
    found = None
    for parent in out.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                found = (parent, name, child)
    if found is None:
        raise ValueError("model: has no nn.Linear classifier to put a projection head before")
    parent, name, lin = found
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = ProjectionClassifier(lin.in_features, dim, lin.out_features)
    setattr(parent, name, head.to(device=lin.weight.device, dtype=lin.weight.dtype))
    return out
