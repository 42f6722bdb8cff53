"""ResNets of the papers: ResNet-8 with GroupNorm (FedGKD, CIFAR), ResNet-10/18 with BatchNorm without
running statistics (FedNTD, ``track_running_stats=False``: batch statistics in train and eval, so no buffers)
or with GroupNorm (FedADC's ResNet-18-GN), and the bottleneck ResNet-50 (FedCAD on CIFAR-100 and FEMNIST,
FedGKD on Tiny-ImageNet)."""

from __future__ import annotations

import math

from torch import nn

from ..ops.conv_cpu import PointwiseConv2d


def _norm(kind: str, c: int, gn_channels_per_group: int = 16, gn_groups: int | None = None) -> nn.Module:
    if kind == "bn":
        return nn.BatchNorm2d(c, track_running_stats=False)
    if kind == "gn":
        return nn.GroupNorm(gn_groups if gn_groups else max(1, c // gn_channels_per_group), c)
    raise ValueError(f"norm: 'bn' or 'gn', got {kind!r}")


def _shortcut(cin: int, cout: int, stride: int, norm) -> nn.Module:
    """Identity, or a 1x1 projection (stride, no bias) + norm where the block changes the shape (the projection
    subsampled on the CPU: :class:`fedfast.ops.conv_cpu.PointwiseConv2d`, round a oneDNN bug)."""
    if stride != 1 or cin != cout:
        return nn.Sequential(PointwiseConv2d(cin, cout, 1, stride, bias=False), norm(cout))
    return nn.Sequential()


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.n1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.n2 = norm(cout)
        self.relu = nn.ReLU()
        self.short = _shortcut(cin, cout, stride, norm)

    def forward(self, x):
        out = self.relu(self.n1(self.conv1(x)))
        out = self.n2(self.conv2(out))
        return self.relu(out + self.short(x))


class CifarResNet8(nn.Module):
    """FedGKD's ResNet-8 (FedDF ``CifarResNet``, one BasicBlock per stage, widths 16/32/64), GroupNorm with 16
    channels per group, conv init N(0, sqrt(2/(k*k*out))). 78,042 parameters for C=10, 83,892 for C=100."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        norm = lambda c: _norm("gn", c, 16)  # noqa: E731
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), norm(16), nn.ReLU())
        self.layers = nn.Sequential(
            BasicBlock(16, 16, 1, norm), BasicBlock(16, 32, 2, norm), BasicBlock(32, 64, 2, norm)
        )
        self.pool = nn.AvgPool2d(8)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                n = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / n))

    def forward(self, x):
        return self.fc(self.pool(self.layers(self.stem(x))).flatten(1))


class ResNet(nn.Module):
    """CIFAR-style ResNet-10 ([1,1,1,1]) / ResNet-18 ([2,2,2,2]): conv3x3(64) stem + norm, stages 64/128/256/512
    with strides 1/2/2/2, global average pool, Linear(512, C). ``norm='bn'`` (no running stats, FedNTD's
    ResNet-10) or ``'gn'`` (GroupNorm with ``gn_groups`` groups; FedADC: 32)."""

    def __init__(
        self, blocks=(2, 2, 2, 2), num_classes: int = 10, norm: str = "bn", gn_groups: int = 32, in_channels: int = 3
    ):
        super().__init__()
        nf = lambda c: _norm(norm, c, gn_groups=gn_groups)  # noqa: E731
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False), nf(64), nn.ReLU())
        layers, cin = [], 64
        for i, (cout, n) in enumerate(zip((64, 128, 256, 512), blocks, strict=True)):
            for j in range(n):
                layers.append(BasicBlock(cin, cout, (1 if i == 0 else 2) if j == 0 else 1, nf))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def resnet10(num_classes: int = 10, norm: str = "bn", **kw) -> ResNet:
    return ResNet((1, 1, 1, 1), num_classes, norm, **kw)


def resnet18(num_classes: int = 10, norm: str = "bn", **kw) -> ResNet:
    return ResNet((2, 2, 2, 2), num_classes, norm, **kw)


class Bottleneck(nn.Module):
    """torchvision's ResNet-50 bottleneck (v1.5: the stride on the 3x3 conv): 1x1 (width) - 3x3 (width, stride) -
    1x1 (4 width), each followed by the norm, a projection shortcut where the shape changes."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int, norm):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.n1 = norm(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.n2 = norm(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.n3 = norm(cout)
        self.relu = nn.ReLU()
        self.short = _shortcut(cin, cout, stride, norm)

    def forward(self, x):
        out = self.relu(self.n1(self.conv1(x)))
        out = self.relu(self.n2(self.conv2(out)))
        out = self.n3(self.conv3(out))
        return self.relu(out + self.short(x))


class ResNet50(nn.Module):
    """ResNet-50 (He et al. 2016; torchvision's layout: bottleneck stages of 3/4/6/3 blocks, widths 64/128/256/512,
    strides 1/2/2/2, global average pool, Linear(2048, C), Kaiming-normal (fan-out) conv init).

    ``norm``: ``"bn"`` (BatchNorm with batch statistics, ``track_running_stats=False``: no buffers) or ``"gn"``
    (GroupNorm, ``gn_groups`` groups). ``stem``: ``"imagenet"`` (7x7/2 conv + 3x3/2 max-pool, torchvision's) or
    ``"cifar"`` (3x3/1 conv, no pool: the papers' 32x32 and 28x28 inputs; FedGKD's code, and the guess for
    FedCAD, whose stem is unspecified). Parameters for C = 1000 with the ImageNet stem: 25,557,032, torchvision's
    ``resnet50()``; C = 10: 23,528,522; the CIFAR stem has 7,680 fewer; GroupNorm has as many as BatchNorm."""

    def __init__(
        self, num_classes: int = 10, norm: str = "bn", stem: str = "cifar", in_channels: int = 3, gn_groups: int = 32
    ):
        super().__init__()
        if stem not in ("cifar", "imagenet"):
            raise ValueError(f"stem: 'cifar' or 'imagenet', got {stem!r}")
        nf = lambda c: _norm(norm, c, gn_groups=gn_groups)  # noqa: E731
        if stem == "imagenet":
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False), nf(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
            )
        else:
            self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False), nf(64), nn.ReLU())
        layers, cin = [], 64
        for i, (width, n) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True)):
            for j in range(n):
                layers.append(Bottleneck(cin, width, (1 if i == 0 else 2) if j == 0 else 1, nf))
                cin = width * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def resnet50(num_classes: int = 10, norm: str = "bn", **kw) -> ResNet50:
    return ResNet50(num_classes, norm, **kw)
