"""torchvision's classification models as its code builds them (torchvision.models: resnet, vgg, mobilenetv2,
mobilenetv3, efficientnet; torchvision.ops: Conv2dNormActivation, SqueezeExcitation, StochasticDepth), written out
here because ``import torchvision`` fails on the CPU build of torch: the same module tree, attribute names, layer
options (in-place activations, BatchNorm eps / momentum, padding) and forward code, with a width multiplier and a
depth cap so that tests can run them small. The executor tests run them against the literal loop; the benchmark
``benchmarks/zoo_executors.py`` times them at full width."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import Tensor, nn


def _make_divisible(v: float, divisor: int, min_value: int | None = None) -> int:
    min_value = min_value or divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class Conv2dNormActivation(nn.Sequential):
    """torchvision.ops.Conv2dNormActivation: conv (padding (k-1)//2 * dilation, bias only without a norm), norm,
    activation (in place)."""

    def __init__(
        self,
        cin,
        cout,
        kernel_size=3,
        stride=1,
        groups=1,
        norm_layer=nn.BatchNorm2d,
        activation_layer=nn.ReLU,
        dilation=1,
        inplace=True,
    ):
        padding = (kernel_size - 1) // 2 * dilation
        layers = [
            nn.Conv2d(
                cin, cout, kernel_size, stride, padding, dilation=dilation, groups=groups, bias=norm_layer is None
            )
        ]
        if norm_layer is not None:
            layers.append(norm_layer(cout))
        if activation_layer is not None:
            layers.append(activation_layer(inplace=inplace))
        super().__init__(*layers)
        self.out_channels = cout


class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation: scale = scale_activation(fc2(activation(fc1(avgpool(x))))); scale * x."""

    def __init__(self, cin, squeeze, activation=nn.ReLU, scale_activation=nn.Sigmoid):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(cin, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, cin, 1)
        self.activation = activation()
        self.scale_activation = scale_activation()

    def _scale(self, x: Tensor) -> Tensor:
        scale = self.avgpool(x)
        scale = self.fc1(scale)
        scale = self.activation(scale)
        scale = self.fc2(scale)
        return self.scale_activation(scale)

    def forward(self, x: Tensor) -> Tensor:
        scale = self._scale(x)
        return scale * x


def stochastic_depth(x: Tensor, p: float, mode: str, training: bool = True) -> Tensor:
    """torchvision.ops.stochastic_depth: each sample ("row") or the whole batch ("batch") kept with probability
    1 - p and scaled by 1 / (1 - p)."""
    if not training or p == 0.0:
        return x
    survival = 1.0 - p
    size = [x.shape[0]] + [1] * (x.ndim - 1) if mode == "row" else [1] * x.ndim
    noise = torch.empty(size, dtype=x.dtype, device=x.device).bernoulli_(survival)
    if survival > 0.0:
        noise.div_(survival)
    return x * noise


torch.fx.wrap("stochastic_depth")


class StochasticDepth(nn.Module):
    """torchvision.ops.StochasticDepth."""

    def __init__(self, p: float, mode: str):
        super().__init__()
        self.p, self.mode = p, mode

    def forward(self, x: Tensor) -> Tensor:
        return stochastic_depth(x, self.p, self.mode, self.training)


# -- ResNet ----------------------------------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, block, layers, num_classes=10, width=64):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, 2 * width, layers[1], 2)
        self.layer3 = self._make_layer(block, 4 * width, layers[2], 2)
        self.layer4 = self._make_layer(block, 8 * width, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, block, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride, bias=False),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


def resnet18(num_classes=10, width=64):
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, width)


def resnet34(num_classes=10, width=64):
    return ResNet(BasicBlock, [3, 4, 6, 3], num_classes, width)


def resnet50(num_classes=10, width=64):
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, width)


