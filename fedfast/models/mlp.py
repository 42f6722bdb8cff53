"""Small MLPs: McMahan et al.'s 2NN (784-200-200-10, 199,210 parameters) and a generic one."""

from __future__ import annotations

from torch import nn


class MLP(nn.Sequential):
    def __init__(self, in_features: int = 784, hidden=(200, 200), num_classes: int = 10):
        layers, c = [nn.Flatten()], in_features
        for h in hidden:
            layers += [nn.Linear(c, h), nn.ReLU()]
            c = h
        super().__init__(*layers, nn.Linear(c, num_classes))
