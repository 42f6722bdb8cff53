"""The projection head of MOON (Li, He and Song, CVPR 2021) and FedGKD+ (Yao et al., §5.1): a 2-layer MLP between
the feature extractor and the classifier.

:func:`with_projection_head` returns a copy of a model whose classifier (an ``nn.Linear``, F -> C, found by
:func:`fedfast.flat.find_classifier`) is replaced by ``Linear(F, F) -> ReLU -> Linear(F, dim) -> Linear(dim, C)``,
as MOON's code builds it (``l1``, ``l2``, ``l3`` in its ``ModelFedCon``; out_dim 256) and FedGKD's
(``projection_layer`` + ``classifier`` in ``pcode/models/resnet.py``). The representation MOON contrasts is then
the projection's output (the input of the new classifier). The new layers are initialised as PyTorch's
``nn.Linear`` under ``torch.manual_seed(seed)``, without touching the caller's random state; the rest of the model
is copied as is.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..flat import find_classifier


class ProjectionClassifier(nn.Sequential):
    """``Linear(F, F) -> ReLU -> Linear(F, dim) -> Linear(dim, C)``: the projection head and the new classifier."""

    def __init__(self, features: int, dim: int, classes: int):
        super().__init__(nn.Linear(features, features), nn.ReLU(), nn.Linear(features, dim), nn.Linear(dim, classes))


def with_projection_head(
    model: nn.Module, dim: int = 256, seed: int = 0, *, classifier: str | None = None, probe: torch.Tensor | None = None
) -> nn.Module:
    """A copy of ``model`` with a projection head of output ``dim`` before a new classifier (see the module).
    ``classifier``: the qualified name of the classifier to replace; None: :func:`fedfast.flat.find_classifier`
    with ``probe`` (inputs: the last ``nn.Linear`` to run), or without it the model's ``features_layer``
    attribute, else the last ``nn.Linear`` declared. The engine passes the classifier it found."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not (isinstance(dim, int) and dim >= 1):
        raise ValueError(f"dim: the projection's output size must be a positive integer, got {dim!r}")
    if any(isinstance(m, ProjectionClassifier) for m in model.modules()):
        raise ValueError("model: already has a projection head (fedfast.models.with_projection_head)")
    name = classifier if classifier is not None else find_classifier(model, probe)
    lin = dict(model.named_modules()).get(name)
    if not isinstance(lin, nn.Linear):
        raise ValueError(f"classifier: {name!r} is not an nn.Linear of the model")
    out = copy.deepcopy(model)
    parent = out.get_submodule(name.rpartition(".")[0])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = ProjectionClassifier(lin.in_features, dim, lin.out_features)
    setattr(parent, name.rpartition(".")[2], head.to(device=lin.weight.device, dtype=lin.weight.dtype))
    return out