# -- VGG-11 with BatchNorm -------------------------------------------------------------------------------------------
class VGG(nn.Module):
    def __init__(self, features, num_classes=10, dropout=0.5, hidden=4096, pool=7):
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((pool, pool))
        last = [m for m in features if isinstance(m, nn.Conv2d)][-1].out_channels
        self.classifier = nn.Sequential(
            nn.Linear(last * pool * pool, hidden),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def vgg11_bn(num_classes=10, width_mult=1.0, dropout=0.5, hidden=4096, pool=7):
    layers, cin = [], 3
    for v in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            c = max(8, int(v * width_mult))
            layers += [nn.Conv2d(cin, c, kernel_size=3, padding=1), nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
            cin = c
    return VGG(nn.Sequential(*layers), num_classes, dropout, hidden, pool)


# -- MobileNetV2 -----------------------------------------------------------------------------------------------------
class InvertedResidualV2(nn.Module):
    def __init__(self, inp, oup, stride, expand_ratio, norm_layer=nn.BatchNorm2d):
        super().__init__()
        self.stride = stride
        hidden = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(Conv2dNormActivation(inp, hidden, 1, norm_layer=norm_layer, activation_layer=nn.ReLU6))
        layers += [
            Conv2dNormActivation(
                hidden, hidden, stride=stride, groups=hidden, norm_layer=norm_layer, activation_layer=nn.ReLU6
            ),
            nn.Conv2d(hidden, oup, 1, 1, 0, bias=False),
            norm_layer(oup),
        ]
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x):
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes=10, width_mult=1.0, dropout=0.2, max_blocks=None, round_nearest=8):
        super().__init__()
        setting = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1], [6, 160, 3, 2]]
        setting.append([6, 320, 1, 1])
        cin = _make_divisible(32 * width_mult, round_nearest)
        self.last_channel = _make_divisible(1280 * max(1.0, width_mult), round_nearest)
        features: list[nn.Module] = [Conv2dNormActivation(3, cin, stride=2, activation_layer=nn.ReLU6)]
        for t, c, n, s in setting:
            out = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                if max_blocks is not None and len(features) > max_blocks:
                    break
                features.append(InvertedResidualV2(cin, out, s if i == 0 else 1, expand_ratio=t))
                cin = out
        features.append(Conv2dNormActivation(cin, self.last_channel, 1, activation_layer=nn.ReLU6))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(self.last_channel, num_classes))
        _init_mobile(self)

    def forward(self, x):
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        x = torch.flatten(x, 1)
        return self.classifier(x)


def _init_mobile(model):
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)


