"""ResNets for 32×32 images (CIFAR stem), with BatchNorm or GroupNorm.

One implementation, :class:`ResNet`, takes the block type and the number of blocks per stage;
:class:`ResNet18`, :class:`ResNet34` and :class:`ResNet50` only fix those two and expose the settings a recipe sets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch.nn.functional as F
from torch import Tensor, nn

from fedlight.errors import check

NormFactory = Callable[[int], nn.Module]


def _norm_factory(norm: str, group_norm_groups: int) -> NormFactory:
    check(norm in ("batch", "group"), f"`model.norm` must be 'batch' or 'group', got {norm!r}")
    if norm == "batch":
        return nn.BatchNorm2d
    check(
        isinstance(group_norm_groups, int) and group_norm_groups >= 1 and 64 % group_norm_groups == 0,
        f"`model.group_norm_groups` must be a positive divisor of 64 (every ResNet width is a multiple of 64), "
        f"got {group_norm_groups!r}",
    )
    return lambda c: nn.GroupNorm(group_norm_groups, c)


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int, norm: NormFactory) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = norm(planes)
        self.shortcut = _shortcut(in_planes, planes * self.expansion, stride, norm)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3, 1×1 expand (×4) with a residual connection (ResNet-50)."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int, norm: NormFactory) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = norm(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = norm(planes * self.expansion)
        self.shortcut = _shortcut(in_planes, planes * self.expansion, stride, norm)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


def _shortcut(in_planes: int, out_planes: int, stride: int, norm: NormFactory) -> nn.Module:
    if stride == 1 and in_planes == out_planes:
        return nn.Sequential()
    return nn.Sequential(nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False), norm(out_planes))


class ResNet(nn.Module):
    """ResNet with a CIFAR stem: 3×3 conv, stride 1, 64 channels, no max-pool.

    Four stages of widths 64/128/256/512 (strides 1/2/2/2), global average pooling, and
    ``Linear(512 * block.expansion, num_classes)``. Shortcuts that change shape are 1×1 conv + norm.
    Subclasses choose the depth through the class attributes ``block`` and ``num_blocks``.

    Args:
        num_classes: Number of output logits.
        norm: "group" (GroupNorm with ``group_norm_groups`` groups; no buffers) or "batch" (BatchNorm2d).
        group_norm_groups: Groups of every GroupNorm; must divide 64. Ignored for norm="batch".
        in_channels: Image channels.
    """

    block: type[BasicBlock] | type[Bottleneck] = BasicBlock
    num_blocks: tuple[int, int, int, int] = (2, 2, 2, 2)

    def __init__(
        self,
        num_classes: int = 10,
        norm: Literal["batch", "group"] = "group",
        group_norm_groups: int = 2,
        in_channels: int = 3,
    ) -> None:
        block, num_blocks = self.block, self.num_blocks
        super().__init__()
        for name, value in (("num_classes", num_classes), ("in_channels", in_channels)):
            check(isinstance(value, int) and value >= 1, f"`model.{name}` must be a positive integer, got {value!r}")
        check(len(num_blocks) == 4, f"a ResNet needs 4 stages, got num_blocks={list(num_blocks)}")
        make_norm = _norm_factory(norm, group_norm_groups)
        self.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = make_norm(64)
        in_planes = 64
        stages = []
        for i, (planes, n) in enumerate(zip((64, 128, 256, 512), num_blocks)):
            blocks = []
            for j in range(n):
                stride = 2 if i > 0 and j == 0 else 1
                blocks.append(block(in_planes, planes, stride, make_norm))
                in_planes = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.linear = nn.Linear(512 * block.expansion, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


class ResNet18(ResNet):
    """ResNet-18 (BasicBlock, [2, 2, 2, 2]) with a CIFAR stem; 11.22M parameters for 100 classes.

    The seed papers' default is GroupNorm with 2 groups.

    Args:
        num_classes: Number of output logits.
        norm: "group" (GroupNorm, no buffers) or "batch" (BatchNorm2d with running statistics).
        group_norm_groups: Groups of every GroupNorm; must divide 64. Ignored for norm="batch".
        in_channels: Image channels.
    """

    block, num_blocks = BasicBlock, (2, 2, 2, 2)


class ResNet34(ResNet):
    """ResNet-34 (BasicBlock, [3, 4, 6, 3]) with a CIFAR stem.

    Args:
        num_classes: Number of output logits.
        norm: "group" (GroupNorm, no buffers) or "batch" (BatchNorm2d with running statistics).
        group_norm_groups: Groups of every GroupNorm; must divide 64. Ignored for norm="batch".
        in_channels: Image channels.
    """

    block, num_blocks = BasicBlock, (3, 4, 6, 3)


class ResNet50(ResNet):
    """ResNet-50 (Bottleneck, [3, 4, 6, 3]) with a CIFAR stem.

    Args:
        num_classes: Number of output logits.
        norm: "group" (GroupNorm, no buffers) or "batch" (BatchNorm2d with running statistics).
        group_norm_groups: Groups of every GroupNorm; must divide 64. Ignored for norm="batch".
        in_channels: Image channels.
    """

    block, num_blocks = Bottleneck, (3, 4, 6, 3)
