"""A run built from its configuration: the dataset, the method's held-out splits, the partition and the model, each
chosen by name from a registry (:data:`fedfast.data.DATASETS`, :data:`fedfast.data.PARTITIONS`,
:data:`fedfast.models.REGISTRY`; a plug-in adds its own with ``register_dataset`` / ``register_partition`` /
``register_model``), assembled into a :class:`fedfast.Simulation`. The library's entry point below the command
line: ``fedfast run``, ``fedfast sweep`` and :mod:`fedfast.jobs` call :func:`build`.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

from ._io import record_reads
from .config import split_seed
from .data import DATASETS, PARTITIONS, Partition, text_datasets
from .engine import Simulation
from .methods import user_code
from .models import build as build_model, hf

_BUILT_CODE: set = set()  # modules of the user's own that a run's build imported in this process


def load_data(cfg, tokenizer=None):
    """The dataset's train and test sets; a missing file names ``data_dir`` and where to get the data."""
    spec = {
        "data_dir": cfg["data_dir"],
        "tokenizer": tokenizer,
        "max_length": cfg["max_length"],
        "seed": cfg["seed"],
        "options": _options(cfg, "dataset"),
    }
    try:
        return DATASETS[cfg["dataset"]].load(spec)
    except FileNotFoundError as e:
        msg = e.args[1] if len(e.args) > 1 and e.filename else str(e)
        if e.filename and os.path.commonpath(
            [os.path.abspath(str(e.filename)), os.path.abspath(cfg["data_dir"])]
        ) != os.path.abspath(cfg["data_dir"]):
            raise ValueError(f"dataset: {cfg['dataset']!r} needs {e.filename}: {msg}") from None
        raise ValueError(
            f"data_dir: dataset {cfg['dataset']!r} needs files under data_dir = {cfg['data_dir']!r} "
            f"(--set data_dir=PATH): {msg}"
        ) from None


def _options(cfg, kind: str):
    return cfg.entry_options(kind) if hasattr(cfg, "entry_options") else None


def partition(cfg, train):
    """The training set split by the registered partition ``cfg["partition"]``: into ``num_clients`` clients, or
    as many as the partition makes when it declares ``sets_num_clients`` (a client per user, say)."""
    entry = PARTITIONS[cfg["partition"]]
    vals = cfg.values if hasattr(cfg, "values") else dict(cfg)
    # "seed" is the split's seed (split_seed: the run seed unless given), for a plug-in partition too
    spec = {**vals, "seed": split_seed(vals), "options": _options(cfg, "partition")}
    part = entry.split(train, spec)
    if not isinstance(part, Partition):
        raise TypeError(f"partition: {cfg['partition']!r} returned {type(part).__name__}, not a fedfast.data.Partition")
    if entry.sets_num_clients and part.num_clients != cfg["num_clients"] and "num_clients" in getattr(cfg, "given", ()):
        raise ValueError(
            f"num_clients: {cfg['num_clients']}, but partition {cfg['partition']!r} decides the number of "
            f"clients itself and made {part.num_clients}; leave num_clients out"
        )
    if not entry.sets_num_clients and part.num_clients != cfg["num_clients"]:
        raise ValueError(
            f"partition: {cfg['partition']!r} made {part.num_clients} clients, num_clients is "
            f"{cfg['num_clients']}; a partition that decides the number of clients itself is registered "
            f"with sets_num_clients=True"
        )
    return part


def make_model(cfg, train):
    """The registered model ``cfg["model"]`` for the dataset's classes and sample shape."""
    return build_model(cfg["model"], train.num_classes, tuple(train.x.shape[1:]), _options(cfg, "model"))


def build(cfg, device=None, group=None, state_dir: str | None = None):
    """The Simulation a run config describes (:func:`build_run` without the resolved config)."""
    return build_run(cfg, device, group, state_dir)[1]