# -- MobileNetV3-small -----------------------------------------------------------------------------------------------
class InvertedResidualV3(nn.Module):
    def __init__(self, cin, kernel, expanded, out, use_se, use_hs, stride, norm_layer):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == out
        act = nn.Hardswish if use_hs else nn.ReLU
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(Conv2dNormActivation(cin, expanded, 1, norm_layer=norm_layer, activation_layer=act))
        layers.append(
            Conv2dNormActivation(
                expanded, expanded, kernel, stride, groups=expanded, norm_layer=norm_layer, activation_layer=act
            )
        )
        if use_se:
            layers.append(
                SqueezeExcitation(expanded, _make_divisible(expanded // 4, 8), scale_activation=nn.Hardsigmoid)
            )
        layers.append(Conv2dNormActivation(expanded, out, 1, norm_layer=norm_layer, activation_layer=None))
        self.block = nn.Sequential(*layers)
        self.out_channels = out

    def forward(self, x):
        result = self.block(x)
        if self.use_res_connect:
            result += x
        return result


class MobileNetV3(nn.Module):
    """mobilenet_v3_small: BatchNorm eps 1e-3, momentum 0.01; Hardswish / ReLU; SE gates with Hardsigmoid."""

    def __init__(self, num_classes=10, width_mult=1.0, dropout=0.2, max_blocks=None):
        super().__init__()

        def ch(c):
            return _make_divisible(c * width_mult, 8)

        conf = [
            (16, 3, 16, 16, True, False, 2),
            (16, 3, 72, 24, False, False, 2),
            (24, 3, 88, 24, False, False, 1),
            (24, 5, 96, 40, True, True, 2),
            (40, 5, 240, 40, True, True, 1),
            (40, 5, 240, 40, True, True, 1),
            (40, 5, 120, 48, True, True, 1),
            (48, 5, 144, 48, True, True, 1),
            (48, 5, 288, 96, True, True, 2),
            (96, 5, 576, 96, True, True, 1),
            (96, 5, 576, 96, True, True, 1),
        ][:max_blocks]
        last_channel = ch(1024)
        norm_layer = partial(nn.BatchNorm2d, eps=0.001, momentum=0.01)
        layers: list[nn.Module] = [
            Conv2dNormActivation(3, ch(conf[0][0]), stride=2, norm_layer=norm_layer, activation_layer=nn.Hardswish)
        ]
        for cin, k, exp, out, se, hs, s in conf:
            layers.append(InvertedResidualV3(ch(cin), k, ch(exp), ch(out), se, hs, s, norm_layer))
        lastconv_in = ch(conf[-1][3])
        lastconv_out = 6 * lastconv_in
        layers.append(
            Conv2dNormActivation(lastconv_in, lastconv_out, 1, norm_layer=norm_layer, activation_layer=nn.Hardswish)
        )
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(lastconv_out, last_channel),
            nn.Hardswish(inplace=True),
            nn.Dropout(p=dropout, inplace=True),
            nn.Linear(last_channel, num_classes),
        )
        _init_mobile(self)

    def forward(self, x):
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


# -- EfficientNet-B0 -------------------------------------------------------------------------------------------------
class MBConv(nn.Module):
    def __init__(self, expand_ratio, kernel, stride, cin, out, sd_prob, norm_layer=nn.BatchNorm2d):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == out
        expanded = _make_divisible(cin * expand_ratio, 8)
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(Conv2dNormActivation(cin, expanded, 1, norm_layer=norm_layer, activation_layer=nn.SiLU))
        layers.append(
            Conv2dNormActivation(
                expanded, expanded, kernel, stride, groups=expanded, norm_layer=norm_layer, activation_layer=nn.SiLU
            )
        )
        layers.append(SqueezeExcitation(expanded, max(1, cin // 4), activation=partial(nn.SiLU, inplace=True)))
        layers.append(Conv2dNormActivation(expanded, out, 1, norm_layer=norm_layer, activation_layer=None))
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = StochasticDepth(sd_prob, "row")
        self.out_channels = out

    def forward(self, x):
        result = self.block(x)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += x
        return result


class EfficientNet(nn.Module):
    """efficientnet_b0: SiLU, SE gates with Sigmoid, stochastic depth rising linearly to 0.2 over the blocks."""

    def __init__(self, num_classes=10, width_mult=1.0, dropout=0.2, stochastic_depth_prob=0.2, max_layers=None):
        super().__init__()

        def ch(c):
            return _make_divisible(c * width_mult, 8)

        setting = [
            (1, 3, 1, 32, 16, 1),
            (6, 3, 2, 16, 24, 2),
            (6, 5, 2, 24, 40, 2),
            (6, 3, 2, 40, 80, 3),
            (6, 5, 1, 80, 112, 3),
            (6, 5, 2, 112, 192, 4),
            (6, 3, 1, 192, 320, 1),
        ]
        if max_layers is not None:
            setting = [(e, k, s, i, o, min(n, max_layers)) for e, k, s, i, o, n in setting]
        layers: list[nn.Module] = [Conv2dNormActivation(3, ch(setting[0][3]), stride=2, activation_layer=nn.SiLU)]
        total = sum(n for *_, n in setting)
        block_id = 0
        for e, k, s, cin, cout, n in setting:
            stage = []
            for j in range(n):
                sd = stochastic_depth_prob * float(block_id) / total
                stage.append(MBConv(e, k, s if j == 0 else 1, ch(cin) if j == 0 else ch(cout), ch(cout), sd))
                block_id += 1
            layers.append(nn.Sequential(*stage))
        last_in = ch(setting[-1][4])
        last_out = 4 * last_in
        layers.append(Conv2dNormActivation(last_in, last_out, 1, activation_layer=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout, inplace=True), nn.Linear(last_out, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                r = 1.0 / math.sqrt(m.out_features)
                nn.init.uniform_(m.weight, -r, r)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def mobilenet_v2(num_classes=10, **kw):
    return MobileNetV2(num_classes, **kw)


def mobilenet_v3_small(num_classes=10, **kw):
    return MobileNetV3(num_classes, **kw)


def efficientnet_b0(num_classes=10, **kw):
    return EfficientNet(num_classes, **kw)


ZOO = {
    "resnet18": resnet18,
    "resnet34": resnet34,
    "resnet50": resnet50,
    "vgg11_bn": vgg11_bn,
    "mobilenet_v2": mobilenet_v2,
    "mobilenet_v3_small": mobilenet_v3_small,
    "efficientnet_b0": efficientnet_b0,
}
