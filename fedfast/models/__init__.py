"""The papers' models, each usable under ``torch.func.functional_call`` / ``vmap`` (no running statistics)."""
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

__all__ = ["ASDCifarCNN", "ASDTinyImageNetCNN", "FedADCCNN", "FedAvgCNN", "FedGenCNN", "LeNet5", "SimpleCNN", "MLP", "CifarResNet8",
           "ResNet", "ResNet50", "resnet10", "resnet18", "resnet50", "MODELS", "ProjectionClassifier",
           "with_projection_head"]