def build_run(cfg, device=None, group=None, state_dir: str | None = None):
    """``(resolved config, Simulation)`` of a run config (data, the method's held-out splits, partition, model).
    The resolved config is a new one (``cfg`` is left as it is) holding what the build found out: the number of
    clients a partition that decides it made, the files the data and a pretrained model were read from
    (``data_files``) and the modules of your own the builds of this process imported (``code_files``): the run's
    fingerprint. ``state_dir``: the run directory, where a per-client state store kept on disk has its file."""
    modules = set(sys.modules)  # a plug-in may import its helpers only when its loader or model runs
    torch.manual_seed(cfg["seed"])
    model = tokenizer = None
    with record_reads() as files:
        if cfg["model"].startswith("hf:"):  # the pretrained encoder, a new head, and the tokenizer the texts need
            model, tokenizer = hf.load(cfg["model"], text_datasets()[cfg["dataset"]], seed=cfg["seed"])
        train, test = load_data(cfg, tokenizer)
    if cfg["train_fraction"] < 1:  # a seeded random subset, before the method's held-out splits and the partition
        g = torch.Generator().manual_seed(cfg["seed"] + 15485863)
        keep = torch.randperm(len(train), generator=g)[: max(1, round(cfg["train_fraction"] * len(train)))]
        train = train.subset(keep.sort().values)
    validation = None
    if cfg["val_fraction"] > 0:  # model selection's split: seeded, before the method's splits and the partition
        g = torch.Generator().manual_seed(cfg["seed"] + 32452843)
        perm = torch.randperm(len(train), generator=g)
        n_val = max(1, round(cfg["val_fraction"] * len(train)))
        if n_val >= len(train):
            raise ValueError(
                f"val_fraction: {cfg['val_fraction']:g} of {len(train)} training samples leaves none to train on"
            )
        validation = train.subset(perm[:n_val].sort().values)
        train = train.subset(perm[n_val:].sort().values)
    sc = cfg.sim_config()
    method = sc.method()  # the run's one instance: its held-out splits, then the Simulation's method
    authors = (cfg.values if hasattr(cfg, "values") else cfg).get("split_stream") == "authors"
    if authors and (cfg["train_fraction"] < 1 or cfg["val_fraction"] > 0):
        raise ValueError(
            "split_stream: the authors' splits are drawn over the whole training set as their code "
            "loads it, but train_fraction or val_fraction took samples out first; use "
            'split_stream = "fedfast"'
        )
    part = partition(cfg, train) if authors else None  # the authors' code splits the set as loaded
    if part is not None and getattr(part, "sample_order", None) is not None:
        # the authors' code shuffled the set before its validation split (FedGKD on Tiny-ImageNet): the set in that
        # order, so that a method's held-out tail is the code's validation set; the clients' indices follow
        order = torch.from_numpy(part.sample_order)
        where = torch.empty_like(order)
        where[order] = torch.arange(len(order))
        train = train.subset(order)
        part = Partition.from_csr(where[part.rows], part.offsets, part.num_classes, train.y, part.method)
    loaded = train
    train, splits = method.hold_out(train, cfg["seed"])  # the method's server-held splits leave the clients
    if (
        authors
        and len(train) != len(loaded)
        and not (train.x.data_ptr() == loaded.x.data_ptr() and int(part.rows.max()) < len(train))
    ):
        raise ValueError(
            f"split_stream: the method's held-out split ({cfg['algorithm']}) takes samples that the "
            f'authors\' split gives to clients; use split_stream = "fedfast"'
        )
    part = part if authors else partition(cfg, train)
    if part.num_clients != cfg["num_clients"] and cfg["clients_per_round"] > part.num_clients:
        raise ValueError(
            f"clients_per_round: {cfg['clients_per_round']} > the {part.num_clients} clients "
            f"partition {cfg['partition']!r} made"
        )
    model = model if model is not None else make_model(cfg, train)
    # every build of this process: a module imported by an earlier one is not imported again
    _BUILT_CODE.update(user_code([sys.modules[n] for n in set(sys.modules) - modules if n in sys.modules]))
    resolved = dataclasses.replace(
        cfg.replace(num_clients=part.num_clients),
        data_files=tuple(sorted(files)),
        code_files=tuple(sorted(_BUILT_CODE)),
    )
    resolved._keep_sim(sc)  # the same engine settings: the SimConfig (and its validation) is not made again
    return resolved, Simulation(
        sc,
        model,
        train,
        test,
        part,
        device=device or cfg["device"],
        process_group=group,
        validation=validation,
        method=method,
        state_dir=state_dir,
        **splits,
    )
