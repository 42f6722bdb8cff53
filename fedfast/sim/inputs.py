"""The checks a :class:`fedfast.Simulation`'s arguments pass before anything is built."""

from __future__ import annotations

import numpy as np

from ..data.datasets import ArrayDataset
from ..data.partition import Partition


def check_inputs(
    model, datasets, partition, loss_fn, schedule, data_order, *, client_sampling: str, augment: str
) -> None:
    """The arguments of :class:`fedfast.Simulation` (``datasets``: ``(name, dataset or None)`` pairs, the training
    set first; ``client_sampling``, ``augment``: its config's): their types and agreement (classes, frozen
    parameters, augmentation of non-images, a model's own data checks), a clear error naming the argument, before
    anything is allocated."""
    train = datasets[0][1]
    for name, ds in datasets:
        if ds is not None and not isinstance(ds, ArrayDataset):
            raise TypeError(f"{name}: expected a fedfast.data.ArrayDataset, got {type(ds).__name__}")
        if ds is not None and ds.num_classes != train.num_classes:
            raise ValueError(f"{name}: has {ds.num_classes} classes, the training set {train.num_classes}")
    if not isinstance(partition, Partition):
        raise TypeError(f"partition: expected a fedfast.data.Partition, got {type(partition).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError("loss_fn: expected a callable (student, teacher, target, segments, num_segments) -> loss")
    if schedule is not None and not (callable(schedule) or isinstance(schedule, (list, tuple, np.ndarray))):
        raise TypeError("schedule: expected a sequence of client-id arrays (one per round) or a callable round -> ids")
    if schedule is not None and client_sampling != "uniform":
        raise ValueError(f"client_sampling: {client_sampling!r} draws the cohorts, and so does schedule; give one")
    if data_order is not None and not callable(data_order):
        raise TypeError("data_order: expected a callable (round, client, epoch, n) -> permutation of range(n)")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        raise ValueError(
            f"model: parameters {frozen[:3]}{' ...' if len(frozen) > 3 else ''} are frozen "
            f"(requires_grad=False); the engine trains every parameter of the model, so train a "
            f"model without them (e.g. move frozen layers into preprocessing)"
        )
    if augment != "none" and not train.is_image:
        raise ValueError(
            f"augment: {augment!r} augments images; the training set holds {train.name or 'tokens'}"
            f" (use augment = 'none')"
        )
    check = getattr(model, "check_data", None)  # a model may refuse data it was not made for (HFClassifier)
    if callable(check):
        for name, ds in datasets:
            if ds is not None:
                check(ds, name)
