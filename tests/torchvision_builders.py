"""torchvision 0.28's own model builders, one small build per classification family, for the tests of the batched
program. ``import torchvision`` fails on the CPU build of torch (its ``_meta_registrations`` registers fake kernels
for its C++ detection ops, which that build does not have); the model builders need none of them, so a stub of that
one module is installed before the import. ``make test`` installs torchvision (``--no-deps``, pinned) apart from the
venv's site-packages, in ``.venv/torchvision-0.28``: on the path of these tests only, so that transformers, which
imports torchvision when it finds it, is not handed one that fails to import."""

import os
import sys
import types

import torch
from torch import nn

_HOME = os.path.join(sys.prefix, "torchvision-0.28")
if os.path.isdir(_HOME) and _HOME not in sys.path:
    sys.path.append(_HOME)
sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))

import torchvision  # noqa: E402
from torchvision import models as M  # noqa: E402
from torchvision.models.convnext import CNBlockConfig  # noqa: E402
from torchvision.models.efficientnet import FusedMBConvConfig, MBConvConfig  # noqa: E402
from torchvision.models.mobilenetv3 import _mobilenet_v3_conf  # noqa: E402
from torchvision.models.resnet import BasicBlock, Bottleneck  # noqa: E402

VERSION = torchvision.__version__


def _small_head(m: nn.Module, features: int) -> nn.Module:
    """AlexNet's and VGG's classifier (4096-wide Linears, 100M weights) made small; their forward code is kept."""
    m.classifier = nn.Sequential(nn.Linear(features, 16), nn.ReLU(inplace=True), nn.Dropout(0.0), nn.Linear(16, 5))
    return m


def _mbconv(width: float):
    return [
        MBConvConfig(1, 3, 1, 32, 16, 1, width, 1.0),
        MBConvConfig(6, 3, 2, 16, 24, 2, width, 1.0),
    ]


# family -> (builder of a small model with 5 classes, input side). Dropout and stochastic depth at 0 (the loop and the
# program draw differently); every block kind of the family present.
FAMILIES = {
    "alexnet": (lambda: _small_head(M.alexnet(num_classes=5, dropout=0.0), 256 * 6 * 6), 64),
    "convnext": (
        lambda: M.ConvNeXt(
            [CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)], stochastic_depth_prob=0.0, num_classes=5
        ),
        32,
    ),
    "densenet": (
        lambda: M.DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=2, num_classes=5),
        32,
    ),
    "efficientnet": (
        lambda: M.EfficientNet(_mbconv(0.25), dropout=0.0, stochastic_depth_prob=0.0, num_classes=5, last_channel=32),
        32,
    ),
    "efficientnet_v2": (
        lambda: M.EfficientNet(
            [
                FusedMBConvConfig(1, 3, 1, 8, 8, 1),
                FusedMBConvConfig(4, 3, 2, 8, 16, 1),
                MBConvConfig(4, 3, 2, 16, 24, 1, 1.0, 1.0),
            ],
            dropout=0.0,
            stochastic_depth_prob=0.0,
            num_classes=5,
            last_channel=32,
        ),
        32,
    ),
    "googlenet": (lambda: M.googlenet(num_classes=5, aux_logits=False, init_weights=True, dropout=0.0), 32),
    "inception_v3": (lambda: M.inception_v3(num_classes=5, aux_logits=False, init_weights=True, dropout=0.0), 75),
    "maxvit": (
        lambda: M.MaxVit((32, 32), 8, 2, [8, 16], [1, 1], head_dim=4, stochastic_depth_prob=0.0, num_classes=5),
        32,
    ),
    "mnasnet": (lambda: M.MNASNet(0.25, num_classes=5, dropout=0.0), 32),
    "mobilenet_v2": (lambda: M.mobilenet_v2(num_classes=5, width_mult=0.25, dropout=0.0), 32),
    "mobilenet_v3": (
        lambda: M.MobileNetV3(*_mobilenet_v3_conf("mobilenet_v3_small", width_mult=0.25), num_classes=5, dropout=0.0),
        32,
    ),
    "regnet_x": (lambda: M.regnet_x_400mf(num_classes=5), 32),
    "regnet_y": (lambda: M.regnet_y_400mf(num_classes=5), 32),
    "resnet": (lambda: M.ResNet(BasicBlock, [1, 1, 1, 1], num_classes=5), 32),
    "resnext": (lambda: M.ResNet(Bottleneck, [1, 1, 1, 1], num_classes=5, groups=8, width_per_group=4), 32),
    "shufflenet_v2": (lambda: M.ShuffleNetV2([1, 1, 1], [8, 16, 32, 64, 64], num_classes=5), 32),
    "squeezenet": (lambda: M.squeezenet1_1(num_classes=5, dropout=0.0), 32),
    "swin": (
        lambda: M.SwinTransformer([4, 4], 8, [2, 2], [2, 2], [4, 4], stochastic_depth_prob=0.0, num_classes=5),
        32,
    ),
    "swin_v2": (lambda: _swin_v2(), 32),
    "vgg": (lambda: _small_head(M.vgg11_bn(num_classes=5, dropout=0.0), 512 * 7 * 7), 32),
    "vit": (
        lambda: M.VisionTransformer(
            image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=5
        ),
        32,
    ),
}


def _swin_v2():
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformerBlockV2

    return M.SwinTransformer(
        [4, 4],
        8,
        [2, 2],
        [2, 2],
        [4, 4],
        stochastic_depth_prob=0.0,
        num_classes=5,
        block=SwinTransformerBlockV2,
        downsample_layer=PatchMergingV2,
    )


def build(family: str, seed: int = 0) -> tuple[nn.Module, int]:
    """``(model, input side)`` of the family's small build."""
    make, side = FAMILIES[family]
    torch.manual_seed(seed)
    return make(), side
