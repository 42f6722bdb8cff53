"""A run built from its configuration: the dataset, the method's held-out splits, the partition and the model, each
chosen by name from a registry (:data:`fedfast.data.DATASETS`, :data:`fedfast.data.PARTITIONS`,
:data:`fedfast.models.REGISTRY`; a plug-in adds its own with ``register_dataset`` / ``register_partition`` /
``register_model``), assembled into a :class:`fedfast.Simulation`. The library's entry point below the command
line: ``fedfast run``, ``fedfast sweep`` and :mod:`fedfast.jobs` call :func:`build`.
"""
from __future__ import annotations

import torch


def load_data(cfg, tokenizer=None):
    """The dataset's train and test sets; a missing file names ``data_dir`` and where to get the data."""
    from .data import DATASETS
    spec = {"data_dir": cfg["data_dir"], "tokenizer": tokenizer, "max_length": cfg["max_length"], "seed": cfg["seed"]}
    try:
        return DATASETS[cfg["dataset"]].load(spec)
    except FileNotFoundError as e:
        msg = e.args[1] if len(e.args) > 1 and e.filename else str(e)
        raise ValueError(f"data_dir: dataset {cfg['dataset']!r} needs files under data_dir = {cfg['data_dir']!r} "
                         f"(--set data_dir=PATH): {msg}") from None


def partition(cfg, train):
    """The training set split into ``num_clients`` clients by the registered partition ``cfg["partition"]``."""
    from .data import PARTITIONS
    return PARTITIONS[cfg["partition"]](train, cfg)


def make_model(cfg, train):
    """The registered model ``cfg["model"]`` for the dataset's classes and sample shape."""
    from .models import REGISTRY
    return REGISTRY[cfg["model"]](train.num_classes, tuple(train.x.shape[1:]))


def build(cfg, device=None, group=None):
    """The Simulation a run config describes (data, the method's held-out splits, partition, model)."""
    from .data import text_datasets
    from .engine import Simulation
    torch.manual_seed(cfg["seed"])
    model = tokenizer = None
    if cfg["model"].startswith("hf:"):  # the pretrained encoder, a new head, and the tokenizer the texts need
        from .models import hf
        model, tokenizer = hf.load(cfg["model"], text_datasets()[cfg["dataset"]], seed=cfg["seed"])
    train, test = load_data(cfg, tokenizer)
    if cfg["train_fraction"] < 1:  # a seeded random subset, before the method's held-out splits and the partition
        g = torch.Generator().manual_seed(cfg["seed"] + 15485863)
        keep = torch.randperm(len(train), generator=g)[:max(1, round(cfg["train_fraction"] * len(train)))]
        train = train.subset(keep.sort().values)
    validation = None
    if cfg["val_fraction"] > 0:  # model selection's split: seeded, before the method's splits and the partition
        g = torch.Generator().manual_seed(cfg["seed"] + 32452843)
        perm = torch.randperm(len(train), generator=g)
        n_val = max(1, round(cfg["val_fraction"] * len(train)))
        if n_val >= len(train):
            raise ValueError(f"val_fraction: {cfg['val_fraction']:g} of {len(train)} training samples leaves none "
                             f"to train on")
        validation = train.subset(perm[:n_val].sort().values)
        train = train.subset(perm[n_val:].sort().values)
    sc = cfg.sim_config()
    method = sc.take_method()  # built once per run: its held-out splits, then the Simulation's method
    train, splits = method.hold_out(train, cfg["seed"])  # the method's server-held splits leave the clients
    part = partition(cfg, train)
    model = model if model is not None else make_model(cfg, train)
    return Simulation(sc, model, train, test, part, device=device or cfg["device"], process_group=group,
                      validation=validation, method=method, **splits)
