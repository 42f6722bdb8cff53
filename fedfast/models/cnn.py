"""The papers' CNNs (layer lists from the papers and their code; docs/methods.md). All are plain ``nn.Module``s without
running statistics, so ``torch.func.functional_call`` + ``vmap`` over stacked client parameters works."""

from __future__ import annotations

from torch import nn


class FedAvgCNN(nn.Sequential):
    """McMahan et al.'s CNN as in FedNTD's ``fedavgnet.py``: conv5(32)-pool-conv5(64)-pool-FC512-FC(C).
    MNIST (1x28x28): 1,663,370 parameters; CIFAR (3x32x32), C=10: 2,156,490; C=100: 2,202,660."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 32):
        s = image_size // 4
        super().__init__(
            nn.Conv2d(in_channels, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * s * s, 512),
            nn.ReLU(),
            nn.Linear(512, num_classes),
        )


class ASDCifarCNN(nn.Sequential):
    """ASD / FedDyn CIFAR CNN (Acar et al.): conv5(64)-pool-conv5(64)-pool-FC384-FC192-FC(C), no padding.
    797,962 parameters for C=10, 815,332 for C=100."""

    def __init__(self, num_classes: int = 10):
        super().__init__(
            nn.Conv2d(3, 64, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(1600, 384),
            nn.ReLU(),
            nn.Linear(384, 192),
            nn.ReLU(),
            nn.Linear(192, num_classes),
        )


class ASDTinyImageNetCNN(nn.Sequential):
    """ASD's Tiny-ImageNet ConvNet (width 64, depth 3, GroupNorm(4, 64)): 3 x [conv3-GN-ReLU-pool] then
    FC512-FC384-FC200 (about 2.45M parameters)."""

    def __init__(self, num_classes: int = 200, in_channels: int = 3):
        layers = []
        c = in_channels
        for _ in range(3):
            layers += [nn.Conv2d(c, 64, 3, padding=1), nn.GroupNorm(4, 64), nn.ReLU(), nn.MaxPool2d(2)]
            c = 64
        super().__init__(
            *layers,
            nn.Flatten(),
            nn.Linear(4096, 512),
            nn.ReLU(),
            nn.Linear(512, 384),
            nn.ReLU(),
            nn.Linear(384, num_classes),
        )


class FedADCCNN(nn.Sequential):
    """FedADC's CIFAR-10 CNN, "4 conv + 4 FC, no BN, max-pooling"; the layer sizes are the spec's reading
    [R] (not given in the paper): conv3-32, conv3-32, pool, conv3-64, conv3-64, pool, FC 4096-512-256-128-C."""

    def __init__(self, num_classes: int = 10):
        super().__init__(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(4096, 512),
            nn.ReLU(),
            nn.Linear(512, 256),
            nn.ReLU(),
            nn.Linear(256, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )


class LeNet5(nn.Sequential):
    """FedCAD's CIFAR-10 "FedAvg CNN" (LeNet-5 style): 62,006 parameters."""

    def __init__(self, num_classes: int = 10):
        super().__init__(
            nn.Conv2d(3, 6, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(400, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )


class SimpleCNN(nn.Sequential):
    """pfl-research's benchmark ``simple_cnn``: conv3(32)-conv3(64)-pool-dropout-FC128-FC(C) on
    ``in_channels`` x ``image_size``^2 (3x32x32: 1,626,442 parameters for C=10; 1x28x28: 1,199,882).
    ``dropout`` defaults to pfl's 0.25 (set 0 for deterministic tests)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, dropout: float = 0.25, image_size: int = 32):
        side = (image_size - 4) // 2
        super().__init__(
            nn.Conv2d(in_channels, 32, 3),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(dropout),
            nn.Flatten(),
            nn.Linear(64 * side * side, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )


class FedGenCNN(nn.Sequential):
    """FedGen's MNIST network (zhuangdizhu/FedGen ``trainmodel/models.py``, ``Net('mnist')`` with
    ``CONFIGS_['mnist'] = ([6, 16, 'F'], 1, 10, 784, 32)``): conv3 stride 2 (6) - BN - ReLU - conv3 stride 2 (16) -
    BN - ReLU - flatten (784) - Linear(784, 32) - Linear(32, C), with no activation between the two Linear layers,
    as in the code. The code's BatchNorm keeps running statistics that its server never averages; here BatchNorm
    uses batch statistics in training and evaluation (``track_running_stats=False``), fedfast's reading for
    BatchNorm in federated models. 26,434 parameters for C = 10; the classifier's input (FedGen's latent) is 32."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1):
        super().__init__(
            nn.Conv2d(in_channels, 6, 3, 2, 1),
            nn.BatchNorm2d(6, track_running_stats=False),
            nn.ReLU(),
            nn.Conv2d(6, 16, 3, 2, 1),
            nn.BatchNorm2d(16, track_running_stats=False),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(784, 32),
            nn.Linear(32, num_classes),
        )
