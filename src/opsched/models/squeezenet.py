"""SqueezeNet v1.0 with bypass connections (Iandola et al. 2016), the variant IOS benchmarks.

``bypass="simple"`` adds identity shortcuts around the fire modules whose input and output widths
match (fire3, fire5, fire7, fire9); ``"complex"`` (the default) also adds 1x1-convolution shortcuts around
the others, which gives the scheduler branches to run side by side; ``"none"`` is the plain network.
"""

from __future__ import annotations

import torch
from torch import nn

# (squeeze, expand) channels of fire2..fire9; each fire outputs 2 * expand channels.
_FIRES = [(16, 64), (16, 64), (32, 128), (32, 128), (48, 192), (48, 192), (64, 256), (64, 256)]


class Fire(nn.Module):
    def __init__(self, in_channels: int, squeeze: int, expand: int):
        super().__init__()
        self.squeeze = nn.Conv2d(in_channels, squeeze, 1)
        self.expand1x1 = nn.Conv2d(squeeze, expand, 1)
        self.expand3x3 = nn.Conv2d(squeeze, expand, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.relu(self.squeeze(x))
        return torch.cat([torch.relu(self.expand1x1(s)), torch.relu(self.expand3x3(s))], 1)


class SqueezeNet(nn.Module):
    def __init__(self, num_classes: int = 1000, bypass: str = "complex"):
        super().__init__()
        if bypass not in {"none", "simple", "complex"}:
            raise ValueError(f"bypass must be none, simple or complex, not {bypass!r}")
        self.conv1 = nn.Conv2d(3, 96, 7, stride=2)
        self.pool = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.fires = nn.ModuleList()
        self.shortcuts = nn.ModuleDict()
        self.identity = set()
        channels = 96
        for i, (squeeze, expand) in enumerate(_FIRES):
            out = 2 * expand
            self.fires.append(Fire(channels, squeeze, expand))
            if bypass != "none" and channels == out:
                self.identity.add(i)
            elif bypass == "complex":
                self.shortcuts[str(i)] = nn.Conv2d(channels, out, 1)
            channels = out
        self.dropout = nn.Dropout(0.5)
        self.conv10 = nn.Conv2d(channels, num_classes, 1)
        self.avgpool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        for i, fire in enumerate(self.fires):
            if i in (3, 7):
                x = self.pool(x)
            y = fire(x)
            if i in self.identity:
                y = y + x
            elif str(i) in self.shortcuts:
                y = y + self.shortcuts[str(i)](x)
            x = y
        x = torch.relu(self.conv10(self.dropout(x)))
        return torch.flatten(self.avgpool(x), 1)


def squeezenet(batch: int = 1, image_size: int | None = None, bypass: str = "complex", num_classes: int = 1000):
    """SqueezeNet with bypass at 224x224 (or ``image_size``); returns ``(model, (x,))``."""
    torch.manual_seed(0)
    size = image_size or 224
    return SqueezeNet(num_classes, bypass).eval(), (torch.randn(batch, 3, size, size),)
