"""The papers' models, each usable under ``torch.func.functional_call`` / ``vmap`` (no running statistics), and the
registry a run configuration's ``model = name`` reads.

``REGISTRY[name]`` is a :class:`ModelEntry`: ``build(num_classes, input_shape)`` (``input_shape``: one sample's
shape, e.g. ``(1, 28, 28)`` or ``(12,)`` for feature rows; None: the model's own default) sized to the dataset's
samples. :func:`build` makes one by name; :func:`register_model` adds one (a taken name is refused unless
``replace=True``; :class:`fedfast._registry.Registry`, shared with methods, datasets and partitions). A model may
have options of its own (an ``options`` dataclass, the run config's ``[name]`` table: ``build(C, shape, opts)``).
``model = "hf:..."`` (Hugging Face) is separate (:mod:`fedfast.models.hf`).
"""

import inspect
import math
from dataclasses import dataclass
from typing import Callable

from torch import nn

from .._registry import Registry, check_entry
from .cnn import ASDCifarCNN, ASDTinyImageNetCNN, FedADCCNN, FedAvgCNN, FedGenCNN, LeNet5, SimpleCNN
from .head import ProjectionClassifier, with_projection_head
from .mlp import MLP
from .resnet import CifarResNet8, ResNet, ResNet50, resnet10, resnet18, resnet50


@dataclass(frozen=True)
class ModelEntry:
    """``build(num_classes, input_shape)`` (with ``options``: ``build(num_classes, input_shape, options)``)."""

    build: Callable
    options: type | None = None


REGISTRY = Registry("model", "model")


def register_model(name: str, build: Callable, *, options: type | None = None, replace: bool = False) -> None:
    """Make ``model = name`` build ``build(num_classes, input_shape)`` (``input_shape``: one sample's shape, or
    None for the model's default); with ``options`` (a dataclass, the run config's ``[name]`` table)
    ``build(num_classes, input_shape, options)``. A taken name is refused unless ``replace=True``."""
    if isinstance(name, str) and name.startswith("hf:"):
        raise ValueError(f"register_model: 'hf:...' names Hugging Face models, got {name!r}")
    if isinstance(build, nn.Module):
        raise TypeError(
            f"register_model({name!r}): build must be a function that makes the model, build(num_classes, "
            f"input_shape), got an nn.Module instance ({type(build).__name__}); a run builds its own model (sized to "
            f"the dataset, one per run of a sweep): pass its class or a function returning a new one"
        )
    check_entry("register_model", name, build, options)
    _check_signature(name, build, options)
    REGISTRY.add(name, ModelEntry(build, options), replace=replace, call="register_model")


def _check_signature(name: str, build: Callable, options) -> None:
    """A builder that cannot be called as the run calls it is refused when registered, naming it, its file and line
    and the call it must take (a callable whose signature Python cannot read is taken as it is)."""
    want = ("num_classes", "input_shape") + (("options",) if options is not None else ())
    try:
        sig = inspect.signature(build)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*want)
    except TypeError as e:
        fn = build if hasattr(build, "__code__") else getattr(type(build), "__call__", build)  # noqa: B004 - the method (its file, line)
        code = getattr(inspect.unwrap(fn), "__code__", None)
        where = f"{code.co_filename}, line {code.co_firstlineno}" if code is not None else repr(build)
        raise TypeError(
            f"register_model({name!r}): the builder {getattr(build, '__qualname__', type(build).__name__)} ({where}) "
            f"must take build({', '.join(want)})"
            + ("" if options is not None else " (with options=SomeDataclass: build(num_classes, input_shape, options))")
            + f"; its signature is {sig}: {e}"
        ) from None


def build(name: str, num_classes: int = 10, input_shape: tuple | None = None, options=None):
    """The registered model ``name`` for ``num_classes`` classes and samples of ``input_shape`` (None: its
    default, e.g. 1x28x28 for the MNIST models, 3x32x32 for the CIFAR ones)."""
    if name not in REGISTRY:
        raise ValueError(f"model: {name!r} is not a registered model (registered: {', '.join(sorted(REGISTRY))})")
    e = REGISTRY[name]
    shape = tuple(input_shape) if input_shape is not None else None
    return e.build(num_classes, shape, options) if e.options is not None else e.build(num_classes, shape)


def _c(shape, default: int) -> int:
    return shape[0] if shape else default


register_model("fedavg_cnn_mnist", lambda C, shape: FedAvgCNN(1, C, 28))
register_model("fedavg_cnn_cifar", lambda C, shape: FedAvgCNN(3, C, 32))
register_model("asd_cnn_cifar", lambda C, shape: ASDCifarCNN(C))
register_model("asd_cnn_tiny", lambda C, shape: ASDTinyImageNetCNN(C))
register_model("fedadc_cnn", lambda C, shape: FedADCCNN(C))
register_model("lenet5", lambda C, shape: LeNet5(C))
register_model("resnet8_gn", lambda C, shape: CifarResNet8(C))
register_model("resnet10_bn", lambda C, shape: resnet10(C, "bn"))
register_model("resnet18_bn", lambda C, shape: resnet18(C, "bn"))
register_model("resnet18_gn", lambda C, shape: resnet18(C, "gn"))
register_model("fedgen_cnn_mnist", lambda C, shape: FedGenCNN(C))


@dataclass
class MLPOptions:
    """The MLP's ``[mlp]`` table: ``layers`` hidden layers of ``hidden`` units (default FedAvg's 784-200-200-10;
    ``layers = 0``: multinomial logistic regression)."""

    hidden: int = 200
    layers: int = 2

    def __post_init__(self):
        if self.hidden < 1 or self.layers < 0:
            raise ValueError(f"mlp.hidden >= 1 and mlp.layers >= 0, got {self.hidden} and {self.layers}")


# sized to the dataset's samples: the MLP to any sample shape (images or feature rows; default 1x28x28)
def _mlp(C, shape, o=None):
    o = o if o is not None else MLPOptions()
    return MLP(math.prod(shape) if shape else 784, (o.hidden,) * o.layers, C)


register_model("mlp", _mlp, options=MLPOptions)
# pfl-research's benchmark CNN, sized to the dataset's images (1x28x28: 1,199,882 parameters)
register_model(
    "simple_cnn", lambda C, shape: SimpleCNN(C, in_channels=shape[0], image_size=shape[1]) if shape else SimpleCNN(C)
)
# the CIFAR stem (3x3/1, no pool), as many input channels as the images
register_model("resnet50_bn", lambda C, shape: resnet50(C, "bn", in_channels=_c(shape, 3)))
register_model("resnet50_gn", lambda C, shape: resnet50(C, "gn", in_channels=_c(shape, 3)))
REGISTRY.seal()

__all__ = [
    "REGISTRY",
    "ModelEntry",
    "register_model",
    "build",
    "ASDCifarCNN",
    "ASDTinyImageNetCNN",
    "FedADCCNN",
    "FedAvgCNN",
    "FedGenCNN",
    "LeNet5",
    "SimpleCNN",
    "MLP",
    "CifarResNet8",
    "ResNet",
    "ResNet50",
    "resnet10",
    "resnet18",
    "resnet50",
    "ProjectionClassifier",
    "with_projection_head",
]
