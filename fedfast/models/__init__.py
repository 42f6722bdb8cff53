"""The papers' models, each usable under ``torch.func.functional_call`` / ``vmap`` (no running statistics).

``MODELS[name](num_classes)`` builds a model by name; ``REGISTRY[name](num_classes, input_shape)`` is what a run
configuration's ``model = name`` builds, sized to the dataset's samples (``register_model`` adds one; config
validation and ``fedfast run`` read the registry). ``model = "hf:..."`` (Hugging Face) is separate
(:mod:`fedfast.models.hf`).
"""
import math
from typing import Callable

from .head import ProjectionClassifier, with_projection_head
from .cnn import ASDCifarCNN, ASDTinyImageNetCNN, FedADCCNN, FedAvgCNN, FedGenCNN, LeNet5, SimpleCNN
from .mlp import MLP
from .resnet import CifarResNet8, ResNet, ResNet50, resnet10, resnet18, resnet50

MODELS = {
    "fedavg_cnn_mnist": lambda C=10: FedAvgCNN(1, C, 28), "fedavg_cnn_cifar": lambda C=10: FedAvgCNN(3, C, 32),
    "asd_cnn_cifar": ASDCifarCNN, "asd_cnn_tiny": ASDTinyImageNetCNN, "fedadc_cnn": FedADCCNN, "lenet5": LeNet5,
    "simple_cnn": SimpleCNN, "resnet8_gn": CifarResNet8, "resnet10_bn": lambda C=10: resnet10(C, "bn"),
    "resnet18_bn": lambda C=10: resnet18(C, "bn"), "resnet18_gn": lambda C=10: resnet18(C, "gn"),
    "resnet50_bn": lambda C=10: resnet50(C, "bn"), "resnet50_gn": lambda C=10: resnet50(C, "gn"),
    "mlp": lambda C=10: MLP(num_classes=C), "fedgen_cnn_mnist": lambda C=10: FedGenCNN(C),
}

REGISTRY: dict[str, Callable] = {}


def register_model(name: str, build: Callable) -> None:
    """Make ``model = name`` build ``build(num_classes, input_shape)`` (``input_shape``: one sample's shape)."""
    if not (isinstance(name, str) and name) or name.startswith("hf:") or not callable(build):
        raise ValueError(f"register_model: a non-empty name (not 'hf:...') and a callable, got {name!r}, {build!r}")
    REGISTRY[name] = build


for _name, _make in MODELS.items():
    register_model(_name, lambda C, shape, make=_make: make(C))
register_model("mlp", lambda C, shape: MLP(math.prod(shape), (200, 200), C))
# pfl-research's benchmark CNN, sized to the dataset's images (1x28x28: 1,199,882 parameters)
register_model("simple_cnn", lambda C, shape: SimpleCNN(C, in_channels=shape[0], image_size=shape[1]))
# the CIFAR stem (3x3/1, no pool), as many input channels as the images
register_model("resnet50_bn", lambda C, shape: resnet50(C, "bn", in_channels=shape[0]))
register_model("resnet50_gn", lambda C, shape: resnet50(C, "gn", in_channels=shape[0]))

__all__ = ["REGISTRY", "register_model", "ASDCifarCNN", "ASDTinyImageNetCNN", "FedADCCNN", "FedAvgCNN", "FedGenCNN", "LeNet5", "SimpleCNN", "MLP", "CifarResNet8",
           "ResNet", "ResNet50", "resnet10", "resnet18", "resnet50", "MODELS", "ProjectionClassifier",
           "with_projection_head"]
